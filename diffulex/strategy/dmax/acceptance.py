"""DMax's rule on the device, for a step sampled inside a CUDA graph (`diffulex.strategy.dmax.sampler`): which rows
of each block a greedy step writes, and how a continued step's inputs follow from that step's result.

Fixed shapes and no read-back, so a graph captures both: blocks are segments of the rows (``segment [N]``, padded
rows in a last segment of their own). The host reads every row's flag, proposal and confidence afterwards and
judges each block from them (`DMaxSampler.judge_block`), with the host rule's own code.
"""

from __future__ import annotations

import torch

from diffulex.layers.token_merge import StaticTokenMerge


def dmax_acceptance(
    tokens: torch.Tensor,
    conf: torch.Tensor,
    current: torch.Tensor,
    segment: torch.Tensor,
    num_segments: int,
    mask_token_id: int,
    accept_threshold: float,
) -> torch.Tensor:
    """``[N]`` int64 flags: whether each row's proposal ``tokens [N]`` (at confidence ``conf [N]``, float32; ``-inf``
    for rows not sampled) is written over ``current [N]``. A block's masks are filled from the left while their
    confidence reaches ``accept_threshold`` (its first mask alone when that one does not), and every decoded row
    whose proposal differs is refreshed. The threshold compares in float64, as the host compares Python floats."""
    rows = tokens.shape[0]
    index = torch.arange(rows, device=tokens.device)
    sampled = torch.isfinite(conf)
    is_mask = sampled & (current == mask_token_id)
    unsure = is_mask & (conf.double() < accept_threshold)
    first_unsure = torch.full((num_segments,), rows, dtype=torch.int64, device=tokens.device)
    first_unsure.scatter_reduce_(0, segment, torch.where(unsure, index, rows), "amin")
    first_mask = torch.full((num_segments,), rows, dtype=torch.int64, device=tokens.device)
    first_mask.scatter_reduce_(0, segment, torch.where(is_mask, index, rows), "amin")
    fill = is_mask & ((index < first_unsure[segment]) | (index == first_mask[segment]))
    refresh = sampled & ~is_mask & (tokens != current)
    return (fill | refresh).long()


def advance_dmax_inputs(
    input_ids: torch.Tensor,
    source_rows: torch.Tensor,
    result: torch.Tensor,
    merge: StaticTokenMerge | None,
    mask_token_id: int,
    shift: int,
    fast_path: bool,
) -> None:
    """Turn a replayed DMax step's inputs into its continuation's, in place and with fixed shapes (a graph captures
    it; `diffulex.engine.continuation` for the mechanism). ``result [3, N]`` holds each sampled row's flag, proposal
    and confidence (float64 bits). Each written row's token replaces its position's input; every sampled row stays
    sampled and nothing is stored (as in edit decoding); with token merge (``merge``: the static soft-input records
    the next forward reads) every sampled position that holds a token after the step becomes a soft input of its
    proposal at its confidence (1.0 where it held a token before, with ``fast_path``), and the others not soft: the
    records the host would stage from `DMaxSampler.judge_block`'s soft inputs."""
    num_inputs = input_ids.shape[0]
    valid = source_rows >= 0
    target = (source_rows + shift).clamp(0, num_inputs - 1)
    rows = torch.arange(source_rows.shape[0], device=input_ids.device)
    # the sampled row of each input row (-1: none), so that every update below is a gather
    owner = torch.full_like(input_ids, -1)
    owner.scatter_reduce_(0, target, torch.where(valid, rows, -1), "amax")
    has = owner >= 0
    row = owner.clamp(min=0)
    tokens = result[1][row]
    was_mask = input_ids == mask_token_id
    written = has & (result[0][row] != 0)
    if merge is not None:
        conf = result[2].view(torch.float64)[row]
        if fast_path:
            conf = torch.where(was_mask, conf, torch.ones_like(conf))
        conf = conf.clamp(0.0, 1.0)
        soft = has & (~was_mask | written)
        merge.soft.copy_(torch.where(has, soft.long(), merge.soft))
        width = merge.ids.shape[1]
        ids = torch.where(has, tokens, mask_token_id).unsqueeze(1)
        if width > 1:  # candidates past the first: the mask id at probability 0, as the host pads them
            ids = torch.cat([ids, torch.full_like(ids, mask_token_id).expand(-1, width - 1)], dim=1)
        probs = torch.zeros_like(merge.probs)
        probs[:, 0] = conf.float()
        merge.ids.copy_(torch.where(has.unsqueeze(1), ids, merge.ids))
        merge.probs.copy_(torch.where(has.unsqueeze(1), probs, merge.probs))
        merge.residual.copy_(torch.where(has, (1.0 - conf).float(), merge.residual))
    input_ids.copy_(torch.where(written, tokens, input_ids))
