"""Triton top-1 of logits rows: the argmax token and its softmax probability, in one pass over the vocabulary.

Matches `diffulex.sampler.token_sampling.greedy` applied to logits whose ids ``>= vocab_limit`` and ``banned_id``
are set to ``-inf``, without writing that banned copy or the ``[N, V]`` probabilities: greedy decoding needs two
numbers per row, and at a real vocabulary (151936 ids) materializing fp32 probabilities costs more memory
traffic than the whole rest of the sampler.

Design: one program per row walks the allowed ids in ``BLOCK_V`` tiles, loading any float dtype and doing all
math in fp32. It keeps an online maximum ``m``, the id of its first occurrence (a tile replaces the running id
only when its maximum is strictly larger, and ``tl.max`` breaks ties to the left, so ties go to the lowest id,
as in the reference), and ``s = sum(exp(x - m))`` rescaled whenever ``m`` grows. The probability of the argmax
is ``1 / s``: what softmax gives its top entry, ``exp(m - logsumexp)``, without the rounding of forming the
logsumexp. While ``m`` is still ``-inf`` (leading tiles of banned or ``-inf`` ids) the exponentials are guarded
so they add zeros, never NaN. No host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _top1_kernel(
    logits_ptr,
    token_ptr,
    conf_ptr,
    stride_row,
    vocab_limit,
    banned_id,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.zeros((), tl.int32)
    for start in range(0, vocab_limit, BLOCK_V):
        ids = start + offs
        ok = (ids < vocab_limit) & (ids != banned_id)
        x = tl.load(base + ids, mask=ok, other=float("-inf")).to(tl.float32)
        tile_max, tile_arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best = tl.where(tile_max > m, start + tile_arg, best)
        m_new = tl.maximum(m, tile_max)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf - 0) = 0, not NaN
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    tl.store(token_ptr + row, best.to(tl.int64))
    tl.store(conf_ptr + row, tl.fdiv(tl.full((), 1.0, tl.float32), s, ieee_rounding=True))


def triton_top1(
    logits: torch.Tensor, vocab_limit: int | None = None, banned_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens int64 [N], conf float32 [N])`` of ``logits [N, V]``, ignoring ids ``>= vocab_limit`` and ``banned_id``.

    Rows with no allowed finite logit have no defined answer (the reference gives NaN there).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    limit = vocab if vocab_limit is None else min(vocab_limit, vocab)
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    conf = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return tokens, conf
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    banned = -1 if banned_id is None else banned_id
    _top1_kernel[(num_rows,)](logits, tokens, conf, logits.stride(0), limit, banned, BLOCK_V=4096, num_warps=8)
    return tokens, conf
