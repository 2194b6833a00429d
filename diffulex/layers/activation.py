"""The gated activations of SwiGLU MLPs (``silu(gate) * up``) and Gemma's (``gelu_tanh(gate) * up``).

On CUDA each is one Triton launch (`diffulex.kernels.activation`) that reads gate and up where they lie:
the two halves of the merged ``gate_up`` output or two separate projections alike, so no split copies and no
intermediate ``silu(gate)`` tensor. The torch code is the CPU path and the reference the kernel reproduces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diffulex.layers.dispatch import use_fused_kernels


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: one launch on CUDA, reading ``gate`` and ``up`` where they lie (`SiluAndMul`)."""
    return gated(F.silu, gate, up)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


# The activations whose ``act(gate) * up`` is one launch on CUDA: the `diffulex.kernels.activation` function
_FUSED_GATED = {F.silu: "silu_mul", gelu_tanh: "gelu_tanh_mul"}


def gated(activation: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``activation(gate) * up``, in one launch where the activation has a fused kernel (SiLU, GELU-tanh)."""
    kernel = _FUSED_GATED.get(activation)
    if kernel is not None and gate.shape == up.shape and gate.dtype == up.dtype and use_fused_kernels(gate, up):
        from diffulex.kernels import activation as kernels

        return getattr(kernels, kernel)(gate, up)
    return activation(gate) * up


class SiluAndMul(nn.Module):
    """``silu(gate) * up``.

    Takes the two projections as separate tensors because the checkpoints store ``gate_proj`` and ``up_proj``
    separately and the layers keep them separate (so weight names map one to one); the merged ``gate_up``
    projection hands over two views of one output, which the fused kernel reads in place. ``SiluAndMul.split``
    takes a concatenated ``[..., 2 * I]`` tensor instead.
    """

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate, up)

    def split(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The same activation on a concatenated ``[..., 2 * I]`` tensor (gate first, then up)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.forward(gate, up)
