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


# A block's entry in a step's staged ``force`` (`diffulex.strategy.edit.sampler.EditLayout`): its phase in the low
# bits, and above them the two counts from which the device gives the block its phase in a continued step
# (`advance_edit_inputs`): the steps it has left, its last one included, and the post-edit steps it has left.
PHASE_SPAN = 4
COUNT_SPAN = 1 << 20


def block_state(phase: EditPhase, steps_left: int, post_edit_steps_left: int) -> int:
    """A block's staged entry: ``steps_left`` (1 on its last step, when it times out) and ``post_edit_steps_left``
    (0 once a step begun without masks would be past ``max_post_edit_steps``)."""
    return int(phase) + PHASE_SPAN * (steps_left + COUNT_SPAN * post_edit_steps_left)


def phase_of(states: torch.Tensor) -> torch.Tensor:
    """The phases of staged block entries (`block_state`)."""
    return states % PHASE_SPAN


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
    block's `EditPhase` (or its staged entry, `block_state`). Thresholds compare in float64, as the host rule compares
    Python floats."""
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
    block_phase = phase_of(phase)[segment]
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


def advance_edit_inputs(
    input_ids: torch.Tensor,
    source_rows: torch.Tensor,
    result: torch.Tensor,
    segment: torch.Tensor,
    states: torch.Tensor,
    mask_token_id: int,
    shift: int,
) -> None:
    """Turn a replayed edit step's inputs into its continuation's, in place and with fixed shapes (a graph captures
    it; `diffulex.engine.continuation` for the mechanism): each written row's token (a filled mask or an edit)
    replaces its position's input, every sampled row stays sampled (an edit step proposes for all of its block's
    positions), nothing is stored (a block is stored once its verdict says finished, and then the next step's
    rows differ: the host drops the continuation), and each block's staged entry (``states [S]``, `block_state`)
    moves one step on: a step begun without masks uses a post-edit step, and the block's phase follows from its
    counts and whether a mask is left."""
    valid = source_rows >= 0
    target = (source_rows + shift).clamp(0, input_ids.shape[0] - 1)
    current = input_ids[target]
    was_mask = valid & (current == mask_token_id)
    written = valid & (result[0] != 0)
    news = torch.full_like(input_ids, -1)
    news.scatter_reduce_(0, target, torch.where(written, result[1], -1), "amax")
    input_ids.copy_(torch.where(news >= 0, news, input_ids))
    blocks = states.shape[0]
    had_mask = torch.zeros(blocks, dtype=torch.int64, device=states.device)
    had_mask.scatter_reduce_(0, segment, was_mask.long(), "amax")
    mask_left = torch.zeros(blocks, dtype=torch.int64, device=states.device)
    mask_left.scatter_reduce_(0, segment, (was_mask & ~written).long(), "amax")
    counts = states // PHASE_SPAN
    steps_left = (counts % COUNT_SPAN - 1).clamp(min=0)
    post_left = (counts // COUNT_SPAN - (1 - had_mask)).clamp(min=0)
    phase = torch.where(
        steps_left <= 1,
        int(EditPhase.TIMED_OUT),
        torch.where((post_left == 0) & (mask_left == 0), int(EditPhase.CLOSED), int(EditPhase.EDITING)),
    )
    states.copy_(phase + PHASE_SPAN * (steps_left + COUNT_SPAN * post_left))
