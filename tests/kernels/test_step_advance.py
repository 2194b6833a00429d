"""The one-launch advance of a replayed step's inputs equals the reference, on random batches of blocks."""

from __future__ import annotations

import random

import pytest
import torch

from diffulex.engine.continuation import advance_inputs_reference
from diffulex.kernels.step_advance import triton_advance_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MASK = 99


def random_step(seed: int, block_size: int, shift: int):
    """A padded step of several requests, one block each: input rows, sampled rows (some already retired), an
    accepted flag and token per sampled row, and each block's rows and slots (some blocks without a page)."""
    rng = random.Random(seed)
    ids, slots, source, starts, blocks, result = [], [], [], [0], [[], [], []], [[], []]
    for _ in range(rng.randint(1, 5)):
        offset = len(ids)
        ids.extend([rng.randint(0, 50)] * shift)  # a shifted family's recomputed row
        first = len(ids)
        ids.extend(rng.choice([MASK, rng.randint(0, 50)]) for _ in range(block_size))
        slots.extend([-1] * (len(ids) - offset))
        for p in range(block_size):
            if ids[first + p] == MASK:
                retired = rng.random() < 0.3
                source.append(-1 if retired else first + p - shift)
                result[0].append(int(not retired and rng.random() < 0.5))
                result[1].append(rng.randint(100, 200))
        if len(source) == starts[-1]:  # a block with nothing to sample has no segment
            continue
        starts.append(len(source))
        blocks[0].append(first)
        blocks[1].append(first + block_size)
        blocks[2].append(rng.choice([-1, 8 * rng.randint(1, 9)]))
    padded_rows = rng.randint(0, 3)
    source.extend([-1] * padded_rows)
    result[0].extend([1] * padded_rows)  # padded rows belong to no block: never applied
    result[1].extend([7] * padded_rows)
    ids.extend([0] * 2)
    slots.extend([-1] * 2)

    def t(values):
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    return t(ids), t(source), t(slots), t(result), t(starts), t(blocks)


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("seed", range(10))
def test_kernel_advances_the_inputs_as_the_reference_does(seed: int, shift: int) -> None:
    block_size = random.Random(seed).choice([1, 2, 4, 8])
    step = random_step(seed, block_size, shift)
    expected = [x.cpu().clone() for x in step]
    advance_inputs_reference(*expected[:3], expected[3], expected[4], expected[5], shift)
    got = list(step)
    triton_advance_inputs(*got[:3], got[3], got[4], got[5], shift, block_size)
    for name, g, e in zip(("ids", "source rows", "slots"), got[:3], expected[:3], strict=True):
        assert g.cpu().tolist() == e.tolist(), name


def test_accepted_tokens_fill_their_positions_and_a_finished_block_is_stored() -> None:
    """Block 0 decodes its last two positions: its tokens land, its rows retire and its rows get their slots.
    Block 1 keeps a position to decode: its accepted token lands, nothing of it is stored."""
    ids = torch.tensor([5, MASK, MASK, 6, MASK, MASK, 0], dtype=torch.int64)
    source = torch.tensor([1, 2, 4, 5, -1], dtype=torch.int64)
    slots = torch.full((7,), -1, dtype=torch.int64)
    result = torch.tensor([[1, 1, 0, 1, 1], [11, 12, 13, 14, 15]], dtype=torch.int64)
    starts = torch.tensor([0, 2, 4], dtype=torch.int64)
    blocks = torch.tensor([[0, 3], [3, 6], [40, 80]], dtype=torch.int64)
    advance_inputs_reference(ids, source, slots, result, starts, blocks, 0)
    assert ids.tolist() == [5, 11, 12, 6, MASK, 14, 0]
    assert source.tolist() == [-1, -1, 4, -1, -1]
    assert slots.tolist() == [40, 41, 42, -1, -1, -1, -1]


@pytest.mark.parametrize("advance", [advance_inputs_reference, triton_advance_inputs], ids=["reference", "kernel"])
def test_a_refinement_lands_its_tokens_one_row_later_and_stores_nothing(advance) -> None:
    """Fast-dLLM v2 (shift 1): request 0 refines a sub-block (rows 0-3, position p read from row p - 1) whose
    block has no rows to store (an empty range), so even decoded to its end it stores nothing, page or not;
    request 1 commits (its last row, 6, predicts the position after the step's rows: no input row to fill)."""
    ids = torch.tensor([5, MASK, MASK, MASK, 1, 2, 3], dtype=torch.int64, device=DEVICE)
    source = torch.tensor([0, 1, 2, 6], dtype=torch.int64, device=DEVICE)
    slots = torch.full((7,), -1, dtype=torch.int64, device=DEVICE)
    result = torch.tensor([[1, 1, 1, 1], [11, 12, 13, 14]], dtype=torch.int64, device=DEVICE)
    starts = torch.tensor([0, 3, 4], dtype=torch.int64, device=DEVICE)
    blocks = torch.tensor([[0, 4], [0, 4], [64, -1]], dtype=torch.int64, device=DEVICE)
    args = (ids, source, slots, result, starts, blocks, 1)
    advance(*args, 8) if advance is triton_advance_inputs else advance(*args)
    assert ids.tolist() == [5, 11, 12, 13, 1, 2, 3]
    assert source.tolist() == [-1, -1, -1, -1]
    assert slots.tolist() == [-1] * 7
