"""Triton RMSNorm (with the residual add folded in) and per-head q/k RMSNorm + rotary, one launch each.

At decode batch sizes a layer's elementwise work is a handful of rows, so its cost is the number of launches,
not bytes: eager PyTorch spends ~40 small kernels per layer on the add, the norms, the rotation and their dtype
casts. These kernels do each group in one launch and reproduce the PyTorch code of `diffulex.layers` (which
stays the CPU path and the reference) operation by operation, including every intermediate rounding:

* `rms_norm`: ``summed = x + residual`` rounded to the model dtype (as the torch add does), then
  ``x32 * rsqrt(sum(x32^2) * (1/N) + eps)`` in fp32 (``mean`` on CUDA multiplies by ``1/N``), cast to the input
  dtype, then multiplied by the weight in fp32 and rounded once to the promoted dtype of (weight, input). The
  product of two bf16/fp16 values is exact in fp32, so that single rounding equals PyTorch's. Rows live whole in
  registers (one program per row, several rows per program below 1024 columns).
* `qk_norm_rope`: q and k are strided views of the fused qkv GEMM output (row stride = qkv width); they are read
  in place, each program owning ``BLOCK_H`` heads of one token (q heads first, then k heads, so one launch covers
  both), and the results go to new contiguous ``[T, heads, D]`` tensors, which is what the torch path hands the
  attention (writing back in place would leave q/k strided and alias the caller's buffer). Per head: the optional
  RMSNorm exactly as above, then the rotate-half rotation in fp32 on the (rounded) normed value, cast back.
* `qk_norm_rope_store`: the same launch also does the layer's KV-cache store (`diffulex.kernels.kv_store`), so
  the attention layer (`diffulex.attention.Attention`, which owns rotary for this reason) spends one launch
  instead of two before attention. The programs that produce token ``t``'s k heads hold the rotated values in
  registers anyway; they write them, and the same heads of v, to cache slot ``slot_mapping[t]`` unless it is
  negative, cast to the cache dtype like `store_kv`'s ``.to``. The slot is step metadata, so it is read before
  the PDL wait; nothing is written before it. q programs store nothing.

Exactness on the GPU: launches pass ``enable_fp_fusion=False`` so ``a * b + c`` is never contracted into an FMA
(PyTorch computes each product and sum in a separate kernel, each rounded); ``rsqrt`` is the same
``rsqrt.approx`` PyTorch's ``rsqrtf`` compiles to. The one remaining difference is the order of the fp32 sum of
squares, which can move the statistic by an fp32 ulp and, rarely, a bf16 output by one ulp.

Under the Triton interpreter (the CPU tests), fp32 -> bf16 casts truncate instead of rounding to nearest even
(its ``cast_impl`` passes no rounding mode), which would hide every rounding this module is careful about; there
`cast_rne` rounds with integer arithmetic instead. Compiled kernels use the hardware's ``cvt.rn``. (So there,
and only there, `qk_norm_rope_store` into a cache of another dtype than k's matches `store_kv` rather than
`triton_store_kv`, whose plain cast truncates.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffulex.kernels.kv_store import kv_store_mismatch
from diffulex.kernels.pdl import INTERPRETING, launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

# Dtypes the kernels read and write; anything else takes the torch path.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Widest row `rms_norm` holds in registers (one program per row); wider rows take the torch path.
MAX_NORM_COLS = 16384
_QK_NORM_ROPE_WARPS = 4  # one token's few heads per program: latency-bound, not worth more warps
_INTERPRETING = tl.constexpr(INTERPRETING)


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """fp32 ``x`` to ``dtype`` rounded to nearest even, as PyTorch's casts do (see the module docstring)."""
    if _INTERPRETING and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def row_tile(n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's ``BLOCK_R`` rows of a row-wise kernel, whole rows of up to ``BLOCK_N`` columns: the row and
    column indices, the columns in range, and the mask of the elements in range."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    return rows, cols, col_ok, (rows < n_rows)[:, None] & col_ok[None, :]


def rows_per_program(block_n: int, n_rows: int) -> int:
    """Rows one program of a row-wise kernel holds: about 1,024 elements, never more rows than there are."""
    return min(max(1, 1024 // block_n), _next_pow2(n_rows))


# The row count changes with every eager step; specialized (as Triton does for ints equal to 1 or divisible by
# 16) it would be a variant per class, each compiled on first use while serving.
@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_rows,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    inv_n,
    eps,
    stride_part,
    HAS_RESIDUAL: tl.constexpr,
    NUM_PARTS: tl.constexpr,  # 0: x is the input; else x holds that many fp32 K-split partials of it
    X_DTYPE: tl.constexpr,  # the input's dtype when it comes as partials
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)
    rows, cols, col_ok, mask = row_tile(n_rows, n_cols, BLOCK_R, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    wait_for_inputs(USE_PDL)
    if NUM_PARTS > 0:  # the split-K sum the GEMM left out: in split order from zero, rounded once
        x_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
        total = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(NUM_PARTS):
            total += tl.load(x_ptrs + s * stride_part, mask=mask, other=0.0)
        x = cast_rne(total, X_DTYPE)
    else:
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = cast_rne(x.to(tl.float32) + r.to(tl.float32), sum_ptr.dtype.element_ty)  # the torch add, rounded
        tl.store(sum_ptr + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=1) * inv_n
    rstd = tl.math.rsqrt(mean_sq + eps)
    normed = cast_rne(x32 * rstd[:, None], x.dtype).to(tl.float32)
    out = w[None, :] * normed
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], cast_rne(out, out_ptr.dtype.element_ty), mask=mask)


def _norm_warps(block_n: int) -> int:
    """Warps of an RMSNorm program holding a row of `block_n` columns.

    At decode sizes a norm is a few programs whose time is the serial load -> reduce -> store after their PDL
    wait; more warps put more loads in flight per row and leave each thread fewer partials to add. Measured in
    the SDAR-1.7B batch-1 graph on an H100 (2048-wide rows): 16 warps 1.345 / 1.346 ms per replay,
    8 warps 1.372 / 1.370, 4 warps 1.376, 2 warps 1.364.
    """
    return 16 if block_n >= 2048 else 4


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, cols]`` with unit column stride; a view whenever the layout allows one."""
    cols = x.shape[-1]
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    try:
        flat = x.view(-1, cols)
    except RuntimeError:
        flat = x.reshape(-1, cols)
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`diffulex.layers.RMSNorm.forward` in one launch: ``normed`` or, with ``residual``, ``(normed, x + residual)``.

    ``x [..., N]`` (any leading dims, rows may be strided), ``weight [N]``. Outputs are contiguous, with the
    dtypes PyTorch's promotion gives: the sum in ``promote(x, residual)``, the normed value in
    ``promote(weight, sum)``.
    """
    return _launch_rms_norm(x, None, x.dtype, weight, eps, residual)


def rms_norm_of_parts(
    parts: torch.Tensor, dtype: torch.dtype, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm` of ``x = parts.sum(0)`` rounded to ``dtype``, summed in split order from zero: exactly the
    input a GEMM's own split-K sum would have produced (`diffulex.kernels.skinny_gemm.skinny_partials`).

    ``parts [splits, rows, N]`` in fp32; ``dtype`` a 16-bit float (the product's dtype).
    """
    if parts.dim() != 3 or parts.dtype != torch.float32 or dtype not in _PART_DTYPES:
        raise ValueError(
            f"need fp32 parts [splits, rows, N] of a 16-bit product, got {parts.dtype} {tuple(parts.shape)} -> {dtype}"
        )
    if not parts.is_contiguous():
        parts = parts.contiguous()
    return _launch_rms_norm(parts[0], parts, dtype, weight, eps, residual)


_PART_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _launch_rms_norm(
    x: torch.Tensor,
    parts: torch.Tensor | None,
    x_dtype: torch.dtype,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One launch of the norm kernel; ``x`` is the input, or with ``parts`` the first of its partials."""
    n_cols = x.shape[-1]
    x2 = as_rows(x) if parts is None else x
    n_rows = x2.shape[0]
    sum_dtype = x_dtype if residual is None else torch.promote_types(x_dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device)
    summed = None if residual is None else torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    if out.numel() == 0:
        return out if summed is None else (out, summed)
    r2 = x2 if residual is None else as_rows(residual)
    s2 = out.view(-1, n_cols) if summed is None else summed.view(-1, n_cols)
    block_n = _next_pow2(n_cols)
    block_r = rows_per_program(block_n, n_rows)
    num_warps = _norm_warps(block_n)
    use_pdl = pdl_enabled(x.device, n_rows)
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x2,
        r2,
        weight if weight.is_contiguous() else weight.contiguous(),
        out.view(-1, n_cols),
        s2,
        n_rows,
        n_cols,
        x2.stride(0),
        r2.stride(0),
        n_cols,
        n_cols,
        1.0 / n_cols,
        eps,
        0 if parts is None else parts.stride(0),
        HAS_RESIDUAL=residual is not None,
        NUM_PARTS=0 if parts is None else parts.shape[0],
        X_DTYPE=_PART_DTYPES.get(x_dtype, tl.float32),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        USE_PDL=use_pdl,
        num_warps=num_warps,
        enable_fp_fusion=False,
        **launch_kwargs(use_pdl),
    )
    return out if summed is None else (out, summed)


@triton.jit
def _heads_norm_rope(
    src_ptr,
    stride_t,
    stride_h,
    dst_ptr,
    w_ptr,
    t,
    heads,
    mask,
    n_heads,
    cos,
    sin,
    offs,
    d_ok,
    half,
    inv_d,
    eps,
    HAS_WEIGHT: tl.constexpr,
    offs_p,
    pass_mask,
    head_dim,
    HAS_PASS: tl.constexpr,
):
    """RMSNorm (optional) then rotate-half rotation of ``heads`` of token ``t``; returns the stored parts: the two
    rotated halves (``half`` wide each) and, with partial rotary (``HAS_PASS``), the unrotated rest of the head
    (``head_dim - 2 * half`` wide; without it, the first half again, unused)."""
    src = src_ptr + t * stride_t + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if HAS_PASS:
        src_p = src_ptr + t * stride_t + heads[:, None] * stride_h + 2 * half + offs_p[None, :]
        ap = tl.load(src_p, mask=pass_mask, other=0.0).to(tl.float32)
    else:
        ap = a1
    out_dtype = dst_ptr.dtype.element_ty
    if HAS_WEIGHT:
        mean_sq = tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)
        if HAS_PASS:
            mean_sq += tl.sum(ap * ap, axis=1)
        rstd = tl.math.rsqrt(mean_sq * inv_d + eps)[:, None]
        w1 = tl.load(w_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + offs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        # RMSNorm's roundings: normed value to the input dtype, weight product to the output dtype
        a1 = cast_rne(w1 * cast_rne(a1 * rstd, x1.dtype).to(tl.float32), out_dtype).to(tl.float32)
        a2 = cast_rne(w2 * cast_rne(a2 * rstd, x1.dtype).to(tl.float32), out_dtype).to(tl.float32)
        if HAS_PASS:
            p_ok = offs_p < head_dim - 2 * half
            wp = tl.load(w_ptr + 2 * half + offs_p, mask=p_ok, other=0.0).to(tl.float32)[None, :]
            ap = cast_rne(wp * cast_rne(ap * rstd, x1.dtype).to(tl.float32), out_dtype).to(tl.float32)
    o1 = cast_rne(a1 * cos[None, :] - a2 * sin[None, :], out_dtype)
    o2 = cast_rne(a2 * cos[None, :] + a1 * sin[None, :], out_dtype)
    dst = dst_ptr + (t * n_heads + heads[:, None]) * head_dim + offs[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + half, o2, mask=mask)
    op = o1
    if HAS_PASS:
        op = cast_rne(ap, out_dtype)
        dst_p = dst_ptr + (t * n_heads + heads[:, None]) * head_dim + 2 * half + offs_p[None, :]
        tl.store(dst_p, op, mask=pass_mask)
    return o1, o2, op


@triton.jit
def _to_cache_dtype(x, dtype: tl.constexpr):
    """``x`` as ``dtype`` the way ``Tensor.to`` (which `store_kv` uses) converts it: unchanged when it already is."""
    if x.dtype == dtype:
        y = x
    else:
        y = cast_rne(x.to(tl.float32), dtype)
    return y


@triton.jit
def _store_heads(
    k1,
    k2,
    kp,
    v_ptr,
    stride_vt,
    stride_vh,
    k_cache_ptr,
    v_cache_ptr,
    stride_kc_p,
    stride_kc_s,
    stride_kc_h,
    stride_vc_p,
    stride_vc_s,
    stride_vc_h,
    slot,
    t,
    heads,
    mask,
    offs,
    half,
    PAGE_SIZE: tl.constexpr,
    offs_p,
    pass_mask,
    HAS_PASS: tl.constexpr,
):
    """`_store_kv_kernel` for these heads of token ``t``: the rotated k halves (and with partial rotary its
    unrotated rest) and v's row, at cache slot ``slot``."""
    page = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    kc_head = k_cache_ptr + page * stride_kc_p + in_page * stride_kc_s + heads[:, None] * stride_kc_h
    vc_head = v_cache_ptr + page * stride_vc_p + in_page * stride_vc_s + heads[:, None] * stride_vc_h
    v_head = v_ptr + t * stride_vt + heads[:, None] * stride_vh
    kc = kc_head + offs[None, :]
    vc = vc_head + offs[None, :]
    v_src = v_head + offs[None, :]
    k_dtype = k_cache_ptr.dtype.element_ty
    v_dtype = v_cache_ptr.dtype.element_ty
    tl.store(kc, _to_cache_dtype(k1, k_dtype), mask=mask)
    tl.store(kc + half, _to_cache_dtype(k2, k_dtype), mask=mask)
    tl.store(vc, _to_cache_dtype(tl.load(v_src, mask=mask), v_dtype), mask=mask)
    tl.store(vc + half, _to_cache_dtype(tl.load(v_src + half, mask=mask), v_dtype), mask=mask)
    if HAS_PASS:
        rest = 2 * half + offs_p[None, :]
        tl.store(kc_head + rest, _to_cache_dtype(kp, k_dtype), mask=pass_mask)
        tl.store(vc_head + rest, _to_cache_dtype(tl.load(v_head + rest, mask=pass_mask), v_dtype), mask=pass_mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_w_ptr,
    k_w_ptr,
    cos_ptr,
    sin_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    stride_vt,
    stride_vh,
    stride_kc_p,
    stride_kc_s,
    stride_kc_h,
    stride_vc_p,
    stride_vc_s,
    stride_vc_h,
    n_q_heads,
    n_k_heads,
    half,
    head_dim,
    inv_d,
    eps,
    HAS_WEIGHT: tl.constexpr,
    STORE_KV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_PASS: tl.constexpr = 1,  # the unrotated rest of a head (partial rotary), padded to a power of two
    HAS_PASS: tl.constexpr = False,  # partial rotary: part of each head is not rotated
):
    release_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    d_ok = offs < half
    offs_p = tl.arange(0, BLOCK_PASS)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if STORE_KV:  # the slots are step metadata
        slot = tl.load(slot_ptr + t, mask=block >= q_blocks, other=-1).to(tl.int64)  # only k programs store
    wait_for_inputs(USE_PDL)  # every program, also those that store nothing
    # the angles are gathered at the head of the forward, by a kernel that lets its successors start at once: in
    # the first layer this launch may be resident before that gather has finished, so they are read after the wait
    cos = tl.load(cos_ptr + t * stride_cos + offs, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_sin + offs, mask=d_ok, other=0.0).to(tl.float32)
    if block < q_blocks:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads < n_q_heads)[:, None] & d_ok[None, :]
        pass_mask = (heads < n_q_heads)[:, None] & (offs_p < head_dim - 2 * half)[None, :]
        _heads_norm_rope(
            q_ptr, stride_qt, stride_qh, q_out_ptr, q_w_ptr, t, heads, mask, n_q_heads, cos, sin, offs, d_ok,
            half, inv_d, eps, HAS_WEIGHT, offs_p, pass_mask, head_dim, HAS_PASS,
        )
    else:
        heads = (block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads < n_k_heads)[:, None] & d_ok[None, :]
        pass_mask = (heads < n_k_heads)[:, None] & (offs_p < head_dim - 2 * half)[None, :]
        k1, k2, kp = _heads_norm_rope(
            k_ptr, stride_kt, stride_kh, k_out_ptr, k_w_ptr, t, heads, mask, n_k_heads, cos, sin, offs, d_ok,
            half, inv_d, eps, HAS_WEIGHT, offs_p, pass_mask, head_dim, HAS_PASS,
        )
        if STORE_KV:
            if slot >= 0:
                _store_heads(
                    k1, k2, kp, v_ptr, stride_vt, stride_vh, k_cache_ptr, v_cache_ptr, stride_kc_p, stride_kc_s,
                    stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h, slot, t, heads, mask, offs, half, PAGE_SIZE,
                    offs_p, pass_mask, HAS_PASS,
                )


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when weights are given) then NeoX rotary of ``q [T, H, D]`` and ``k [T, Hkv, D]``.

    Equals ``apply_rotary(q_norm(q), cos, sin), apply_rotary(k_norm(k), cos, sin)`` (or the rotations alone
    without weights); ``cos``/``sin`` are ``[T, R / 2]`` float32 for a rotary dim ``R <= D``: the first ``R`` dims
    of each head rotate, the rest is only normed (partial rotary, LLaDA2). ``q``/``k`` may be strided views (only the
    last dim must be unit-stride, else they are copied once); the results are new contiguous tensors.
    """
    return _launch_qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, None)


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`qk_norm_rope`, and in the same launch `triton_store_kv` of the rotated k and of ``v [T, Hkv, D]``.

    Saves the store's launch on every attention layer of a step (the layer's position encoding and its cache
    write are one kernel; `diffulex.attention.Attention` calls this). Same results, bit for bit, as the two
    calls in turn: caches ``[P, page_size, Hkv, D]`` (unit stride in D), row ``t`` stored at
    ``slot_mapping[t]`` unless that is negative, values cast to the cache dtype. Returns ``(q, k)`` rotated,
    which attention still reads for the step's own rows.
    """
    mismatch = kv_store_mismatch(k, v, k_cache, v_cache, slot_mapping)
    if mismatch is not None:
        raise ValueError(mismatch)
    return _launch_qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, (v, k_cache, v_cache, slot_mapping))


def _launch_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be given or both be None")
    num_tokens, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[1]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D] with one even D")
    has_weight = q_weight is not None
    q_dtype = torch.promote_types(q_weight.dtype, q.dtype) if has_weight else q.dtype
    k_dtype = torch.promote_types(k_weight.dtype, k.dtype) if has_weight else k.dtype
    q_out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k_dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if store is None:
        # unused pointers and strides (STORE_KV is off): any tensor will do
        v, k_cache, v_cache, slot_mapping = k, k, k, k
        page_size = 1
    else:
        v, k_cache, v_cache, slot_mapping = store
        v = v if v.stride(-1) == 1 else v.contiguous()
        page_size = k_cache.shape[1]
    half = cos.shape[-1]  # rotated pairs per head: head_dim / 2, or fewer with partial rotary
    if 2 * half > head_dim or sin.shape[-1] != half:
        raise ValueError(f"cos/sin [T, {half}] rotate more than the head_dim={head_dim} of q and k")
    n_pass = head_dim - 2 * half
    block_half = _next_pow2(half)
    block_pass = _next_pow2(n_pass) if n_pass else 0
    block_h = min(_next_pow2(max(n_q_heads, n_k_heads)), max(1, 256 // max(block_half, block_pass)))
    grid = (num_tokens, triton.cdiv(n_q_heads, block_h) + triton.cdiv(n_k_heads, block_h))
    use_pdl = pdl_enabled(q.device, num_tokens)
    _qk_norm_rope_kernel[grid](
        q,
        k,
        q_out,
        k_out,
        q_weight if has_weight else q,
        k_weight if has_weight else k,
        cos,
        sin,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        n_q_heads,
        n_k_heads,
        half,
        head_dim,
        1.0 / head_dim,
        eps,
        HAS_WEIGHT=has_weight,
        STORE_KV=store is not None,
        PAGE_SIZE=page_size,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        USE_PDL=use_pdl,
        BLOCK_PASS=max(block_pass, 1),
        HAS_PASS=n_pass > 0,
        num_warps=_QK_NORM_ROPE_WARPS,
        enable_fp_fusion=False,
        **launch_kwargs(use_pdl),
    )
    return q_out, k_out
