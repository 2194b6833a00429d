"""A request's page table: the physical page of each logical page, as a list and as an int32 array.

Every step stages the page table of each of its requests (the eager path's tensor, a graph's static buffer). From
a Python list that is a conversion of every entry, each step: 1,000 entries for a 32k-token context, about 16 us
into a graph buffer and 57 us into a tensor on a CPU core, for every such request of the batch. The table only
grows by appends while a request runs, so its array (`as_array`) is written once per entry: each step converts
only the pages given since the last one, and staging copies the array at memory speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, SupportsIndex

import numpy as np

MIN_CAPACITY = 16  # entries of a new table's array; it doubles when full


class PageTable(list):
    """A list of page ids (every list operation works) with an int32 array of the same entries (`as_array`).

    The array is brought up to date when it is read, from the first entry it may not match: appends keep the entries
    before them, ``pop`` and ``clear`` keep what remains; any other change rewrites the array at its next read.
    """

    __slots__ = ("_array", "_valid")

    def __init__(self, pages: Iterable[int] = ()) -> None:
        super().__init__(pages)
        self._array = np.empty(max(MIN_CAPACITY, len(self)), dtype=np.int32)
        self._valid = 0  # leading entries of `_array` known to equal the list's

    def as_array(self) -> np.ndarray:
        """The entries as an int32 array (a view, valid until the table changes; read it, do not write it)."""
        n = len(self)
        if self._valid < n:
            if self._array.shape[0] < n:
                grown = np.empty(max(n, 2 * self._array.shape[0]), dtype=np.int32)
                grown[: self._valid] = self._array[: self._valid]
                self._array = grown
            self._array[self._valid : n] = super().__getitem__(slice(self._valid, n))
            self._valid = n
        return self._array[:n]

    # changes that keep the leading entries: appends add after them, pop and clear remove from the end
    def pop(self, index: SupportsIndex = -1) -> int:
        page = super().pop(index)
        position = int(index)
        removed_at = position if position >= 0 else position + len(self) + 1
        self._valid = min(self._valid, removed_at)  # the entries before it are unchanged
        return page

    def clear(self) -> None:
        super().clear()
        self._valid = 0

    # any other in-place change: the array is rewritten where it may differ
    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self._valid = 0

    def __delitem__(self, index: Any) -> None:
        super().__delitem__(index)
        self._valid = 0

    def insert(self, index: SupportsIndex, page: int) -> None:
        super().insert(index, page)
        self._valid = 0

    def remove(self, page: int) -> None:
        super().remove(page)
        self._valid = 0

    def sort(self, *args: Any, **kwargs: Any) -> None:
        super().sort(*args, **kwargs)
        self._valid = 0

    def reverse(self) -> None:
        super().reverse()
        self._valid = 0

    def __imul__(self, times: SupportsIndex) -> PageTable:
        super().__imul__(times)
        self._valid = 0
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its array's bytes (a tensor-parallel step sends every request's table to the workers)."""
        return (_from_bytes, (self.as_array().tobytes(),))


def _from_bytes(data: bytes) -> PageTable:
    """A table from its int32 bytes, its array already in step with its entries."""
    pages = np.frombuffer(data, dtype=np.int32)
    table = PageTable(pages.tolist())
    table._array[: len(pages)] = pages
    table._valid = len(pages)
    return table


def page_array(table: Sequence[int]) -> np.ndarray:
    """The int32 array of a page table: `PageTable.as_array`, or a conversion of any other sequence."""
    if isinstance(table, PageTable):
        return table.as_array()
    return np.asarray(table, dtype=np.int32)
