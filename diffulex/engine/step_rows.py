"""A step's flat row inputs (token ids, positions, cache slots), a long span's built in a few vector ops.

A cold prompt's step has a row per prompt token: 32,000 rows for a 32k-token prompt. Built row by row and block by
block in Python (a range of slots per block of 4, lists converted to tensors afterwards) that took milliseconds of
host time before the prompt's first token. Here each request contributes its span: its first position, its tokens
(a view of the prompt's int64 array for prompt rows), the runs of positions whose K/V the step stores and its page
table. A long span's rows come from numpy (its slots page by page, one broadcast per run of stored positions); a
decoder's few rows are appended to plain lists, which cost less than the fixed price of a vector op at that size, and
the lists become arrays once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from diffulex.strategy.page_table import page_array

NO_SLOT = -1  # a row whose K/V is not stored
# Rows from which a request's span is built in vector ops: a handful of numpy calls cost a few microseconds whatever
# their length, about what appending 64 rows to lists costs.
VECTOR_SPAN_ROWS = 64


class StepRows:
    """Collects the requests' spans of one step (`add`), then builds its flat rows (`build`)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.num_rows = 0
        self._pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # in row order
        # the short spans since the last piece, as lists
        self._ids: list[int] = []
        self._positions: list[int] = []
        self._slots: list[int] = []

    def add(
        self,
        tokens: Sequence[int] | np.ndarray,
        start: int,
        stored: Sequence[tuple[int, int]],
        table: Sequence[int],
        owner: int,
    ) -> int:
        """Append one request's rows: ``tokens`` at positions ``start, start + 1, ...``, the K/V of the positions in
        the ``stored`` runs (``(lo, hi)``, ordered, within the span) going to their slots in ``table`` (the request's
        page table). ``owner`` names the request in the error of a stored position without a page. Returns the
        span's first row."""
        first, n = self.num_rows, len(tokens)
        if n >= VECTOR_SPAN_ROWS:
            self._flush()
            self._pieces.append(self._span_arrays(tokens, start, stored, table, owner))
        else:
            self._ids.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
            self._positions.extend(range(start, start + n))
            slots, mark = self._slots, start
            for lo, hi in stored:
                slots.extend([NO_SLOT] * (lo - mark))
                slots.extend(self._listed_slots(lo, hi, table, owner))
                mark = hi
            slots.extend([NO_SLOT] * (start + n - mark))
        self.num_rows += n
        return first

    def build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's ``input_ids``, ``positions`` and ``slot_mapping`` (int64, one entry per row; each a new array)."""
        self._flush()
        if len(self._pieces) == 1:
            return self._pieces[0]
        if not self._pieces:
            return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
        ids, positions, slots = zip(*self._pieces, strict=True)
        return np.concatenate(ids), np.concatenate(positions), np.concatenate(slots)

    def _flush(self) -> None:
        if self._ids:
            self._pieces.append((np.array(self._ids, dtype=np.int64), np.array(self._positions, dtype=np.int64),
                                 np.array(self._slots, dtype=np.int64)))  # fmt: skip
            self._ids, self._positions, self._slots = [], [], []

    def _span_arrays(
        self, tokens: Sequence[int] | np.ndarray, start: int, stored: Sequence[tuple[int, int]], table: Sequence[int],
        owner: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """One long span's rows in vector ops: a loop over its stored runs only (a cold prompt has one)."""
        n = len(tokens)
        ids = np.array(tokens, dtype=np.int64)  # a copy: the step owns its rows (a prompt's view is read-only)
        slots = np.full(n, NO_SLOT, dtype=np.int64)
        pages = page_array(table) if stored else None
        for lo, hi in stored:
            slots[lo - start : hi - start] = self._run_slots(lo, hi, pages, owner)
        return ids, np.arange(start, start + n, dtype=np.int64), slots

    def _run_slots(self, lo: int, hi: int, pages: np.ndarray, owner: int) -> np.ndarray:
        """The slots of positions ``[lo, hi)``, page by page: each page's base slot broadcast over its rows."""
        page_size = self.page_size
        first_page, end_page = lo // page_size, -(-hi // page_size)
        if end_page > pages.shape[0]:
            raise RuntimeError(_no_page(owner, max(lo, pages.shape[0] * page_size)))
        bases = pages[first_page:end_page].astype(np.int64) * page_size
        offset = lo - first_page * page_size
        return (bases[:, None] + np.arange(page_size, dtype=np.int64)).ravel()[offset : offset + hi - lo]

    def _listed_slots(self, lo: int, hi: int, table: Sequence[int], owner: int) -> range | list[int]:
        """The slots of a short run ``[lo, hi)``: one range when it lies in one page (a decoder's block), else one
        per page."""
        page_size = self.page_size
        slots: list[int] = []
        while lo < hi:
            page = lo // page_size
            if page >= len(table):
                raise RuntimeError(_no_page(owner, lo))
            run_end = min(hi, (page + 1) * page_size)
            base = table[page] * page_size + lo % page_size
            if run_end == hi and not slots:
                return range(base, base + hi - lo)
            slots.extend(range(base, base + run_end - lo))
            lo = run_end
        return slots


def _no_page(owner: int, position: int) -> str:
    return f"request {owner}: position {position} is stored but has no page"
