"""Token merge (DMax's soft inputs): a decoded but unsettled position enters the next forward as a mix of its
candidate tokens' embeddings instead of one token's embedding.

Two modes (DMax's own), for a position with candidates ``ids`` of probabilities ``probs`` and the
rest ``residual = 1 - sum(probs)``:

* ``dmax_topk``: ``e = sum_k probs_k * E[ids_k] + residual * E[mask]``; with ``renormalize``, rescaled to the
  norm ``sum_k probs_k * |E[ids_k]| + residual * |E[mask]|`` (a mix of vectors is shorter than its parts);
* ``iter_smooth_topk``: ``e = E[current token] + weight * sum_k probs_k * E[ids_k]``.

Positions without candidates keep their token's embedding.

Eager steps merge the rows that have candidates (`TokenMerge`); a step replayed from a CUDA graph's static buffers
merges every row of its padded shape and keeps the merge where a row's soft flag is set (`StaticTokenMerge`). Both
compute a row's merge with `merge_rows`, so they give the same embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# The token embedding's lookup, ids -> rows (the model's `diffulex.layers.linear.VocabEmbedding`).
Embedding = Callable[[torch.Tensor], torch.Tensor]


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

    @property
    def width(self) -> int:
        """Candidates per row in the merge's tensors: ``top_k`` (``dmax_topk`` keeps one, ``iter_smooth_topk``
        ``top_k``); shorter rows are padded with the mask id at probability 0, which adds nothing to the mix."""
        return self.top_k


def merge_rows(
    current: torch.Tensor,
    ids: torch.Tensor,
    probs: torch.Tensor,
    residual: torch.Tensor,
    embedding: Embedding,
    settings: TokenMergeSettings,
) -> torch.Tensor:
    """The float32 soft input of each row: ``current [R, H]`` (the rows' own token embeddings), their candidates
    ``ids [R, K]`` at ``probs [R, K]`` and ``residual [R]``; ``embedding`` looks the candidates' rows up (over
    tensor-parallel ranks, each rank holding a slice of the vocabulary, its lookup sums the ranks' rows, so every
    rank merges whole rows). Row by row, so the eager merge of a few rows and the static merge of a whole padded
    step agree."""
    candidates = embedding(ids).float()  # [R, K, H]
    mixed = (probs.unsqueeze(-1) * candidates).sum(dim=1)
    if settings.mode == "iter_smooth_topk":
        return current.float() + settings.weight * mixed
    mask_row = embedding(torch.full_like(ids[:1, 0], settings.mask_token_id))[0].float()
    merged = mixed + residual.unsqueeze(-1) * mask_row
    if settings.renormalize:
        target = (probs * candidates.norm(dim=-1)).sum(dim=1) + residual * mask_row.norm()
        merged = merged * (target / merged.norm(dim=-1).clamp_min(1e-12)).unsqueeze(-1)
    return merged


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
        k = max(settings.width, *(len(soft.ids) for _, soft in soft_rows))
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

    def apply(self, hidden: torch.Tensor, embedding: Embedding) -> torch.Tensor:
        """``hidden [T, H]`` (the step's token embeddings) with the merged rows replaced; ``embedding`` is the
        model's token embedding. Computed in float32."""
        merged = merge_rows(hidden[self.rows], self.ids, self.probs, self.residual, embedding, self.settings)
        out = hidden.clone()
        out[self.rows] = merged.to(hidden.dtype)
        return out


@dataclass
class StaticTokenMerge:
    """The soft inputs of a padded step in fixed-shape tensors (a CUDA graph's static inputs): for every row
    ``ids [T, K]``, ``probs [T, K]``, ``residual [T]`` and ``soft [T]`` (nonzero where the row has candidates).
    Every row is merged and the merge kept where ``soft`` is set, so one captured forward serves any step."""

    ids: torch.Tensor
    probs: torch.Tensor
    residual: torch.Tensor
    soft: torch.Tensor
    settings: TokenMergeSettings

    def apply(self, hidden: torch.Tensor, embedding: Embedding) -> torch.Tensor:
        merged = merge_rows(hidden, self.ids, self.probs, self.residual, embedding, self.settings)
        return torch.where((self.soft != 0).unsqueeze(-1), merged.to(hidden.dtype), hidden)


# What a forward's ``merge`` argument may be (`diffulex.models.dense.run_decoder`).
SoftInputs = TokenMerge | StaticTokenMerge
