"""When a layer runs its fused Triton kernel (`diffulex.kernels.fused_norm`, `diffulex.kernels.activation`) instead
of its PyTorch code.

The PyTorch code stays the CPU path and the reference; the kernels reproduce it on CUDA in fewer launches. They
are skipped where they cannot help or would be wrong: off CUDA, without triton, for dtypes they do not handle,
while autograd records (training needs the differentiable torch ops), and while ``torch.compile`` traces
(inductor fuses the torch code itself; an opaque Triton call would only split its graph).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` is installed (it is optional: without it every op takes its PyTorch path)."""
    return importlib.util.find_spec("triton") is not None


def use_fused_kernels(*tensors: torch.Tensor | None) -> bool:
    """True when the Triton path may replace the torch code for these operands (None entries are ignored)."""
    present = [t for t in tensors if t is not None]
    if not present or not all(t.is_cuda and t.dtype in _DTYPES for t in present):
        return False
    if len({t.device for t in present}) > 1:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    if torch.compiler.is_compiling():
        return False
    return triton_available()
