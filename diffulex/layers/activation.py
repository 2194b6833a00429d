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
    if gate.shape == up.shape and gate.dtype == up.dtype and use_fused_kernels(gate, up):
        from diffulex.kernels.activation import silu_mul

        return silu_mul(gate, up)
    return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up``: one launch on CUDA, as `silu_and_mul`."""
    if gate.shape == up.shape and gate.dtype == up.dtype and use_fused_kernels(gate, up):
        from diffulex.kernels.activation import gelu_tanh_mul

        return gelu_tanh_mul(gate, up)
    return gelu_tanh(gate) * up


def gated(activation: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``activation(gate) * up``, in one launch where the activation has a fused kernel (SiLU, GELU-tanh)."""
    if activation is F.silu:
        return silu_and_mul(gate, up)
    if activation is gelu_tanh:
        return gelu_tanh_and_mul(gate, up)
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
