"""Triton edit acceptance of every block of a step in one launch: `diffulex.strategy.edit.acceptance.edit_acceptance`.

The PyTorch version is some twenty tiny kernels (comparisons, three scatters, gathers) whatever the batch size, tens
of microseconds of GPU time in a step's sampling graph. Here one program owns one block, whose rows are
contiguous (``starts[s] .. starts[s + 1]``): it loads their proposals, confidences and current tokens, and writes
the rule's flags. Thresholds are passed as the largest float32 not above them, so that ``conf > t`` in float32
takes exactly the confidences the host rule's Python comparison takes (as in `diffulex.kernels.acceptance`).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

# the block phases of `diffulex.strategy.edit.acceptance.EditPhase` (plain ints: kernels sit below the strategies)
_TIMED_OUT = 1
_CLOSED = 2
_PHASE_SPAN = 4  # `diffulex.strategy.edit.acceptance.PHASE_SPAN`: a block's staged entry holds counts above its phase


@triton.jit
def _edit_accept_kernel(
    tokens_ptr, conf_ptr, current_ptr, starts_ptr, phase_ptr, out_ptr, mask_id, accept_t, edit_t,
    TIMED_OUT: tl.constexpr, CLOSED: tl.constexpr, PHASE_SPAN: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)
    seg = tl.program_id(0)
    lo = tl.load(starts_ptr + seg)
    hi = tl.load(starts_ptr + seg + 1)
    phase = tl.load(phase_ptr + seg) % PHASE_SPAN  # a staged entry carries counts above its phase
    offs = tl.arange(0, BLOCK)
    ok = offs < hi - lo
    wait_for_inputs(USE_PDL)  # proposals and confidences come from the top-1 just before
    conf = tl.load(conf_ptr + lo + offs, mask=ok, other=float("-inf"))
    tokens = tl.load(tokens_ptr + lo + offs, mask=ok, other=0)
    current = tl.load(current_ptr + lo + offs, mask=ok, other=0)
    sampled = ok & (conf > float("-inf"))
    is_mask = sampled & (current == mask_id)
    fill = is_mask & (conf > accept_t)
    edit = sampled & (current != mask_id) & (tokens != current) & (conf > edit_t)
    hits = tl.sum(fill.to(tl.int32), axis=0)
    mask_conf = tl.where(is_mask, conf, float("-inf"))
    best = tl.max(mask_conf, axis=0)
    first_best = tl.min(tl.where(is_mask & (mask_conf == best), offs, BLOCK), axis=0)
    fallback = is_mask & (hits == 0) & (offs == first_best)
    accept = tl.where(phase == TIMED_OUT, is_mask | edit, fill | fallback | edit) & (phase != CLOSED)
    tl.store(out_ptr + lo + offs, accept.to(out_ptr.dtype.element_ty), mask=ok)


def _float32_below(threshold: float) -> float:
    """The largest float32 not above ``threshold``: ``conf > it`` in float32 iff ``conf > threshold`` in float64."""
    t32 = np.float32(threshold)
    if float(t32) > threshold:
        t32 = np.nextafter(t32, np.float32(-np.inf))
    return float(t32)


def triton_edit_acceptance(
    tokens: torch.Tensor,
    conf: torch.Tensor,
    current: torch.Tensor,
    starts: torch.Tensor,
    phase: torch.Tensor,
    mask_token_id: int,
    accept_threshold: float,
    edit_threshold: float,
    max_rows: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Writes into ``out`` (contiguous int64 ``[N]``, such as a row of the sampler's ``[2, N]`` result) the 0/1 flags
    of the rows of the blocks starting at ``starts [S + 1]`` (int64, the last entry ``N`` or less), each in phase
    ``phase [S]``; ``max_rows`` bounds a block. Rows that no block covers (padding) are left as they were."""
    if out.shape != conf.shape or out.dtype != torch.int64 or not out.is_contiguous() or out.device != conf.device:
        raise ValueError(f"out must be a contiguous int64 {tuple(conf.shape)} tensor on {conf.device}")
    num_segments = starts.shape[0] - 1
    if num_segments > 0:
        use_pdl = pdl_enabled(conf.device, conf.shape[0])
        _edit_accept_kernel[(num_segments,)](
            tokens, conf, current, starts, phase, out, mask_token_id,
            _float32_below(accept_threshold), _float32_below(edit_threshold),
            TIMED_OUT=_TIMED_OUT, CLOSED=_CLOSED, PHASE_SPAN=_PHASE_SPAN,
            BLOCK=max(16, triton.next_power_of_2(max_rows)),
            USE_PDL=use_pdl, num_warps=1, **launch_kwargs(use_pdl),
        )  # fmt: skip
    return out
