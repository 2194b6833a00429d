"""Triton top-1 of logits rows: the argmax token and its softmax probability, in one pass over the vocabulary.

Matches `diffulex.sampler.token_sampling.greedy` applied to logits whose ids ``>= vocab_limit`` and ``banned_id``
are set to ``-inf``, without writing that banned copy or the ``[N, V]`` probabilities: greedy decoding needs two
numbers per row, and at a real vocabulary (151936 ids) materializing fp32 probabilities costs more memory
traffic than the whole rest of the sampler.

Design: a program walks its allowed ids in ``BLOCK_V`` tiles, loading any float dtype and doing all math in
fp32. It keeps an online maximum ``m``, the id of its first occurrence (a tile replaces the running id only when
its maximum is strictly larger, and ``tl.max`` breaks ties to the left, so ties go to the lowest id, as in the
reference), and ``s = sum(exp(x - m))`` rescaled whenever ``m`` grows. The probability of the argmax is
``1 / s``: what softmax gives its top entry, ``exp(m - logsumexp)``, without the rounding of forming the
logsumexp. While ``m`` is still ``-inf`` (leading tiles of banned or ``-inf`` ids) the exponentials are guarded
so they add zeros, never NaN. No host syncs.

Split vocabulary: with few rows (decode at batch 1 samples a handful), one program per row leaves most of the GPU
idle while each walks ~37 tiles. The grid is then ``(rows, splits)``: each program folds a contiguous, tile-aligned
slice of the row and publishes its partial ``(m, id, s)`` to scratch, then bumps the row's counter (acq_rel
atomic); the last program of the row to arrive combines the partials (the maximum, the lowest id among the
slices that reach it, which is the row's lowest id since slices are in id order, and the ``s`` rescaled to the
common maximum), writes the answer and resets the counter to zero, so the counters need no memset between
launches. The split count comes from the row count alone (enough programs to cover the GPU twice; one per row
once the rows do that themselves), and the scratch size from the shapes, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs
from diffulex.kernels.split_counters import sm_count, split_counters

_BLOCK_V = 4096
_MAX_SPLITS = 64


@triton.jit
def _top1_kernel(
    logits_ptr,
    source_rows_ptr,  # [rows] int64 logits row of each output row, negative: padding (`HAS_SOURCE_ROWS`)
    token_ptr,
    conf_ptr,
    part_m_ptr,  # [rows * NUM_SPLITS] float32 scratch (split launches only)
    part_s_ptr,  # [rows * NUM_SPLITS] float32 scratch
    part_id_ptr,  # [rows * NUM_SPLITS] int32 scratch
    counters_ptr,  # [>= rows] int32, zero between launches: slices of the row that have finished
    stride_row,
    vocab_limit,
    banned_id,
    split_len,  # ids per slice, a multiple of BLOCK_V
    BLOCK_V: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SOURCE_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch: the source rows are read before the logits are ready
):
    release_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs = tl.arange(0, BLOCK_V)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, vocab_limit)
    if HAS_SOURCE_ROWS:
        source = tl.load(source_rows_ptr + row)
        is_read = source >= 0
        hi = tl.where(is_read, hi, lo)  # a padding row reads nothing: its token is undefined, its confidence -inf
        base = logits_ptr + tl.maximum(source, 0) * stride_row
    else:
        is_read = row >= 0
        base = logits_ptr + row * stride_row
    wait_for_inputs(USE_PDL)  # the logits come from the LM head just before
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.zeros((), tl.int32)
    for start in range(lo, hi, BLOCK_V):
        ids = start + offs
        ok = (ids < hi) & (ids != banned_id)
        x = tl.load(base + ids, mask=ok, other=float("-inf")).to(tl.float32)
        tile_max, tile_arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best = tl.where(tile_max > m, start + tile_arg, best)
        m_new = tl.maximum(m, tile_max)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf - 0) = 0, not NaN
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    if NUM_SPLITS == 1:
        tl.store(token_ptr + row, best.to(tl.int64))
        conf = tl.fdiv(tl.full((), 1.0, tl.float32), tl.where(is_read, s, 1.0), ieee_rounding=True)
        tl.store(conf_ptr + row, tl.where(is_read, conf, float("-inf")))
    else:
        slot = row * NUM_SPLITS + split
        tl.store(part_m_ptr + slot, m)
        tl.store(part_s_ptr + slot, s)
        tl.store(part_id_ptr + slot, best)
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + row, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            tl.atomic_xchg(counters_ptr + row, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            js = tl.arange(0, SPLITS_PAD)
            j_ok = js < NUM_SPLITS
            parts = row * NUM_SPLITS + js
            ms = tl.load(part_m_ptr + parts, mask=j_ok, other=float("-inf"), cache_modifier=".cg")
            ss = tl.load(part_s_ptr + parts, mask=j_ok, other=0.0, cache_modifier=".cg")
            bs = tl.load(part_id_ptr + parts, mask=j_ok, other=2147483647, cache_modifier=".cg")
            m = tl.max(ms, axis=0)
            best = tl.min(tl.where(j_ok & (ms == m), bs, 2147483647), axis=0)  # lowest id reaching the maximum
            shift = tl.where(m == float("-inf"), 0.0, m)
            s = tl.sum(ss * tl.exp(ms - shift), axis=0)
            tl.store(token_ptr + row, best.to(tl.int64))
            conf = tl.fdiv(tl.full((), 1.0, tl.float32), tl.where(is_read, s, 1.0), ieee_rounding=True)
            tl.store(conf_ptr + row, tl.where(is_read, conf, float("-inf")))


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def auto_num_splits(device: torch.device, num_rows: int, tiles: int) -> int:
    """Slices per row: about enough programs for two per SM, one per row once the rows alone give that many.

    Depends on the row count and vocabulary only (never on data), so a captured graph's launch stays valid. A
    power of two: each split count is its own compiled kernel, and the sampler's row count changes every step, so
    few distinct counts mean few compiles (all done up front by `warm_up`).
    """
    if device.type != "cuda" or num_rows == 0:
        return 1
    wanted = max(1, min(tiles, _MAX_SPLITS, (2 * sm_count(device)) // num_rows))
    return 1 << (wanted.bit_length() - 1)


def _split_plan(device: torch.device, num_rows: int, limit: int, num_splits: int | None) -> tuple[int, int]:
    """``(splits, tiles per split)`` of a launch: no empty slice, every slice a whole number of tiles."""
    tiles = max(1, triton.cdiv(limit, _BLOCK_V))
    splits = auto_num_splits(device, num_rows, tiles) if num_splits is None else num_splits
    tiles_per_split = triton.cdiv(tiles, max(1, min(splits, tiles)))
    return triton.cdiv(tiles, tiles_per_split), tiles_per_split


def warm_up(device: torch.device, vocab: int, dtype: torch.dtype, vocab_limit: int, banned_id: int | None,
            max_rows: int) -> int:
    """Compile every kernel variant a launch of 1 to `max_rows` rows can use; returns how many were run.

    A compile takes a few hundred milliseconds, so a variant first met while serving stalls that step (measured
    on an H100 at batch 64: a 0.27 s step). Call once per engine, after the model is loaded.
    """
    limit = min(vocab_limit, vocab)
    rows_of_variant: dict[tuple[int, int, bool], list[int]] = {}
    for rows in range(1, min(max_rows, 2 * sm_count(device) + 1) + 1):
        # a split plan compiles twice where it serves both decode-sized launches (chained by PDL) and larger ones
        key = (*_split_plan(device, rows, limit, None), pdl_enabled(device, rows))
        rows_of_variant.setdefault(key, []).append(rows)
    runs = 0
    for counts in rows_of_variant.values():
        # the sampler writes the tokens into row 1 of its [2, rows] result (`tokens_out`), which is 16-byte aligned
        # only for an even row count, and Triton compiles a variant per pointer alignment: one count of each parity
        for parity in (0, 1):
            rows = next((r for r in counts if r % 2 == parity), None)
            if rows is not None:
                result = torch.empty(2, rows, dtype=torch.int64, device=device)
                triton_top1(
                    torch.zeros(rows, vocab, dtype=dtype, device=device), vocab_limit, banned_id, tokens_out=result[1]
                )
                runs += 1
    return runs


def triton_top1(
    logits: torch.Tensor,
    vocab_limit: int | None = None,
    banned_id: int | None = None,
    num_splits: int | None = None,
    source_rows: torch.Tensor | None = None,
    tokens_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens int64 [N], conf float32 [N])`` of ``logits [N, V]``, ignoring ids ``>= vocab_limit`` and ``banned_id``.

    ``num_splits`` slices each row's vocabulary over that many programs (at most one per ``BLOCK_V`` tile);
    None picks it from the row count (`auto_num_splits`). Rows with no allowed finite logit have no defined
    answer (the reference gives NaN there).

    ``source_rows`` (int64 ``[N]``) answers for ``logits[source_rows]`` without gathering them: a captured decode
    graph computes the logits of every row of its fixed shape and samples the rows a step needs, padded to the
    fixed count with negative entries, which cost no reads: their tokens are undefined and their confidence is
    ``-inf``, so no acceptance rule takes them (`diffulex.sampler.acceptance`).

    ``tokens_out`` (contiguous int64 ``[N]``) receives the tokens instead of a new tensor, so that a caller
    assembling a result (the sampler's ``[2, N]``) needs no copy launch.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if source_rows is not None:
        if source_rows.dim() != 1 or source_rows.dtype != torch.int64 or source_rows.device != logits.device:
            raise ValueError("source_rows must be a 1-D int64 tensor on the logits' device")
        num_rows = source_rows.shape[0]
    limit = vocab if vocab_limit is None else min(vocab_limit, vocab)
    if tokens_out is not None:
        if (
            tokens_out.shape != (num_rows,) or tokens_out.dtype != torch.int64 or not tokens_out.is_contiguous()
            or tokens_out.device != logits.device
        ):
            raise ValueError(f"tokens_out must be a contiguous int64 [{num_rows}] tensor on {logits.device}")
        tokens = tokens_out
    else:
        tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    conf = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return tokens, conf
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    banned = -1 if banned_id is None else banned_id
    splits, tiles_per_split = _split_plan(logits.device, num_rows, limit, num_splits)
    if splits > 1:
        part_m = torch.empty(num_rows * splits, dtype=torch.float32, device=logits.device)
        part_s = torch.empty_like(part_m)
        part_id = torch.empty(num_rows * splits, dtype=torch.int32, device=logits.device)
        counters = split_counters(logits.device, num_rows)
    else:
        part_m = part_s = part_id = counters = conf  # never read
    use_pdl = pdl_enabled(logits.device, num_rows)
    _top1_kernel[(num_rows, splits)](
        logits,
        source_rows if source_rows is not None else tokens,
        tokens,
        conf,
        part_m,
        part_s,
        part_id,
        counters,
        logits.stride(0),
        limit,
        banned,
        tiles_per_split * _BLOCK_V,
        BLOCK_V=_BLOCK_V,
        NUM_SPLITS=splits,
        SPLITS_PAD=_next_pow2(splits),
        HAS_SOURCE_ROWS=source_rows is not None,
        USE_PDL=use_pdl,
        num_warps=8,
        **launch_kwargs(use_pdl),
    )
    return tokens, conf
