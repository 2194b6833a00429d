"""A step's flat rows equal the rows written out position by position.

A request's span of 64 rows or more is built in vector ops, a shorter one in lists; both are covered. The
reference below is the straightforward construction: every position of every span in turn, its token, its
position, and its slot (its page's physical page times the page size plus its offset) when a stored run covers it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from diffulex.engine.step_rows import NO_SLOT, StepRows

PAGE = 8


def reference_rows(spans, page_size: int = PAGE) -> tuple[list[int], list[int], list[int]]:
    ids, positions, slots = [], [], []
    for tokens, start, stored, table, _ in spans:
        for i, token in enumerate(list(tokens)):
            position = start + i
            ids.append(int(token))
            positions.append(position)
            if any(lo <= position < hi for lo, hi in stored):
                slots.append(int(table[position // page_size]) * page_size + position % page_size)
            else:
                slots.append(NO_SLOT)
    return ids, positions, slots


def built(spans, page_size: int = PAGE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = StepRows(page_size)
    firsts = [rows.add(tokens, start, stored, table, owner) for tokens, start, stored, table, owner in spans]
    assert firsts == list(np.cumsum([0] + [len(s[0]) for s in spans])[:-1]), "each span's first row"
    return rows.build()


def assert_equal_to_reference(spans, page_size: int = PAGE) -> None:
    ids, positions, slots = built(spans, page_size)
    for got in (ids, positions, slots):
        assert got.dtype == np.int64
    assert (ids.tolist(), positions.tolist(), slots.tolist()) == reference_rows(spans, page_size)


def shuffled_table(num_pages: int, seed: int) -> np.ndarray:
    return np.array(random.Random(seed).sample(range(10 * num_pages), num_pages), dtype=np.int32)


def test_a_long_prompt_stored_from_mid_page_to_mid_page_gets_the_slots_of_its_pages():
    table = shuffled_table(130, seed=0)
    tokens = np.arange(1000, 2037, dtype=np.int64)  # positions 3 .. 1039: starts and ends inside a page
    assert_equal_to_reference([(tokens, 3, [(5, 1037)], table, 7)])


def test_many_requests_with_list_and_array_tokens_and_several_runs_each():
    rng = random.Random(1)
    spans = []
    for owner in range(40):
        start = rng.randrange(0, 200)
        length = rng.randrange(3, 60) if owner % 4 else rng.randrange(60, 300)  # short spans and long ones
        table = shuffled_table(-(-(start + length) // PAGE), seed=owner)
        cuts = sorted(rng.sample(range(start, start + length + 1), 4))
        stored = [(cuts[0], cuts[1]), (cuts[2], cuts[3])] if owner % 3 else []
        tokens = [rng.randrange(500) for _ in range(length)]
        spans.append((np.array(tokens, dtype=np.int64) if owner % 2 else tokens, start, stored, table, owner))
    assert_equal_to_reference(spans)


def test_a_decode_batch_where_some_requests_store_their_finished_block():
    spans = [
        ([5, 6, 7, 8], 40 + 8 * i, [(40 + 8 * i, 44 + 8 * i)] if i % 2 else [], shuffled_table(24, seed=i), i)
        for i in range(16)
    ]
    assert_equal_to_reference(spans)


def test_no_request_gives_empty_rows():
    ids, positions, slots = StepRows(PAGE).build()
    assert ids.shape == positions.shape == slots.shape == (0,)


@pytest.mark.parametrize("length", [20, 200], ids=["short span", "long span"])
def test_a_stored_position_without_a_page_names_the_request_and_the_position(length: int):
    rows = StepRows(PAGE)
    rows.add([1, 2], 0, [(0, 2)], [3], 0)
    with pytest.raises(RuntimeError, match="request 9: position 16 is stored but has no page"):
        rows.add(list(range(length)), 0, [(0, length)], [4, 5], 9)  # two pages cover 16 positions
