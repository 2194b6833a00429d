"""DMax's token merge: the soft input of a position is a mix of its candidates' embeddings."""

from __future__ import annotations

import pytest
import torch

from diffulex.layers.token_merge import SoftInput, StaticTokenMerge, TokenMerge, TokenMergeSettings

MASK = 7


def table() -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(0))


def lookup(e: torch.Tensor) -> torch.nn.Embedding:
    """The embedding ``e`` as the module a model's forward hands the merge."""
    return torch.nn.Embedding.from_pretrained(e)


def merge(mode: str, renormalize: bool, weight: float = 1.0) -> TokenMerge:
    settings = TokenMergeSettings(mode, 2, weight, renormalize, MASK)
    rows = [(1, SoftInput((3,), (0.75,), 0.25)), (2, SoftInput((4, 5), (0.5, 0.25), 0.25))]
    merged = TokenMerge.of(rows, settings, torch.device("cpu"))
    assert merged is not None
    return merged


def test_dmax_topk_mixes_the_candidates_and_the_mask():
    e = table()
    hidden = e[torch.tensor([0, 1, 2])]
    out = merge("dmax_topk", renormalize=False).apply(hidden, lookup(e))
    assert torch.equal(out[0], hidden[0])  # a row without candidates keeps its embedding
    torch.testing.assert_close(out[1], 0.75 * e[3] + 0.25 * e[MASK])
    torch.testing.assert_close(out[2], 0.5 * e[4] + 0.25 * e[5] + 0.25 * e[MASK])


def test_renormalized_mixes_keep_the_weighted_norm_of_their_parts():
    e = table()
    out = merge("dmax_topk", renormalize=True).apply(e[:3].clone(), lookup(e))
    expected_norm = 0.5 * e[4].norm() + 0.25 * e[5].norm() + 0.25 * e[MASK].norm()
    torch.testing.assert_close(out[2].norm(), expected_norm)
    mixed = 0.5 * e[4] + 0.25 * e[5] + 0.25 * e[MASK]
    torch.testing.assert_close(out[2] / out[2].norm(), mixed / mixed.norm())


def test_iter_smooth_adds_the_weighted_candidates_to_the_token():
    e = table()
    hidden = e[torch.tensor([0, 1, 2])]
    out = merge("iter_smooth_topk", renormalize=True, weight=0.5).apply(hidden, lookup(e))
    torch.testing.assert_close(out[2], e[2] + 0.5 * (0.5 * e[4] + 0.25 * e[5]))


def test_a_step_without_soft_inputs_has_no_merge():
    assert TokenMerge.of([], TokenMergeSettings("dmax_topk", 1, 1.0, True, MASK), torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("mode", "renormalize"), [("dmax_topk", True), ("dmax_topk", False), ("iter_smooth_topk", True)]
)
def test_the_static_merge_of_every_row_equals_the_eager_merge_of_the_soft_rows(mode: str, renormalize: bool):
    """A graph's merge runs over every row of the padded step and keeps it where a row is soft: the same float32
    math per row as the eager merge, so the same embeddings, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    e = torch.randn(8, 32, generator=generator)
    settings = TokenMergeSettings(mode, 2, 0.5, renormalize, MASK)
    rows = [(1, SoftInput((3,), (0.75,), 0.25)), (3, SoftInput((4, 5), (0.5, 0.25), 0.25))]
    hidden = e[torch.tensor([0, 1, 2, 6, 5])]
    ids = torch.full((5, 2), MASK)
    probs, residual, soft = torch.zeros(5, 2), torch.rand(5, generator=generator), torch.zeros(5, dtype=torch.long)
    for row, candidates in rows:
        ids[row, : len(candidates.ids)] = torch.tensor(candidates.ids)
        probs[row, : len(candidates.probs)] = torch.tensor(candidates.probs)
        residual[row], soft[row] = candidates.residual, 1
    static = StaticTokenMerge(ids, probs, residual, soft, settings).apply(hidden, lookup(e))
    eager = TokenMerge.of(rows, settings, torch.device("cpu")).apply(hidden, lookup(e))
    assert torch.equal(static, eager)
    assert torch.equal(static[[0, 2, 4]], hidden[[0, 2, 4]])
    assert not torch.equal(static[[1, 3]], hidden[[1, 3]])
