"""The gated activation of SwiGLU MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up``.

    Takes the two projections as separate tensors because the checkpoints store ``gate_proj`` and ``up_proj``
    separately and the layers keep them separate (so weight names map one to one). When a fused ``gate_up``
    projection is introduced, ``SiluAndMul.split`` handles its concatenated ``[..., 2 * I]`` output.
    """

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def split(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The same activation on a concatenated ``[..., 2 * I]`` tensor (gate first, then up)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.forward(gate, up)
