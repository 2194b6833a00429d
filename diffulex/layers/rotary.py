"""Rotary position embedding (NeoX / rotate-half layout), as used by Qwen, Llama and every family here.

The cos/sin table is computed in float32 for ``max_position`` positions the first time a forward runs on a
device, and then only indexed. It is a plain cached attribute rather than a registered buffer: it is not part
of any checkpoint, it survives building the model on the meta device (no random-init cost for big models),
and it is shared by all layers because the model computes ``cos, sin`` once per forward and hands them down.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diffulex.errors import UnsupportedError
from diffulex.layers.dispatch import use_fused_kernels
from diffulex.layers.norm import RMSNorm
from diffulex.validation import shown_value

# What `RotaryEmbedding` hands every layer: ``(cos, sin)``, each ``[T, rotary_dim / 2]`` (``rotary_dim`` is
# ``head_dim`` but for partial rotary).
Rope = tuple[torch.Tensor, torch.Tensor]


def check_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    """Only plain RoPE is implemented; refuse scaled variants loudly (`UnsupportedError`, naming the config field,
    its value and what is allowed) rather than produce wrong positions."""
    if rope_scaling is None:
        return
    allowed = "allowed: null, or a rope_type (or type) of 'default' (plain RoPE, the only one implemented)"
    if not isinstance(rope_scaling, dict):
        raise UnsupportedError(f"config field rope_scaling={shown_value(rope_scaling)} is unsupported; {allowed}")
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedError(
            f"config field rope_scaling={shown_value(rope_scaling)} is unsupported: rope type "
            f"{shown_value(rope_type)} is not implemented; {allowed}"
        )


class RotaryEmbedding(nn.Module):
    """Turns absolute positions into the ``(cos, sin)`` pair `apply_rotary` consumes.

    ``inv_freq[i] = base ** (-2i / rotary_dim)`` for ``i < rotary_dim / 2``; the angle of position ``p`` is
    ``p * inv_freq``. The full head dim is rotated (``rotary_dim == head_dim``) for all current families.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        check_rope_scaling(rope_scaling)
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = float(base)
        self._cache: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        exponents = steps / self.head_dim
        return 1.0 / (self.base**exponents)

    def table(self, device: torch.device) -> torch.Tensor:
        """``[max_position, 2, head_dim / 2]``: each position's cos, then its sin, side by side, so that one
        gather fetches both (a decode step's forward starts with it; each gather is a launch of its own)."""
        table = self._cache.get(device)
        if table is None:
            positions = torch.arange(self.max_position, dtype=torch.int64, device=device).float()
            angles = torch.outer(positions, self.inv_freq(device))  # [max_position, head_dim / 2]
            table = torch.stack((angles.cos(), angles.sin()), dim=1)
            self._cache[device] = table
        return table

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` (int) -> ``(cos, sin)``, each ``[T, head_dim / 2]`` float32 (views of one gather, rows
        strided, last dim contiguous)."""
        rows = self.table(positions.device)[positions]
        return rows[:, 0], rows[:, 1]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}, base={self.base}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by the per-row angles; math in float32, result in ``x.dtype``.

    Rotate-half layout over the first ``rotary_dim = 2 * cos.shape[-1]`` dimensions: dimension ``i`` pairs with
    ``i + rotary_dim / 2``, ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``; dimensions from ``rotary_dim`` on
    pass unchanged (partial rotary, LLaDA2's half of each head).
    """
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)


def fused_rope_args(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, float] | None:
    """``(q_weight, k_weight, eps)`` for the fused q/k norm + rotary kernel, or None where the torch modules must
    run: off CUDA, layouts and dtypes the kernel does not cover, and norms carrying hooks (activation capture must
    see its module run). Shared by `rotate_qk` and the attention layer's fused rotary + cache write, so both take
    the kernel in exactly the same cases."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    if not (q.dim() == 3 and k.dim() == 3 and q.dtype == k.dtype and cos.dtype == sin.dtype == torch.float32):
        return None
    if 2 * cos.shape[-1] > q.shape[-1]:  # angles for more dims than a head has: the torch code raises
        return None
    if q_norm is not None and k_norm is not None:
        if q_norm.eps != k_norm.eps or any(m._forward_hooks or m._forward_pre_hooks for m in (q_norm, k_norm)):
            return None
        q_weight, k_weight, eps = q_norm.weight, k_norm.weight, q_norm.eps
    else:
        q_weight, k_weight, eps = None, None, 0.0
    if not use_fused_kernels(q, k, cos, sin, q_weight, k_weight):
        return None
    return q_weight, k_weight, eps


def rotate_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: RMSNorm | None = None,
    k_norm: RMSNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` of ``q [T, H, D]`` and ``k [T, Hkv, D]``, each first normalized per head by its norm
    when the layout has them (Qwen3); both norms or neither.

    On CUDA one fused launch reads q and k where they lie (strided views of the fused qkv output) and writes
    contiguous results; elsewhere (and for layouts the kernel does not cover) the torch modules run in turn.
    Models do not call this directly: they hand q/k, the rotary angles and the norms to
    `diffulex.attention.Attention`, which on its paged Triton path also folds the KV-cache write into the launch.
    """
    fused = fused_rope_args(q, k, cos, sin, q_norm, k_norm)
    if fused is not None:
        from diffulex.kernels.fused_norm import qk_norm_rope

        return qk_norm_rope(q, k, cos, sin, *fused)
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
