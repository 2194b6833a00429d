"""The edit rule (`diffulex.strategy.edit.sampler.EditSampler`) on the device, for a step sampled inside a CUDA
graph: which rows of each block a greedy edit step writes, from every row's top-1 proposal and confidence and the
token the row holds now.

Fixed shapes and no read-back, so a graph can capture it: blocks are segments of the rows (``segment [N]``, padded
rows in a last segment of their own), and what the host knows of each block before the step (its `EditPhase`)
comes in with the step's inputs. The host turns the flags into writes and verdicts
(`diffulex.strategy.edit.sampler.EditLayout`). On CUDA one Triton launch does it (`diffulex.kernels.edit_acceptance`),
elsewhere the PyTorch version here.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from diffulex.layers.dispatch import triton_available


class EditPhase(IntEnum):
    """What a block's step may do, known on the host before it runs."""

    EDITING = 0  # fill masks (the confident ones, else the most confident one) and make confident edits
    TIMED_OUT = 1  # its last step: every mask takes its proposal, and confident edits
    CLOSED = 2  # no mask and its post-edit steps used up: it writes nothing


def edit_acceptance(
    tokens: torch.Tensor,
    conf: torch.Tensor,
    current: torch.Tensor,
    segment: torch.Tensor,
    phase: torch.Tensor,
    mask_token_id: int,
    accept_threshold: float,
    edit_threshold: float,
) -> torch.Tensor:
    """``[N]`` int64 flags: whether each row's proposal ``tokens [N]`` (at confidence ``conf [N]``, float32; ``-inf``
    for rows not sampled) is written over ``current [N]``. ``segment [N]`` is each row's block, ``phase [S]`` each
    block's `EditPhase`. Thresholds compare in float64, as the host rule compares Python floats."""
    rows = tokens.shape[0]
    blocks = phase.shape[0]
    sampled = torch.isfinite(conf)
    conf64 = conf.double()
    is_mask = (current == mask_token_id) & sampled
    confident_fill = is_mask & (conf64 > accept_threshold)
    edit = ~is_mask & sampled & (tokens != current) & (conf64 > edit_threshold)
    # a block with masks but no confident one fills its most confident mask (the first of equals)
    has_fill = torch.zeros(blocks, dtype=torch.int64, device=conf.device)
    has_fill.scatter_reduce_(0, segment, confident_fill.long(), "amax")
    mask_conf = torch.where(is_mask, conf, torch.full_like(conf, float("-inf")))
    best = torch.full((blocks,), float("-inf"), dtype=conf.dtype, device=conf.device)
    best.scatter_reduce_(0, segment, mask_conf, "amax")
    index = torch.arange(rows, device=conf.device)
    is_best = is_mask & (mask_conf == best[segment])
    first_best = torch.full((blocks,), rows, dtype=torch.int64, device=conf.device)
    first_best.scatter_reduce_(0, segment, torch.where(is_best, index, rows), "amin")
    fallback = is_mask & (has_fill[segment] == 0) & (index == first_best[segment])
    block_phase = phase[segment]
    editing = confident_fill | fallback | edit
    timed_out = is_mask | edit
    accepted = torch.where(block_phase == EditPhase.TIMED_OUT, timed_out, editing)
    return (accepted & (block_phase != EditPhase.CLOSED)).long()


def accept_edits(
    tokens: torch.Tensor,
    conf: torch.Tensor,
    current: torch.Tensor,
    segment: torch.Tensor,
    starts: torch.Tensor,
    phase: torch.Tensor,
    mask_token_id: int,
    accept_threshold: float,
    edit_threshold: float,
    max_block_rows: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """`edit_acceptance` written into ``out`` (contiguous int64 ``[N]``): one Triton launch on CUDA (which reads the
    blocks' ``starts [S + 1]`` and leaves rows of no block as they were), the PyTorch version elsewhere (which reads
    ``segment``). ``phase`` has an entry per block of ``starts``, and one more for the padded rows' segment."""
    if conf.is_cuda and triton_available():
        from diffulex.kernels.edit_acceptance import triton_edit_acceptance

        return triton_edit_acceptance(
            tokens, conf, current, starts, phase, mask_token_id, accept_threshold, edit_threshold, max_block_rows, out
        )
    flags = edit_acceptance(tokens, conf, current, segment, phase, mask_token_id, accept_threshold, edit_threshold)
    return out.copy_(flags)
