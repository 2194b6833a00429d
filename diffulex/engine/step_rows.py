"""A step's flat row inputs (token ids, positions, cache slots), built from each request's span in a few vector ops.

A cold prompt's step has a row per prompt token: 32,000 rows for a 32k-token prompt. Built row by row and block by
block in Python (a range of slots per block of 4, lists converted to tensors afterwards) that took milliseconds of
host time before the prompt's first token. Here each request contributes its span: its first position, its tokens
(a view of the prompt's int64 array for prompt rows), the runs of positions whose K/V the step stores and its page
table; the flat arrays then come from numpy over all requests at once. The work per row is C's, and a decode step of
many requests pays a handful of vector ops instead of a Python loop per request and block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NO_SLOT = -1  # a row whose K/V is not stored


class StepRows:
    """Collects the requests' spans of one step (`add`), then builds its flat rows (`build`)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.num_rows = 0
        self._token_pieces: list[np.ndarray] = []
        self._short_tokens: list[int] = []  # list-valued token spans since the last array piece, converted at once
        self._starts: list[int] = []
        self._lens: list[int] = []
        # per stored run: its first row, first position, end position, and the index of its request's table
        self._runs: list[tuple[int, int, int, int]] = []
        self._tables: list[np.ndarray] = []
        self._owners: list[int] = []  # request id of each table, for the error of a stored row without a page

    def add(
        self,
        tokens: Sequence[int] | np.ndarray,
        start: int,
        stored: Sequence[tuple[int, int]],
        table: np.ndarray | None,
        owner: int,
    ) -> int:
        """Append one request's rows: ``tokens`` at positions ``start, start + 1, ...``, the K/V of the positions in
        the ``stored`` runs (``(lo, hi)``, within the span) going to their slots in ``table`` (the request's page
        table; unread when nothing is stored). Returns the span's first row."""
        first = self.num_rows
        if isinstance(tokens, np.ndarray):
            self._flush_short_tokens()
            self._token_pieces.append(tokens)
        else:
            self._short_tokens.extend(tokens)
        self._starts.append(start)
        self._lens.append(len(tokens))
        if stored:
            index = len(self._tables)
            self._tables.append(table)
            self._owners.append(owner)
            self._runs.extend((first + lo - start, lo, hi, index) for lo, hi in stored)
        self.num_rows += len(tokens)
        return first

    def _flush_short_tokens(self) -> None:
        if self._short_tokens:
            self._token_pieces.append(np.array(self._short_tokens, dtype=np.int64))
            self._short_tokens = []

    def build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's ``input_ids``, ``positions`` and ``slot_mapping`` (int64, one entry per row)."""
        self._flush_short_tokens()
        # a copy (the step owns its rows; a prompt's piece is a read-only view), at memory speed
        input_ids = np.concatenate(self._token_pieces or [np.empty(0, np.int64)], dtype=np.int64)
        return input_ids, self._positions(), self._slots()

    def _positions(self) -> np.ndarray:
        if len(self._starts) == 1:
            return np.arange(self._starts[0], self._starts[0] + self.num_rows, dtype=np.int64)
        lens = np.array(self._lens, dtype=np.int64)
        first_rows = np.cumsum(lens) - lens
        return np.arange(self.num_rows, dtype=np.int64) + np.repeat(np.array(self._starts) - first_rows, lens)

    def _slots(self) -> np.ndarray:
        slots = np.full(self.num_rows, NO_SLOT, dtype=np.int64)
        if len(self._runs) == 1:  # one request stores (a prompt's step, or one decoder's finished block)
            first_row, lo, hi, _ = self._runs[0]
            slots[first_row : first_row + hi - lo] = self._run_slots(lo, hi, self._tables[0], self._owners[0])
        elif self._runs:
            self._scatter_runs(slots)
        return slots

    def _run_slots(self, lo: int, hi: int, table: np.ndarray, owner: int) -> np.ndarray:
        """The slots of positions ``[lo, hi)``, page by page: each page's base slot broadcast over its rows."""
        page_size = self.page_size
        first_page, end_page = lo // page_size, -(-hi // page_size)
        if end_page > table.shape[0]:
            position = max(lo, table.shape[0] * page_size)
            raise RuntimeError(f"request {owner}: position {position} is stored but has no page")
        bases = table[first_page:end_page].astype(np.int64) * page_size
        offset = lo - first_page * page_size
        return (bases[:, None] + np.arange(page_size, dtype=np.int64)).ravel()[offset : offset + hi - lo]

    def _scatter_runs(self, slots: np.ndarray) -> None:
        """The slots of several requests' runs, row by row in one set of vector ops."""
        page_size = self.page_size
        runs = np.array(self._runs, dtype=np.int64)
        first_row, lo, hi, table = runs[:, 0], runs[:, 1], runs[:, 2], runs[:, 3]
        run_lens = hi - lo
        run = np.repeat(np.arange(len(runs)), run_lens)  # the run of each stored row
        within = np.arange(run.shape[0], dtype=np.int64) - np.repeat(np.cumsum(run_lens) - run_lens, run_lens)
        positions = lo[run] + within
        logical = positions // page_size
        sizes = np.array([t.shape[0] for t in self._tables], dtype=np.int64)
        row_table = table[run]
        missing = logical >= sizes[row_table]
        if missing.any():
            at = int(np.argmax(missing))
            raise RuntimeError(
                f"request {self._owners[int(row_table[at])]}: position {int(positions[at])} is stored but has no page"
            )
        if len(self._tables) == 1:
            pages = self._tables[0][logical]
        else:
            offsets = np.cumsum(sizes) - sizes
            pages = np.concatenate(self._tables)[offsets[row_table] + logical]
        slots[first_row[run] + within] = pages.astype(np.int64) * page_size + positions % page_size
