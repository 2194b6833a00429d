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


@triton.jit
def _rstd(x32, inv_n, eps, AXIS: tl.constexpr = 1):
    """``rsqrt(sum(x32^2) * (1/N) + eps)`` over ``AXIS`` (the rows of a tile, or a 1-D head): every Gemma norm's
    one row statistic."""
    return tl.math.rsqrt(tl.sum(x32 * x32, axis=AXIS) * inv_n + eps)


def _row_launch(x: torch.Tensor) -> tuple[int, int, int, bool]:
    """(rows, block_r, block_n, use_pdl) of a row-wise launch over ``x``'s last dimension."""
    n_rows = x.numel() // x.shape[-1]
    block_n = _next_pow2(x.shape[-1])
    return n_rows, rows_per_program(block_n, n_rows), block_n, pdl_enabled(x.device, n_rows)


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
    normed = x32 * _rstd(x32, inv_n, eps)[:, None]
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
    n_rows, block_r, block_n, use_pdl = _row_launch(x2)
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


@triton.jit
def _norm_rotate_head(
    src,
    w_ptr,
    dst,
    cos_row,
    sin_row,
    inv_d,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HALF: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """One head: Gemma's norm (rounded once to the output dtype), then rotate-half rotary over its first ``2 *
    HALF`` dims in fp32, rounded again, as `diffulex.layers.rotary.apply_rotary` does with the normed head. A
    rotated dim's partner is normed from its own input (same row statistics), so no value crosses lanes."""
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    rstd = _rstd(x, inv_d, eps, 0)
    y = x * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    y = cast_rne(y, dst.dtype.element_ty).to(tl.float32)
    if ROTATE:
        rotated = d < 2 * HALF
        first = d < HALF
        partner = tl.where(rotated, tl.where(first, d + HALF, d - HALF), d)
        yp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32) * rstd
        if HAS_WEIGHT:
            yp = yp * tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32)
        yp = cast_rne(yp, dst.dtype.element_ty).to(tl.float32)
        angle = tl.where(first, d, d - HALF)
        c = tl.load(cos_row + angle, mask=ok & rotated, other=1.0)
        s = tl.load(sin_row + angle, mask=ok & rotated, other=0.0)
        y = tl.where(rotated, tl.where(first, y * c - yp * s, y * c + yp * s), y)
    tl.store(dst + d, cast_rne(y, dst.dtype.element_ty), mask=ok)


@triton.jit
def _gemma_attention_inputs_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    wq_ptr,
    wk_ptr,
    cos_ptr,
    sin_ptr,
    q_out,
    k_out,
    v_out,
    stride_q,
    stride_k,
    stride_v,
    stride_angle,
    angle_rows,
    inv_d,
    eps,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HALF: tl.constexpr,
):
    """Program (t, h): head ``h`` of token ``t`` over the query heads, then the key heads, then the value heads
    (normed without a weight, not rotated). Token ``t`` takes angle row ``t % angle_rows``."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    angle = (t % angle_rows) * stride_angle
    if h < HQ:
        _norm_rotate_head(q_ptr + t * stride_q + h * HEAD_DIM, wq_ptr, q_out + (t * HQ + h) * HEAD_DIM,
                          cos_ptr + angle, sin_ptr + angle, inv_d, eps, HEAD_DIM, BLOCK_D, HALF, True, True)
    elif h < HQ + HK:
        j = h - HQ
        _norm_rotate_head(k_ptr + t * stride_k + j * HEAD_DIM, wk_ptr, k_out + (t * HK + j) * HEAD_DIM,
                          cos_ptr + angle, sin_ptr + angle, inv_d, eps, HEAD_DIM, BLOCK_D, HALF, True, True)
    else:
        j = h - HQ - HK
        _norm_rotate_head(v_ptr + t * stride_v + j * HEAD_DIM, wk_ptr, v_out + (t * HK + j) * HEAD_DIM,
                          cos_ptr + angle, sin_ptr + angle, inv_d, eps, HEAD_DIM, BLOCK_D, HALF, False, False)


def gemma_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gemma attention layer's inputs from its projections in one launch: ``q [T, Hq, D]`` and ``k [T, Hk, D]``
    normed with their weights and rotated, ``v`` (``[T, Hk, D]``; None: the keys' projection, as in a global layer)
    normed without a weight. Rows may be strided (slices of one merged projection), heads contiguous. ``cos`` and
    ``sin`` are ``[P, R / 2]`` float32 angles of the first ``R`` dims, token ``t`` taking row ``t % P`` (``P = T``,
    or the positions of one of several equal canvases). The same roundings as the torch code
    (`diffulex.layers.norm.gemma_rms_norm`, then `diffulex.layers.rotary.apply_rotary` on the rounded heads): eight
    to ten launches a projection there."""
    tokens, hq, head_dim = q.shape
    hk = k.shape[1]
    values = k if v is None else v
    for name, t in (("k", k), ("v", values)):
        if t.shape != (tokens, hk, head_dim) or t.dtype != q.dtype:
            raise ValueError(f"{name} has shape {tuple(t.shape)} {t.dtype}; it must be [{tokens}, {hk}, {head_dim}] "
                             f"{q.dtype}")  # fmt: skip
    for name, t in (("q", q), ("k", k), ("v", values)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} with strides {t.stride()} must hold each token's heads contiguously")
    half = cos.shape[-1]
    angles_ok = cos.dim() == 2 and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(1) == 1
    if not angles_ok or 2 * half > head_dim or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} must be equal "
                         f"float32 [positions, <= {head_dim // 2}] with unit column stride")  # fmt: skip
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, values)]
    if tokens == 0:
        return outs[0], outs[1], outs[2]
    block_d = _next_pow2(head_dim)
    _gemma_attention_inputs_kernel[(tokens, hq + 2 * hk)](
        q, k, values, q_weight, k_weight, cos, sin, *outs, q.stride(0), k.stride(0), values.stride(0),
        cos.stride(0), cos.shape[0], 1.0 / head_dim, eps,
        HQ=hq, HK=hk, HEAD_DIM=head_dim, BLOCK_D=block_d, HALF=half,
        num_warps=max(1, min(4, block_d // 128)), enable_fp_fusion=False,
    )  # fmt: skip
    return outs[0], outs[1], outs[2]


@triton.jit(do_not_specialize=["n_rows"])
def _gemma_mlp_inputs_kernel(
    x_ptr,
    w_dense_ptr,
    w_experts_ptr,
    router_scale_ptr,
    dense_ptr,
    experts_ptr,
    router_ptr,
    n_rows,
    n_cols,
    stride_x,
    inv_n,
    eps,
    router_input_scale,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)
    rows, cols, col_ok, mask = row_tile(n_rows, n_cols, BLOCK_R, BLOCK_N)
    w_dense = tl.load(w_dense_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    w_experts = tl.load(w_experts_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    router_scale = tl.load(router_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    wait_for_inputs(USE_PDL)
    x32 = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    normed = x32 * _rstd(x32, inv_n, eps)[:, None]
    dtype = dense_ptr.dtype.element_ty
    at = rows[:, None] * n_cols + cols[None, :]
    tl.store(dense_ptr + at, cast_rne(normed * w_dense[None, :], dtype), mask=mask)
    tl.store(experts_ptr + at, cast_rne(normed * w_experts[None, :], dtype), mask=mask)
    scaled = cast_rne(cast_rne(normed, dtype).to(tl.float32) * router_scale[None, :], dtype).to(tl.float32)
    tl.store(router_ptr + at, cast_rne(scaled * router_input_scale, dtype), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _gemma_mlp_outputs_kernel(
    dense_ptr,
    routed_ptr,
    residual_ptr,
    w_dense_ptr,
    w_routed_ptr,
    w_ptr,
    scalar_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_d,
    stride_r,
    stride_res,
    inv_n,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)
    rows, cols, col_ok, mask = row_tile(n_rows, n_cols, BLOCK_R, BLOCK_N)
    w_dense = tl.load(w_dense_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    w_routed = tl.load(w_routed_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    scalar = tl.load(scalar_ptr).to(tl.float32)
    wait_for_inputs(USE_PDL)
    dtype = out_ptr.dtype.element_ty
    d32 = tl.load(dense_ptr + rows[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r32 = tl.load(routed_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    d = cast_rne(d32 * _rstd(d32, inv_n, eps)[:, None] * w_dense[None, :], dtype).to(tl.float32)
    r = cast_rne(r32 * _rstd(r32, inv_n, eps)[:, None] * w_routed[None, :], dtype).to(tl.float32)
    s32 = cast_rne(d + r, dtype).to(tl.float32)
    y = cast_rne(s32 * _rstd(s32, inv_n, eps)[:, None] * w[None, :], dtype).to(tl.float32)
    res = tl.load(residual_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    layer_out = cast_rne(res + y, dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], cast_rne(layer_out * scalar, dtype), mask=mask)


def gemma_mlp_inputs(
    residual: torch.Tensor,
    dense_weight: torch.Tensor,
    experts_weight: torch.Tensor,
    router_scale: torch.Tensor,
    router_input_scale: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three inputs a DiffusionGemma layer's MLPs take from its residual stream, in one launch: the dense MLP's
    (normed times ``dense_weight``), the experts' (times ``experts_weight``) and the router's (normed without a
    weight, times ``router_scale``, times ``router_input_scale``, each product rounded as the torch code's
    products are). One row statistic serves all three. Each ``residual``'s shape, contiguous."""
    outs = [torch.empty(residual.shape, dtype=residual.dtype, device=residual.device) for _ in range(3)]
    if residual.numel() == 0:
        return outs[0], outs[1], outs[2]
    x2 = as_rows(residual)
    n_rows, block_r, block_n, use_pdl = _row_launch(x2)
    _gemma_mlp_inputs_kernel[(triton.cdiv(n_rows, block_r),)](
        x2, dense_weight, experts_weight, router_scale, *outs, n_rows, x2.shape[1], x2.stride(0), 1.0 / x2.shape[1],
        eps, router_input_scale, BLOCK_R=block_r, BLOCK_N=block_n, USE_PDL=use_pdl, num_warps=_norm_warps(block_n),
        enable_fp_fusion=False, **launch_kwargs(use_pdl),
    )  # fmt: skip
    return outs[0], outs[1], outs[2]


def gemma_mlp_outputs(
    dense: torch.Tensor,
    routed: torch.Tensor,
    residual: torch.Tensor,
    dense_weight: torch.Tensor,
    routed_weight: torch.Tensor,
    weight: torch.Tensor,
    layer_scalar: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """A DiffusionGemma layer's output from its two MLPs' outputs, in one launch: ``(residual + norm(norm(dense) *
    dense_weight + norm(routed) * routed_weight) * weight) * layer_scalar``, every norm, sum and product rounded
    as the torch code's (`diffulex.layers.norm.gemma_rms_norm`'s roundings). All of ``residual``'s shape and dtype
    (rows may be strided); ``layer_scalar`` one element."""
    for name, t in (("dense", dense), ("routed", routed)):
        if t.shape != residual.shape or t.dtype != residual.dtype:
            raise ValueError(f"{name} must have residual's shape {tuple(residual.shape)} and dtype "
                             f"{residual.dtype}, got {tuple(t.shape)} {t.dtype}")  # fmt: skip
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    if out.numel() == 0:
        return out
    d2, r2, res2 = as_rows(dense), as_rows(routed), as_rows(residual)
    n_rows, block_r, block_n, use_pdl = _row_launch(res2)
    _gemma_mlp_outputs_kernel[(triton.cdiv(n_rows, block_r),)](
        d2, r2, res2, dense_weight, routed_weight, weight, layer_scalar, out, n_rows, res2.shape[1], d2.stride(0),
        r2.stride(0), res2.stride(0), 1.0 / res2.shape[1], eps, BLOCK_R=block_r, BLOCK_N=block_n, USE_PDL=use_pdl,
        num_warps=_norm_warps(block_n), enable_fp_fusion=False, **launch_kwargs(use_pdl),
    )  # fmt: skip
    return out
