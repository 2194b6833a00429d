"""Soft-capped float32 logits from the LM head's output in one pass: ``cap * tanh(float(x) / cap)``.

DiffusionGemma's LM head (`diffulex.models.diffusion_gemma`) turns its model-dtype product into float32 and soft-caps
it: in PyTorch four elementwise passes over logits of ``256 x 262,144`` per canvas (the cast, the division, the tanh,
the product), each reading and writing float32, about 2 GB of traffic per canvas. One launch reads the product
once and writes the result once.

The operations follow the torch code's: the cast is exact, the division IEEE-rounded (``div_rn``: Triton's ``/``
on float32 is an approximation), tanh libdevice's, the product rounded, and no multiply-add contracted
(``enable_fp_fusion=False``). libdevice's tanh is not bit for bit the one PyTorch's CUDA kernel runs: the result is
within a few ulps of the torch code's (measured on an H100), as under the Triton interpreter (the CPU tests), which
has no libdevice tanh and computes it from one exponential.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from diffulex.kernels.pdl import INTERPRETING

_BLOCK = 4096  # elements a program caps
_INTERPRETING = tl.constexpr(INTERPRETING)


@triton.jit(do_not_specialize=["n"])
def _softcap_kernel(x_ptr, out_ptr, n, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    t = tl.math.div_rn(x, cap)
    if _INTERPRETING:  # the interpreter has no libdevice tanh: the same function, rounded otherwise
        e = tl.exp(-2.0 * tl.abs(t))
        tanh = (1.0 - e) / (1.0 + e)
        tanh = tl.where(t < 0, -tanh, tanh)
    else:
        tanh = libdevice.tanh(t)
    capped = tanh * cap
    tl.store(out_ptr + offs, capped, mask=ok)


def softcapped_logits(product: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(product.float() / cap)`` as a new contiguous float32 tensor of ``product``'s shape."""
    if cap <= 0:
        raise ValueError(f"final_logit_softcapping={cap} must be > 0")
    x = product if product.is_contiguous() else product.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n == 0:
        return out
    _softcap_kernel[(triton.cdiv(n, _BLOCK),)](x, out, n, float(cap), BLOCK=_BLOCK, num_warps=8, enable_fp_fusion=False)
    return out
