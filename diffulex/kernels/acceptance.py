"""Triton acceptance of every block of a step in one launch: `diffulex.sampler.acceptance.accept_confident_segments`.

The PyTorch version costs about fifteen tiny kernels (scatters, gathers, comparisons) whatever the batch size; at
batch 1 that is tens of microseconds of a step that should take about one millisecond. Here one program owns one
block: its rows are contiguous (``starts[s] .. starts[s + 1]``), so it loads their confidences, accepts those above
the threshold and, when none is and the block may force, the first row holding the block's maximum (unless that
is ``-inf``: rows at ``-inf`` are not candidates, see `diffulex.sampler.acceptance.accept_confident`). The
threshold is passed as the largest float32 not above it, so that ``conf > t`` in float32 accepts exactly the
confidences the reference's float64 test accepts.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from diffulex.kernels.pdl import PDL_MAX_ROWS, launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs


@triton.jit
def _accept_kernel(
    conf_ptr, starts_ptr, force_ptr, accept_ptr, threshold, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    release_dependents(USE_PDL)
    seg = tl.program_id(0)
    lo = tl.load(starts_ptr + seg)
    hi = tl.load(starts_ptr + seg + 1)
    offs = tl.arange(0, BLOCK)
    ok = offs < hi - lo
    force = tl.load(force_ptr + seg) != 0
    wait_for_inputs(USE_PDL)  # the confidences come from the top-1 just before; the layout is step metadata
    conf = tl.load(conf_ptr + lo + offs, mask=ok, other=float("-inf"))
    accept = (conf > threshold) & ok
    hits = tl.sum(accept.to(tl.int32), axis=0)
    best = tl.max(conf, axis=0)
    first_best = tl.min(tl.where(ok & (conf == best), offs, BLOCK), axis=0)
    # a block whose rows are all -inf (none is a candidate) forces nothing
    accept = accept | ((hits == 0) & force & (best > float("-inf")) & (offs == first_best))
    tl.store(accept_ptr + lo + offs, accept.to(accept_ptr.dtype.element_ty), mask=ok)


def triton_accept_segments(
    conf: torch.Tensor,
    starts: torch.Tensor,
    force: torch.Tensor,
    threshold: float,
    max_rows: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Accepted rows (bool ``[N]``) of ``conf [N]`` whose blocks start at ``starts [S + 1]`` (int32, the last entry
    is ``N``) and may force where ``force [S]`` is nonzero; ``max_rows`` bounds the rows of one block.

    With ``out`` (a contiguous int64 ``[N]``, such as a row of the sampler's ``[2, N]`` result) the flags are
    stored there as 0/1 and ``out`` is returned: no zero fill and no conversions, each a launch of its own at
    decode sizes. Rows that no block covers (padding) are then left as they were."""
    num_segments = starts.shape[0] - 1
    t32 = np.float32(threshold)
    if float(t32) > threshold:  # rounded up: a float32 equal to it lies above the threshold and must pass
        t32 = np.nextafter(t32, np.float32(-np.inf))
    if out is not None:
        if out.shape != conf.shape or out.dtype != torch.int64 or not out.is_contiguous() or out.device != conf.device:
            raise ValueError(f"out must be a contiguous int64 {tuple(conf.shape)} tensor on {conf.device}")
        accept = out
    else:
        accept = torch.zeros(conf.shape[0], dtype=torch.int8, device=conf.device)
    if num_segments > 0:
        block = max(16, triton.next_power_of_2(max_rows))
        use_pdl = pdl_enabled(conf.device, conf.shape[0])
        _accept_kernel[(num_segments,)](
            conf, starts, force, accept, float(t32), BLOCK=block, USE_PDL=use_pdl, num_warps=1,
            **launch_kwargs(use_pdl),
        )
    return accept if out is not None else accept.bool()


def warm_up(device: torch.device, threshold: float, max_rows: int) -> None:
    """Compile the variants a step of 1 to `max_rows` rows in blocks of at most 16 rows launches: decode-sized
    launches chain by programmatic dependent launch and larger ones do not (`PDL_MAX_ROWS`), so there are two."""
    for rows in sorted({1, min(max_rows, PDL_MAX_ROWS + 1)}):
        conf = torch.zeros(rows, dtype=torch.float32, device=device)
        starts = torch.arange(rows + 1, dtype=torch.int64, device=device)  # a block per row
        force = torch.ones(rows, dtype=torch.int64, device=device)
        out = torch.zeros(2, rows, dtype=torch.int64, device=device)[0]
        triton_accept_segments(conf, starts, force, threshold, 1, out=out)
