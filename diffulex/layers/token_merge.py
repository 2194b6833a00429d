"""Token merge (DMax's soft inputs): a decoded but unsettled position enters the next forward as a mix of its
candidate tokens' embeddings instead of one token's embedding.

Two modes (DMax's own), for a position with candidates ``ids`` of probabilities ``probs`` and the
rest ``residual = 1 - sum(probs)``:

* ``dmax_topk``: ``e = sum_k probs_k * E[ids_k] + residual * E[mask]``; with ``renormalize``, rescaled to the
  norm ``sum_k probs_k * |E[ids_k]| + residual * |E[mask]|`` (a mix of vectors is shorter than its parts);
* ``iter_smooth_topk``: ``e = E[current token] + weight * sum_k probs_k * E[ids_k]``.

Positions without candidates keep their token's embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SoftInput:
    """One position's candidates: token ids, their probabilities, and the probability left to the mask."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]
    residual: float


@dataclass(frozen=True)
class TokenMergeSettings:
    mode: str
    top_k: int
    weight: float
    renormalize: bool
    mask_token_id: int


@dataclass
class TokenMerge:
    """The soft inputs of one step: ``rows [R]`` of the flat batch, their candidates ``ids [R, K]`` (padded with
    the mask id and probability 0), ``probs [R, K]`` and ``residual [R]``."""

    rows: torch.Tensor
    ids: torch.Tensor
    probs: torch.Tensor
    residual: torch.Tensor
    settings: TokenMergeSettings

    @classmethod
    def of(
        cls, soft_rows: list[tuple[int, SoftInput]], settings: TokenMergeSettings, device: torch.device
    ) -> TokenMerge | None:
        if not soft_rows:
            return None
        k = max(len(soft.ids) for _, soft in soft_rows)
        mask = settings.mask_token_id
        ids = [list(soft.ids) + [mask] * (k - len(soft.ids)) for _, soft in soft_rows]
        probs = [list(soft.probs) + [0.0] * (k - len(soft.probs)) for _, soft in soft_rows]
        return cls(
            rows=torch.tensor([row for row, _ in soft_rows], dtype=torch.long, device=device),
            ids=torch.tensor(ids, dtype=torch.long, device=device),
            probs=torch.tensor(probs, dtype=torch.float32, device=device),
            residual=torch.tensor([soft.residual for _, soft in soft_rows], dtype=torch.float32, device=device),
            settings=settings,
        )

    def apply(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` (the step's token embeddings) with the merged rows replaced; ``table`` is the
        embedding matrix. Computed in float32."""
        s = self.settings
        candidates = table[self.ids].float()  # [R, K, H]
        mixed = (self.probs.unsqueeze(-1) * candidates).sum(dim=1)
        if s.mode == "iter_smooth_topk":
            merged = hidden[self.rows].float() + s.weight * mixed
        else:
            mask_row = table[s.mask_token_id].float()
            merged = mixed + self.residual.unsqueeze(-1) * mask_row
            if s.renormalize:
                target = (self.probs * candidates.norm(dim=-1)).sum(dim=1) + self.residual * mask_row.norm()
                merged = merged * (target / merged.norm(dim=-1).clamp_min(1e-12)).unsqueeze(-1)
        out = hidden.clone()
        out[self.rows] = merged.to(hidden.dtype)
        return out
