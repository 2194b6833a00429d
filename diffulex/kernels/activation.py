"""Triton gated activations in one launch: ``silu(gate) * up`` of a SwiGLU MLP and ``gelu_tanh(gate) * up`` of
Gemma's; and the same as epilogues (SiLU and GELU with the tanh approximation) that other kernels end with.

PyTorch runs it as two kernels (``silu``, then the product) with a ``[T, I]`` intermediate in between; at decode
batch sizes the cost is the launches. The kernel takes ``gate`` and ``up`` as two row-strided ``[T, I]``
operands, so the same launch serves the merged ``gate_up`` projection (two adjacent halves of one ``[T, 2I]``
output, read in place without the split copying anything) and the unmerged one (two separate tensors, e.g.
when LoRA hooks keep the projections apart).

It reproduces PyTorch's roundings: ``silu`` computes ``x / (1 + exp(-x))`` in fp32 with the accurate ``expf``
and an IEEE division and rounds to the input dtype; the product is then formed in fp32 (exact for two bf16/fp16
values) and rounded once. On the GPU the exponential is libdevice's ``expf`` (Triton's ``tl.exp`` is the faster
``ex2.approx`` form, which PyTorch does not use); the Triton interpreter has no libdevice and uses ``tl.exp``.
Casts go through `diffulex.kernels.fused_norm.cast_rne` (round to nearest even under the interpreter too).

Gemma's ``gelu_tanh(gate) * up`` (`gelu_tanh_mul_rounded`) keeps the same two roundings: PyTorch's
``F.gelu(approximate="tanh")`` computes ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` in fp32 with the
accurate ``tanhf`` and rounds to the input dtype, then the product is formed in fp32 and rounded once. On the GPU
the tanh is libdevice's ``tanhf``; the interpreter, without libdevice, forms it from ``exp`` (within an fp32 unit
or two in the last place: the bf16 result parts from PyTorch's, by one unit, only where the activation's fp32
value sits on a rounding boundary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from diffulex.kernels.fused_norm import as_rows, cast_rne
from diffulex.kernels.pdl import INTERPRETING, launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024
# The interpreter cannot run libdevice calls; it is only ever the CPU test path.
PRECISE_EXP = not INTERPRETING
# PyTorch's constants of the tanh approximation, as fp32: sqrt(2 / pi) and the cubic term's coefficient.
_GELU_BETA = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _gated_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    n_cols,
    stride_g,
    stride_u,
    GELU_TANH: tl.constexpr,  # gelu_tanh(gate) * up (Gemma's), else silu(gate) * up
    BLOCK: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    wait_for_inputs(USE_PDL)
    g = tl.load(gate_ptr + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(up_ptr + row * stride_u + cols, mask=ok, other=0.0)
    if GELU_TANH:
        out = gelu_tanh_mul_rounded(g, u, out_ptr.dtype.element_ty, PRECISE_EXP)
    else:
        out = silu_mul_rounded(g, u, out_ptr.dtype.element_ty, PRECISE_EXP)
    tl.store(out_ptr + row * n_cols + cols, out, mask=ok)


@triton.jit
def silu_mul_rounded(g, u, out_dtype: tl.constexpr, PRECISE_EXP: tl.constexpr):
    """``silu(g) * u`` with PyTorch's roundings (module docstring), for any block shape; also the epilogue of the
    skinny GEMM's gated launch (`diffulex.kernels.skinny_gemm.skinny_silu_mul`)."""
    g32 = g.to(tl.float32)
    if PRECISE_EXP:
        e = libdevice.exp(-g32)
    else:
        e = tl.exp(-g32)
    silu = cast_rne(tl.fdiv(g32, 1.0 + e, ieee_rounding=True), g.dtype)
    return cast_rne(silu.to(tl.float32) * u.to(tl.float32), out_dtype)


@triton.jit
def gelu_tanh_mul_rounded(g, u, out_dtype: tl.constexpr, PRECISE_EXP: tl.constexpr):
    """``gelu_tanh(g) * u`` with PyTorch's roundings (module docstring), for any block shape: the epilogue of
    Gemma-style experts in `diffulex.kernels.fused_moe`. ``PRECISE_EXP``: libdevice is there (its ``tanhf``)."""
    x = g.to(tl.float32)
    inner = _GELU_BETA * (x + _GELU_KAPPA * (x * x * x))
    if PRECISE_EXP:
        tanh = libdevice.tanh(inner)
    else:
        # 1 - 2e / (1 + e), e = exp(-2|y|) in (0, 1]: no overflow, and the small difference from 1 is formed
        # before it is subtracted, so |tanh| near 1 rounds as a correctly rounded tanhf does
        e = tl.exp(-2.0 * tl.abs(inner))
        magnitude = 1.0 - 2.0 * e / (1.0 + e)
        tanh = tl.where(inner < 0, -magnitude, magnitude)
    gelu = cast_rne(0.5 * x * (1.0 + tanh), g.dtype)
    return cast_rne(gelu.to(tl.float32) * u.to(tl.float32), out_dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for same-shape ``gate``/``up`` ``[..., I]`` (rows may be strided); contiguous result."""
    return _gated_mul(gate, up, gelu_tanh=False)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.gelu(gate, approximate="tanh") * up`` (Gemma's gated MLPs), as `silu_mul` takes its operands."""
    return _gated_mul(gate, up, gelu_tanh=True)


def _gated_mul(gate: torch.Tensor, up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if out.numel() == 0:
        return out
    n_cols = gate.shape[-1]
    g2, u2 = as_rows(gate), as_rows(up)
    grid = (g2.shape[0], triton.cdiv(n_cols, _BLOCK))
    use_pdl = pdl_enabled(gate.device, g2.shape[0])
    _gated_mul_kernel[grid](
        g2,
        u2,
        out,
        n_cols,
        g2.stride(0),
        u2.stride(0),
        GELU_TANH=gelu_tanh,
        BLOCK=_BLOCK,
        PRECISE_EXP=PRECISE_EXP,
        USE_PDL=use_pdl,
        num_warps=4,
        enable_fp_fusion=False,
        **launch_kwargs(use_pdl),
    )
    return out
