"""The first layer's inputs in one launch: each token's embedding row and its rotary angles.

Why: a decode step's forward starts with two row gathers, the token embedding (``weight[input_ids]``) and the
rotary table (``table[positions]``). At decode sizes each is a launch of about 1.5 us plus a graph-internal gap of
about 1.6 us before it (measured on an H100 in the batch-1 graph), on the critical path of every step.
Here program ``(t, 0)`` copies token ``t``'s embedding row and program ``(t, 1)`` its angle row. The copies are
exact (no arithmetic), so the result equals the two gathers bit for bit. An index outside its table gives a row
of zeros rather than a device-side assert that would poison the CUDA context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

_CHUNK = 2048  # elements a program copies per loop iteration


@triton.jit
def _copy_row(src_ptr, index_ptr, n_rows, cols, dst_ptr, t, CHUNK: tl.constexpr):
    row = tl.load(index_ptr + t).to(tl.int64)
    valid = (row >= 0) & (row < n_rows)
    row = tl.where(valid, row, 0)
    readable = tl.where(valid, cols, 0)  # columns to read: none from a row outside the table
    for start in range(0, cols, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        values = tl.load(src_ptr + row * cols + offs, mask=offs < readable, other=0)
        tl.store(dst_ptr + t.to(tl.int64) * cols + offs, values, mask=offs < cols)


@triton.jit
def _token_inputs_kernel(
    emb_ptr, ids_ptr, emb_rows, emb_cols, hidden_ptr,
    ang_ptr, pos_ptr, ang_rows, ang_cols, angles_ptr,
    CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)  # the first layer's prologue may start now; it waits for these rows
    t = tl.program_id(0)
    wait_for_inputs(USE_PDL)  # the ids and positions may be the previous kernel's output
    if tl.program_id(1) == 0:
        _copy_row(emb_ptr, ids_ptr, emb_rows, emb_cols, hidden_ptr, t, CHUNK)
    else:
        _copy_row(ang_ptr, pos_ptr, ang_rows, ang_cols, angles_ptr, t, CHUNK)


def gather_token_inputs(
    embedding: torch.Tensor, input_ids: torch.Tensor, angle_table: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embedding[input_ids], angle_table[positions])`` in one launch. ``embedding [V, H]`` and ``angle_table
    [P, ...]`` contiguous on one device, ``input_ids`` and ``positions`` 1-D integer tensors of one length."""
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(
            f"need 1-D ids and positions of one length, got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
        )
    if not (embedding.is_contiguous() and angle_table.is_contiguous()):
        raise ValueError("the embedding and the angle table must be contiguous")
    tokens = input_ids.shape[0]
    hidden = torch.empty((tokens, *embedding.shape[1:]), dtype=embedding.dtype, device=embedding.device)
    angles = torch.empty((tokens, *angle_table.shape[1:]), dtype=angle_table.dtype, device=angle_table.device)
    if tokens:
        use_pdl = pdl_enabled(embedding.device, tokens)
        _token_inputs_kernel[(tokens, 2)](
            embedding, input_ids, embedding.shape[0], embedding[0].numel(), hidden,
            angle_table, positions, angle_table.shape[0], angle_table[0].numel(), angles,
            CHUNK=_CHUNK, USE_PDL=use_pdl, num_warps=4, **launch_kwargs(use_pdl),
        )
    return hidden, angles
