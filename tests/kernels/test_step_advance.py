"""The one-launch advance of a replayed step's inputs equals the reference, on random batches of blocks."""

from __future__ import annotations

import random

import pytest
import torch

from diffulex.engine.continuation import BlockGates, advance_inputs_reference
from diffulex.kernels.step_advance import triton_advance_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MASK = 99


def random_step(seed: int, block_size: int, shift: int):
    """A padded step of several requests, one block each: input rows, sampled rows (some already retired), an
    accepted flag and token per sampled row, and each block's rows and slots (some blocks without a page)."""
    rng = random.Random(seed)
    ids, slots, source, starts, blocks, result = [], [], [], [0], [[], [], [], []], [[], []]
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
        blocks[3].append(-1)
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
    blocks = torch.tensor([[0, 3], [3, 6], [40, 80], [-1, -1]], dtype=torch.int64)
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
    blocks = torch.tensor([[0, 4], [0, 4], [64, -1], [-1, -1]], dtype=torch.int64, device=DEVICE)
    args = (ids, source, slots, result, starts, blocks, 1)
    advance(*args, 8) if advance is triton_advance_inputs else advance(*args)
    assert ids.tolist() == [5, 11, 12, 13, 1, 2, 3]
    assert source.tolist() == [-1, -1, -1, -1]
    assert slots.tolist() == [-1] * 7


def opening_step(seed: int, shift: int = 0, block_size: int = 4, page_size: int = 8, answer_ends: bool = False):
    """A step of several requests, one block each (at varied positions, sometimes after a row of their own, which a
    shifted family's block is always after and samples from): some blocks decode, some were stored by this step
    (their slots set, nothing sampled), some next blocks have no page; with ``answer_ends`` some answers end at,
    inside or at the end of the next block. Returns the advance's tensors and the `BlockOpening` of the step's
    layout."""
    from diffulex.engine.continuation import NO_ANSWER_END, BlockOpening

    rng = random.Random(seed)
    ids, slots, source, positions, starts, blocks, result = [], [], [], [], [0], [[], [], [], []], [[], []]
    cu, context, tables, ends = [0], [], [], []
    for _ in range(rng.randint(1, 6)):
        extra = 1 if shift else rng.choice([0, 0, 1])  # a row before the block
        start = block_size * rng.randint(2, 13)
        table = [rng.choice([-1, rng.randint(0, 40)]) for _ in range(7)]  # a block at 52-55 opens past the table
        first = len(ids) + extra
        positions.extend(range(start - extra, start + block_size))
        stored = rng.random() < 0.5
        page = table[start // page_size]
        ids.extend([rng.randint(0, 50)] * extra)
        ids.extend(rng.randint(0, 50) if stored or rng.random() < 0.5 else MASK for _ in range(block_size))
        if not stored:  # a block with no mask left at the step's start is the one the step stores
            ids[first + rng.randrange(block_size)] = MASK
        base = page * page_size + start % page_size if page >= 0 else -1
        stored_slots = [base + i for i in range(block_size)] if stored and base >= 0 else [-1] * block_size
        slots.extend([-1] * extra + stored_slots)
        for p in range(block_size):
            sampled = not stored and ids[first + p] == MASK
            source.append(first + p - shift if sampled else -1)
            result[0].append(int(sampled and rng.random() < 0.5))
            result[1].append(rng.randint(100, 200))
        starts.append(len(source))
        # unshifted, a row before the block is sometimes counted in its input rows: then the block is not whole
        blocks[0].append(first - extra if extra and not shift and rng.random() < 0.5 else first)
        blocks[1].append(first + block_size)
        blocks[2].append(base)
        blocks[3].append(-1)
        cu.append(len(ids))
        context.append(start - extra)
        tables.append(table)
        next_start = start + block_size
        ends.append(rng.choice([NO_ANSWER_END, next_start + rng.randint(0, block_size)]) if answer_ends else 0)

    def t(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    step = [t(ids), t(source), t(slots), t(result), t(starts), t(blocks)]
    layout = [t(positions), t(cu, torch.int32), t(context, torch.int32), t(tables, torch.int32)]
    if answer_ends:
        layout.append(t(ends, torch.int32))

    def opening(views):
        ends = views[4] if answer_ends else None
        return BlockOpening(*views[:4], page_size=page_size, block_size=block_size, mask_token_id=MASK,
                            answer_ends=ends)  # fmt: skip

    return step, layout, opening


def all_forcing(starts: torch.Tensor, block_size: int) -> BlockGates:
    """Gates of blocks that each force (a lone running block after its committed predecessor)."""
    return BlockGates(torch.ones(starts.shape[0], dtype=torch.int64, device=starts.device), block_size, block_size)


@pytest.mark.parametrize("answer_ends", [False, True], ids=["no-ends", "answer-ends"])
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("seed", range(12))
def test_the_kernel_opens_next_blocks_as_the_reference_does(seed: int, shift: int, answer_ends: bool) -> None:
    step, layout, opening = opening_step(seed, shift, answer_ends=answer_ends)
    expected = [x.cpu().clone() for x in step], [x.cpu().clone() for x in layout]
    advance_inputs_reference(*expected[0], shift, opening(expected[1]), all_forcing(expected[0][4], 4))
    triton_advance_inputs(*step, shift, 4 + shift, opening(layout), all_forcing(step[4], 4))
    names = ("ids", "source rows", "slots", "result", "starts", "blocks", "positions", "cu", "context", "tables",
             "answer ends")[: len(step) + len(layout)]
    for name, g, e in zip(names, step + layout, expected[0] + expected[1], strict=True):
        assert g.cpu().tolist() == e.tolist(), name


def two_stored_blocks(request_1_page: int, answer_ends: list[int] | None = None):
    """Two requests of one block each (block 4, page 8), both stored by this step: rows 0-3 at positions 8-11 in
    page 2 (request 0's positions 8-15: page 2), rows 4-7 at 4-7 in page 5, request 1's positions 8-15 in page
    ``request_1_page`` (-1: none). Returns the advance's tensors and the step's `BlockOpening`."""
    from diffulex.engine.continuation import BlockOpening

    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.int64)
    source = torch.full((8,), -1, dtype=torch.int64)
    slots = torch.tensor([16, 17, 18, 19, 44, 45, 46, 47], dtype=torch.int64)
    result = torch.zeros((2, 8), dtype=torch.int64)
    starts = torch.tensor([0, 4, 8], dtype=torch.int64)
    blocks = torch.tensor([[0, 4], [4, 8], [16, 44], [-1, -1]], dtype=torch.int64)
    positions = torch.tensor([8, 9, 10, 11, 4, 5, 6, 7], dtype=torch.int64)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    context = torch.tensor([8, 4], dtype=torch.int32)
    tables = torch.tensor([[0, 2, 9], [5, request_1_page, -1]], dtype=torch.int32)
    ends = torch.tensor(answer_ends, dtype=torch.int32) if answer_ends is not None else None
    opening = BlockOpening(positions, cu, context, tables, page_size=8, block_size=4, mask_token_id=MASK,
                           answer_ends=ends)  # fmt: skip
    return (ids, source, slots, result, starts, blocks), opening


def test_a_stored_block_becomes_its_requests_next_block_where_its_page_is_there() -> None:
    """`two_stored_blocks`, request 1's next block without a page: request 0's next block (12-15, page 2 too)
    becomes masks at 12-15, sampled, not stored, with one block more of context and the new block's first slot
    2 * 8 + 4; request 1's next block (8-11) has no page, so its block is only stored again."""
    (ids, source, slots, result, starts, blocks), opening = two_stored_blocks(request_1_page=-1)
    advance_inputs_reference(ids, source, slots, result, starts, blocks, 0, opening, all_forcing(starts, 4))
    assert ids.tolist() == [MASK] * 4 + [5, 6, 7, 8]
    assert opening.positions.tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert source.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    assert slots.tolist() == [-1, -1, -1, -1, 44, 45, 46, 47]
    assert opening.context_lens.tolist() == [12, 4]
    assert blocks[2].tolist() == [2 * 8 + 4, 44]


def test_an_answer_ending_inside_the_next_block_has_only_its_positions_before_the_end_sampled() -> None:
    """`two_stored_blocks`, request 1's next block given a page: request 0's answer ends at 14, inside its next
    block (12-15), which opens as masks at 12-15 of which only 12 and 13 are sampled (14 and 15 are inputs, as the
    host's own step has them); request 1's answer ends at 8, where its next block would start: nothing of it is
    left to decode, so it is not opened."""
    (ids, source, slots, result, starts, blocks), opening = two_stored_blocks(request_1_page=6, answer_ends=[14, 8])
    advance_inputs_reference(ids, source, slots, result, starts, blocks, 0, opening, all_forcing(starts, 4))
    assert ids.tolist() == [MASK] * 4 + [5, 6, 7, 8]
    assert opening.positions.tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert source.tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    assert slots.tolist() == [-1, -1, -1, -1, 44, 45, 46, 47]
    assert opening.context_lens.tolist() == [12, 4]


def test_a_shifted_familys_row_before_the_block_moves_on_to_the_stored_blocks_last_token() -> None:
    """Shift 1 (row p - 1 predicts p): the request's rows are position 7 (the last prompt token) and the block 8-11,
    stored by this step in page 1; its next block 12-15 becomes masks read from rows 0-3 (positions 11-14), row 0
    now holding the stored block's last token at position 11."""
    from diffulex.engine.continuation import BlockOpening

    ids = torch.tensor([9, 1, 2, 3, 4], dtype=torch.int64)
    source = torch.full((4,), -1, dtype=torch.int64)
    slots = torch.tensor([-1, 8, 9, 10, 11], dtype=torch.int64)
    result = torch.zeros((2, 4), dtype=torch.int64)
    starts = torch.tensor([0, 4], dtype=torch.int64)
    blocks = torch.tensor([[1], [5], [8], [-1]], dtype=torch.int64)
    positions = torch.tensor([7, 8, 9, 10, 11], dtype=torch.int64)
    context = torch.tensor([7], dtype=torch.int32)
    opening = BlockOpening(positions, torch.tensor([0, 5], dtype=torch.int32), context,
                           torch.tensor([[0, 1]], dtype=torch.int32), page_size=8, block_size=4, mask_token_id=MASK)
    advance_inputs_reference(ids, source, slots, result, starts, blocks, 1, opening, all_forcing(starts, 4))
    assert ids.tolist() == [4, MASK, MASK, MASK, MASK]
    assert positions.tolist() == [11, 12, 13, 14, 15]
    assert source.tolist() == [0, 1, 2, 3]
    assert slots.tolist() == [-1] * 5
    assert context.tolist() == [11]
    assert blocks[2].tolist() == [8 + 4]


def gated_step(seed: int, block_size: int):
    """A step of several requests with up to four running blocks each, every block sampled (some of its masks
    decoded by earlier continuations, so retired), each after the first gated by the one before it; the force flags
    of the step; the number of decoded positions from which a block lets the next force."""
    from diffulex.engine.continuation import BlockGates

    rng = random.Random(seed)
    ids, slots, source, starts, blocks, result, force = [], [], [], [0], [[], [], [], []], [[], []], []
    for _ in range(rng.randint(1, 4)):
        gate = -1
        for _ in range(rng.randint(1, 4)):
            first = len(ids)
            ids.extend(MASK if rng.random() < 0.6 else rng.randint(0, 50) for _ in range(block_size))
            ids[first + rng.randrange(block_size)] = MASK  # each block samples a row
            slots.extend([-1] * block_size)
            for p in range(block_size):
                if ids[first + p] == MASK:
                    retired = rng.random() < 0.2
                    source.append(-1 if retired else first + p)
                    result[0].append(int(not retired and rng.random() < 0.6))
                    result[1].append(rng.randint(100, 200))
            starts.append(len(source))
            blocks[0].append(first)
            blocks[1].append(first + block_size)
            blocks[2].append(8 * rng.randint(1, 9))
            blocks[3].append(gate)
            force.append(int(gate < 0 or rng.random() < 0.3))
            gate = len(starts) - 2
    force.append(0)  # the padded rows' block

    def t(values):
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    step = [t(ids), t(source), t(slots), t(result), t(starts), t(blocks)]
    return step, t(force), lambda f: BlockGates(f, block_size, rng.randint(1, block_size + 1))


@pytest.mark.parametrize("seed", range(16))
def test_the_kernel_moves_gated_blocks_on_as_the_reference_does(seed: int) -> None:
    block_size = random.Random(seed).choice([2, 4, 8])
    step, force, gates = gated_step(seed, block_size)
    expected, expected_force = [x.cpu().clone() for x in step], force.cpu().clone()
    rule = gates(expected_force)
    advance_inputs_reference(*expected, 0, gates=rule)
    triton_advance_inputs(*step, 0, block_size, gates=type(rule)(force, rule.block_size, rule.decoded_to_force))
    for name, g, e in zip(("ids", "source rows", "slots", "force"), [*step[:3], force], [*expected[:3], expected_force],
                          strict=True):  # fmt: skip
        assert g.cpu().tolist() == e.tolist(), name


def test_a_block_forces_once_its_gate_is_decoded_far_enough_and_stores_after_it() -> None:
    """One request of three blocks of 4 rows (slots 40, 44, 48), where a block may force once 3 positions of the
    block before it are decoded. Block 0 decodes its last mask: it is stored, and block 1, whose last mask is
    decoded too, is stored after it, and may force; block 2 keeps three masks, so nothing of it is stored, and
    with block 1 decoded whole it may force as well."""
    from diffulex.engine.continuation import BlockGates

    ids = torch.tensor([1, 2, 3, MASK, 5, MASK, 7, 8, MASK, MASK, MASK, MASK], dtype=torch.int64)
    source = torch.tensor([3, 5, 8, 9, 10, 11], dtype=torch.int64)
    slots = torch.full((12,), -1, dtype=torch.int64)
    result = torch.tensor([[1, 1, 0, 1, 0, 0], [13, 15, 18, 19, 20, 21]], dtype=torch.int64)
    starts = torch.tensor([0, 1, 2, 6], dtype=torch.int64)
    blocks = torch.tensor([[0, 4, 8], [4, 8, 12], [40, 44, 48], [-1, 0, 1]], dtype=torch.int64)
    force = torch.tensor([1, 0, 0, 0], dtype=torch.int64)
    advance_inputs_reference(ids, source, slots, result, starts, blocks, 0, gates=BlockGates(force, 4, 3))
    assert ids.tolist() == [1, 2, 3, 13, 5, 15, 7, 8, MASK, 19, MASK, MASK]
    assert slots.tolist() == [40, 41, 42, 43, 44, 45, 46, 47] + [-1] * 4
    assert force.tolist() == [1, 1, 1, 0]


def test_a_decoded_block_waits_to_be_stored_until_the_block_before_it_is_decoded() -> None:
    """Block 1 decodes its last mask while block 0 keeps one: nothing is stored, and with 2 of block 0's 4
    positions decoded (3 needed) block 1 may not force yet."""
    from diffulex.engine.continuation import BlockGates

    ids = torch.tensor([1, 2, MASK, MASK, 5, 6, 7, MASK], dtype=torch.int64)
    source = torch.tensor([2, 3, 7], dtype=torch.int64)
    slots = torch.full((8,), -1, dtype=torch.int64)
    result = torch.tensor([[0, 0, 1], [12, 13, 17]], dtype=torch.int64)
    starts = torch.tensor([0, 2, 3], dtype=torch.int64)
    blocks = torch.tensor([[0, 4], [4, 8], [40, 44], [-1, 0]], dtype=torch.int64)
    force = torch.tensor([1, 0, 0], dtype=torch.int64)
    advance_inputs_reference(ids, source, slots, result, starts, blocks, 0, gates=BlockGates(force, 4, 3))
    assert ids.tolist() == [1, 2, MASK, MASK, 5, 6, 7, 17]
    assert slots.tolist() == [-1] * 8
    assert force.tolist() == [1, 0, 0]


def window_step(seed: int, shift: int, block_size: int = 4, page_size: int = 8, answer_ends: bool = False):
    """A step of several requests with one to three whole running blocks each (after a row of their own when
    shifted), gated in order: the leading block sometimes stored by this step (decoded before it, its slots set,
    nothing sampled), the others with masks to decode, some accepted now; some next blocks without a page; with
    ``answer_ends``, answers ending anywhere from the first block to two blocks past the window. Returns
    the advance's tensors, the layout's views, and makers of the `BlockOpening` and the `BlockGates`."""
    from diffulex.engine.continuation import BlockOpening

    rng = random.Random(seed)
    ids, slots, source, positions, starts = [], [], [], [], [0]
    blocks, result, force = [[], [], [], []], [[], []], []
    cu, context, tables, ends = [0], [], [], []
    for _ in range(rng.randint(1, 5)):
        count = rng.randint(1, 3)
        start = block_size * rng.randint(2, 10)
        ends.append(rng.randint(start + 1, start + (count + 2) * block_size))
        table = [rng.randint(0, 40) if rng.random() < 0.85 else -1 for _ in range(8)]
        ids.extend([rng.randint(0, 50)] * shift)
        positions.extend(range(start - shift, start + count * block_size))
        slots.extend([-1] * shift)
        stored = rng.random() < 0.6
        gate = -1
        for i in range(count):
            first = len(ids)
            decoded = i == 0 and stored
            tokens = [rng.randint(0, 50) if decoded or rng.random() < 0.4 else MASK for _ in range(block_size)]
            if not decoded:
                tokens[rng.randrange(block_size)] = MASK
            ids.extend(tokens)
            position = start + i * block_size
            page = table[position // page_size]
            base = page * page_size + position % page_size if page >= 0 else -1
            slots.extend([base + j for j in range(block_size)] if decoded and base >= 0 else [-1] * block_size)
            for j in range(block_size):
                sampled = tokens[j] == MASK
                source.append(first + j - shift if sampled else -1)
                result[0].append(int(sampled and rng.random() < 0.5))
                result[1].append(rng.randint(100, 200))
            starts.append(len(source))
            for row, value in zip(blocks, (first, first + block_size, base, gate), strict=True):
                row.append(value)
            force.append(int(i == 0 or rng.random() < 0.4))
            gate = len(starts) - 2
        cu.append(len(ids))
        context.append(start - shift)
        tables.append(table)
    force.append(0)

    def t(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    step = [t(ids), t(source), t(slots), t(result), t(starts), t(blocks)]
    layout = [t(positions), t(cu, torch.int32), t(context, torch.int32), t(tables, torch.int32)]
    if answer_ends:
        layout.append(t(ends, torch.int32))
    join, forcing = rng.randint(1, 3), rng.randint(1, block_size + 1)
    return (
        step, layout, t(force),
        lambda views: BlockOpening(*views[:4], page_size=page_size, block_size=block_size, mask_token_id=MASK,
                                   decoded_to_join=join, answer_ends=views[4] if answer_ends else None),
        lambda f: BlockGates(f, block_size, forcing),
    )  # fmt: skip


@pytest.mark.parametrize("answer_ends", [False, True])
@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("seed", range(16))
def test_the_kernel_moves_running_blocks_on_as_the_reference_does(seed: int, shift: int, answer_ends: bool) -> None:
    step, layout, force, opening, gates = window_step(seed, shift, answer_ends=answer_ends)
    expected = [x.cpu().clone() for x in step], [x.cpu().clone() for x in layout], force.cpu().clone()
    advance_inputs_reference(*expected[0], shift, opening(expected[1]), gates(expected[2]))
    triton_advance_inputs(*step, shift, 3 * 4 + shift, opening(layout), gates(force))
    names = ("ids", "source rows", "slots", "result", "starts", "blocks", "positions", "cu", "context", "tables",
             "answer ends")[: len(step + layout)]
    for name, g, e in zip(names, step + layout, expected[0] + expected[1], strict=True):
        assert g.cpu().tolist() == e.tolist(), name
    assert force.cpu().tolist() == expected[2].tolist(), "force"


def _a_stored_block_then_two_masks_decoded() -> tuple[torch.Tensor, ...]:
    """One request of two blocks of 4 at positions 8-15, its slots in a page of 8 from 24: block 0 stored by this
    step, block 1 accepting its last two masks (17, 18). Returns input ids, source rows, slots, the result,
    starts, blocks, force flags, positions and the context length."""
    return (
        torch.tensor([1, 2, 3, 4, 5, 6, MASK, MASK], dtype=torch.int64),
        torch.tensor([-1, -1, -1, -1, -1, -1, 6, 7], dtype=torch.int64),
        torch.tensor([24, 25, 26, 27, -1, -1, -1, -1], dtype=torch.int64),
        torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 17, 18]], dtype=torch.int64),
        torch.tensor([0, 4, 8], dtype=torch.int64),
        torch.tensor([[0, 4], [4, 8], [24, 28], [-1, 0]], dtype=torch.int64),
        torch.tensor([1, 1, 0], dtype=torch.int64),
        torch.arange(8, 16, dtype=torch.int64),
        torch.tensor([8], dtype=torch.int32),
    )


def test_a_request_whose_leading_block_was_stored_moves_its_blocks_on_by_one() -> None:
    """One request of two blocks of 4 (positions 8-15, pages of 8: 8-15 in page 3, 16-23 in page 6), a block
    forcing once 3 positions before it are decoded, the next one joining once 1 of the newest's is. Block 0 was
    stored by this step; block 1 decodes its last two masks. The rows become blocks 1 and 2: block 1's tokens at
    rows 0-3, decoded (so stored next step, at its slots 28-31, and forcing), then masks at 16-19, sampled, slots
    6 * 8 + 0, forcing too (block 1 is decoded); one block more of context."""
    from diffulex.engine.continuation import BlockOpening

    ids, source, slots, result, starts, blocks, force, positions, context = _a_stored_block_then_two_masks_decoded()
    opening = BlockOpening(positions, torch.tensor([0, 8], dtype=torch.int32), context,
                           torch.tensor([[0, 3, 6]], dtype=torch.int32), page_size=8, block_size=4,
                           mask_token_id=MASK, decoded_to_join=1)  # fmt: skip
    advance_inputs_reference(ids, source, slots, result, starts, blocks, 0, opening, BlockGates(force, 4, 3))
    assert ids.tolist() == [5, 6, 17, 18] + [MASK] * 4
    assert positions.tolist() == list(range(12, 20))
    assert source.tolist() == [-1, -1, -1, -1, 4, 5, 6, 7]
    assert slots.tolist() == [28, 29, 30, 31, -1, -1, -1, -1]
    assert blocks[2].tolist() == [28, 48]
    assert force.tolist() == [1, 1, 0]
    assert context.tolist() == [12]


def test_a_running_set_past_its_answers_end_drains_with_a_placeholder_block_last() -> None:
    """One request of two blocks of 4 (positions 8-15) whose answer ends at 14: no block joins after block 1. Block
    0 was stored by this step; block 1 decodes its two sampled masks (12, 13). The rows still move on: block 1's
    tokens at rows 0-3, decoded (so stored next step at its slots), then a placeholder block: masks, never sampled,
    no slot, no force, at the answer's last position (13), which the rotary table holds; one block more of
    context."""
    from diffulex.engine.continuation import BlockOpening

    ids, source, slots, result, starts, blocks, force, positions, context = _a_stored_block_then_two_masks_decoded()
    opening = BlockOpening(positions, torch.tensor([0, 8], dtype=torch.int32), context,
                           torch.tensor([[0, 3]], dtype=torch.int32), page_size=8, block_size=4, mask_token_id=MASK,
                           decoded_to_join=1, answer_ends=torch.tensor([14], dtype=torch.int32))  # fmt: skip
    advance_inputs_reference(ids, source, slots, result, starts, blocks, 0, opening, BlockGates(force, 4, 3))
    assert ids.tolist() == [5, 6, 17, 18] + [MASK] * 4
    assert positions.tolist() == [12, 13, 14, 15] + [13] * 4
    assert source.tolist() == [-1] * 8
    assert slots.tolist() == [28, 29, 30, 31, -1, -1, -1, -1]
    assert blocks[2].tolist() == [28, -1]
    assert force.tolist() == [1, 0, 0]
    assert context.tolist() == [12]
