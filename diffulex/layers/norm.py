"""RMSNorm, computed in float32 so that bf16/fp16 models normalize exactly like their reference code.

On CUDA the forward is one Triton launch (`diffulex.kernels.fused_norm.rms_norm`, residual add included) that
reproduces this module's torch code rounding for rounding; the torch code is the CPU path and the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from diffulex.layers.dispatch import use_fused_kernels
from diffulex.layers.linear import PartialOverRanks, UnsummedProduct

# Widest row the fused kernel takes (`diffulex.kernels.fused_norm.MAX_NORM_COLS`; kept here so that checking it
# imports nothing).
_MAX_FUSED_COLS = 16384


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (Llama convention: no ``1 + weight``).

    The statistics are taken in float32 and the normalized value is cast back to the input dtype before the
    weight multiplies it, which is what the HF Qwen/Llama code does; matching it keeps greedy outputs
    identical.

    ``forward(x, residual)`` first adds ``x`` to ``residual`` (in the model dtype, as HF does) and returns the
    normalized sum together with the sum, which becomes the next residual. Decoder layers use it to fold the
    residual add into the following norm.

    ``x`` may be an `UnsummedProduct` (a projection's K splits): the fused kernel sums them while it loads the
    row, exactly as the projection would have; elsewhere they are summed first. Or a `PartialOverRanks` (a
    sharded projection's output before its all-reduce): the all-reduce happens in the norm's launch where its
    peer exchange takes the rows (`diffulex.kernels.peer_all_reduce`), else by NCCL first.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor | UnsummedProduct | PartialOverRanks, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, PartialOverRanks):
            if x.exchange.supports(x.local, residual) and use_fused_kernels(x.local, residual, self.weight):
                from diffulex.kernels.peer_all_reduce import all_reduce_rms_norm

                return all_reduce_rms_norm(x.local, x.exchange, self.weight, self.eps, residual)
            x = x.materialize()
        if isinstance(x, UnsummedProduct):
            parts = x.parts
            if (
                parts.shape[-1] <= _MAX_FUSED_COLS
                and (residual is None or residual.shape == parts.shape[1:])
                and use_fused_kernels(parts, residual, self.weight)
            ):
                from diffulex.kernels.fused_norm import rms_norm_of_parts

                return rms_norm_of_parts(parts, x.dtype, self.weight, self.eps, residual)
            x = x.materialize()
        if (
            x.shape[-1] <= _MAX_FUSED_COLS
            and (residual is None or residual.shape == x.shape)
            and use_fused_kernels(x, residual, self.weight)
        ):
            from diffulex.kernels.fused_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


def gemma_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    plus: torch.Tensor | None = None,
    then_add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps)`` times ``weight`` (None: no weight) in float32, rounded to
    ``x.dtype`` once (Gemma's rounding, unlike `RMSNorm`'s). ``plus`` is added to ``x`` first and ``then_add`` to
    the result, each add in the model dtype as the model's own code does; on CUDA all of it is one launch
    (`diffulex.kernels.gemma_norm`), this torch code elsewhere and as the reference."""
    if (
        x.shape[-1] <= _MAX_FUSED_COLS
        and all(t is None or (t.shape == x.shape and t.dtype == x.dtype) for t in (plus, then_add))
        and use_fused_kernels(x, weight, plus, then_add)
    ):
        from diffulex.kernels.gemma_norm import gemma_rms_norm as fused

        return fused(x, weight, eps, plus, then_add)
    if plus is not None:
        x = x + plus
    x32 = x.float()
    normed = x32 * torch.pow(x32.pow(2).mean(dim=-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    normed = normed.to(x.dtype)
    return normed if then_add is None else then_add + normed
