"""Gemma's RMSNorm in one launch, with the adds around it folded in.

Gemma rounds differently from the Llama convention of `diffulex.kernels.fused_norm`: the learned weight (when
there is one) multiplies the normalized value in fp32 and the product is rounded to the input dtype once, and
several of its norms come without a weight. DiffusionGemma also wraps most norms in adds: the input may be a sum
(``norm(a + b)``: the sum of the dense MLP's and the experts' outputs) and the result may be added to a residual
(``h + norm(x)``: every post-norm). In eager PyTorch each norm is about eight kernels (casts to and from fp32, the
square, the mean, the power, two products) and each add one more, all streaming fp32 copies of the rows: at
DiffusionGemma-26B-A4B's 11 norms a layer they took a quarter of a denoising step (profiled on an H100, batch 8:
41 of 104 ms of GPU time). Here it is one launch that reads each input once and writes the result once.

The roundings are the torch code's (`diffulex.layers.norm.gemma_rms_norm`, the CPU path and the reference): the
sum ``a + b`` rounded to the input dtype, ``x32 * rsqrt(sum(x32^2) * (1/N) + eps)`` (times the weight) rounded
once, then the residual add rounded. Only the order of the fp32 sum of squares differs, which can move an output
by one ulp, rarely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffulex.kernels.fused_norm import _next_pow2, _norm_warps, as_rows, cast_rne, row_tile, rows_per_program
from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

# Widest row one program holds in registers; wider rows take the torch path.
MAX_GEMMA_NORM_COLS = 16384


@triton.jit(do_not_specialize=["n_rows"])
def _gemma_rms_norm_kernel(
    x_ptr,
    plus_ptr,
    w_ptr,
    add_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_p,
    stride_a,
    stride_o,
    inv_n,
    eps,
    HAS_PLUS: tl.constexpr,  # the input is x + plus (rounded to x's dtype)
    HAS_WEIGHT: tl.constexpr,
    HAS_ADD: tl.constexpr,  # the output is add + norm (rounded)
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)
    rows, cols, col_ok, mask = row_tile(n_rows, n_cols, BLOCK_R, BLOCK_N)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    wait_for_inputs(USE_PDL)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_PLUS:
        p = tl.load(plus_ptr + rows[:, None] * stride_p + cols[None, :], mask=mask, other=0.0)
        x = cast_rne(x.to(tl.float32) + p.to(tl.float32), out_ptr.dtype.element_ty)
    x32 = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=1) * inv_n + eps)
    normed = x32 * rstd[:, None]
    if HAS_WEIGHT:
        normed = normed * w[None, :]
    y = cast_rne(normed, out_ptr.dtype.element_ty)
    if HAS_ADD:
        a = tl.load(add_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0)
        y = cast_rne(a.to(tl.float32) + y.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], y, mask=mask)


def gemma_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    plus: torch.Tensor | None = None,
    then_add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``then_add + norm(x + plus) * weight`` (each optional part left out when None) over the last dimension, in
    ``x``'s dtype and shape (contiguous). ``plus`` and ``then_add`` have ``x``'s shape and dtype; rows may be
    strided."""
    n_cols = x.shape[-1]
    for name, other in (("plus", plus), ("then_add", then_add)):
        if other is not None and (other.shape != x.shape or other.dtype != x.dtype):
            raise ValueError(f"{name} must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                             f"{tuple(other.shape)} {other.dtype}")  # fmt: skip
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = as_rows(x)
    p2 = x2 if plus is None else as_rows(plus)
    a2 = x2 if then_add is None else as_rows(then_add)
    n_rows = x2.shape[0]
    block_n = _next_pow2(n_cols)
    block_r = rows_per_program(block_n, n_rows)
    use_pdl = pdl_enabled(x.device, n_rows)
    _gemma_rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x2,
        p2,
        x2 if weight is None else weight if weight.is_contiguous() else weight.contiguous(),
        a2,
        out.view(-1, n_cols),
        n_rows,
        n_cols,
        x2.stride(0),
        p2.stride(0),
        a2.stride(0),
        n_cols,
        1.0 / n_cols,
        eps,
        HAS_PLUS=plus is not None,
        HAS_WEIGHT=weight is not None,
        HAS_ADD=then_add is not None,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        USE_PDL=use_pdl,
        num_warps=_norm_warps(block_n),
        enable_fp_fusion=False,
        **launch_kwargs(use_pdl),
    )
    return out
