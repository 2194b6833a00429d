"""A request's blocks in order, its prompt's whole blocks made only when something reads them.

A 32k-token prompt has 8,000 blocks of 4. Making them all when the request is created, and marking each one cached
when a prefix-cache hit supplies it, cost milliseconds of host time before the first token, although a hit's steps
read only the blocks of its uncached tail. Here a prompt block is a Block object only from its first read on (the
same object every read after, so identity comparisons hold); until then its status is implied: the prompt's blocks
are final from the start (``TO_CACHE``), and a prefix-cache hit makes the leading ones ``IN_CACHE`` in one step
(`mark_cached`). Blocks the request opens later are appended as made.

A cold prompt's first step stores every prompt block, and that too makes none of them: `segments` gives the step the
runs of unread blocks with their one status (the runner turns them into cache slots in vector ops), and `store`
caches a range of blocks, the unread ones by one assignment.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from diffulex.strategy.block import Block, BlockStatus


class UnreadBlocks(NamedTuple):
    """A run of consecutive prompt blocks not read yet, all of one status."""

    indices: range
    status: BlockStatus


class BlockList:
    """The list of a request's blocks: indexing (also negative), slicing, iteration, ``len`` and ``append``."""

    def __init__(self, block_size: int, num_prompt_blocks: int) -> None:
        self.block_size = block_size
        # None: a prompt block not read yet (its status follows from `_cached_below`)
        self._blocks: list[Block | None] = [None] * num_prompt_blocks
        self._num_prompt_blocks = num_prompt_blocks  # only these may be unread
        self._cached_below = 0  # unread prompt blocks below this index are IN_CACHE, the rest TO_CACHE

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, index: int | slice) -> Block | list[Block]:
        if isinstance(index, slice):
            blocks = self._blocks[index]
            if None not in blocks:
                return blocks
            self._make(range(*index.indices(len(self._blocks))))
            return self._blocks[index]
        block = self._blocks[index]
        return block if block is not None else self._block(index % len(self._blocks))

    def __iter__(self) -> Iterator[Block]:
        for i in range(len(self._blocks)):
            yield self[i]

    def __repr__(self) -> str:
        return f"BlockList({len(self._blocks)} blocks, {self.num_made} made)"

    @property
    def num_made(self) -> int:
        """Block objects made so far: the prompt blocks read at least once, and the blocks opened after them."""
        return len(self._blocks) - self._blocks.count(None)

    def _block(self, index: int) -> Block:
        block = self._blocks[index]
        if block is None:
            status = BlockStatus.IN_CACHE if index < self._cached_below else BlockStatus.TO_CACHE
            block = self._blocks[index] = Block(index, index * self.block_size, self.block_size, status)
        return block

    def _make(self, indices: range) -> None:
        """Make the unread blocks among ``indices`` in one loop (a cold prompt's first step reads all of them)."""
        blocks, size, cached_below = self._blocks, self.block_size, self._cached_below
        for i in indices:
            if blocks[i] is None:
                blocks[i] = Block(i, i * size, size, BlockStatus.IN_CACHE if i < cached_below else BlockStatus.TO_CACHE)

    def append(self, block: Block) -> None:
        self._blocks.append(block)

    def mark_cached(self, num_blocks: int) -> None:
        """The first ``num_blocks`` blocks (final ones, a prefix-cache hit's) are ``IN_CACHE``: unread ones by one
        assignment, those read already one by one (few: a request holds no cache when it is admitted)."""
        self._cached_below = max(self._cached_below, num_blocks)
        for block in filter(None, self._blocks[:num_blocks]):
            block.status = BlockStatus.IN_CACHE

    def segments(self, lo: int, hi: int) -> list[Block | UnreadBlocks]:
        """The blocks of indices ``[lo, hi)`` in order, without making any: a block made already as itself, each run
        of unread ones of one status as `UnreadBlocks`. The made blocks are found at C speed (a cold prompt's 8,000
        blocks hold a handful of them; a decoder's few blocks are all made)."""
        lo, hi = max(lo, 0), min(hi, len(self._blocks))
        made = list(filter(None, self._blocks[lo:hi]))
        if len(made) == hi - lo:
            return made
        segments: list[Block | UnreadBlocks] = []
        cursor = lo
        for block in made:
            self._add_unread(segments, cursor, block.index)
            segments.append(block)
            cursor = block.index + 1
        self._add_unread(segments, cursor, hi)
        return segments

    def _add_unread(self, segments: list[Block | UnreadBlocks], lo: int, hi: int) -> None:
        """Append unread blocks ``[lo, hi)`` (none of them made) as runs of one status: cached below
        `_cached_below`."""
        split = min(max(self._cached_below, lo), hi)
        if lo < split:
            segments.append(UnreadBlocks(range(lo, split), BlockStatus.IN_CACHE))
        if split < hi:
            segments.append(UnreadBlocks(range(split, hi), BlockStatus.TO_CACHE))

    def store(self, lo: int, hi: int) -> None:
        """Every ``TO_CACHE`` block of indices ``[lo, hi)`` is ``IN_CACHE`` (a forward wrote their K/V): the unread
        ones by one assignment, the made ones one by one. Blocks before ``lo`` are cached already (``lo`` is the
        first block of the request's uncached rest); an unread one among them that is not is made first, keeping
        its status."""
        hi = min(hi, len(self._blocks))
        if lo >= hi:
            return
        gap = self._blocks[self._cached_below : min(lo, self._num_prompt_blocks)]  # empty once a prompt is stored
        if None in gap:
            self._make(range(self._cached_below, lo))  # keep their status out of the assignment below
        for block in filter(None, self._blocks[lo:hi]):
            if block.status is BlockStatus.TO_CACHE:
                block.status = BlockStatus.IN_CACHE
        self._cached_below = max(self._cached_below, hi)

    def first_not_cached(self, lo: int) -> int:
        """The index of the first block at or after ``lo`` that is not ``IN_CACHE`` (``len`` when there is none)."""
        cursor, cached_below = lo, self._cached_below
        for block in filter(None, self._blocks[lo:]):
            unread = max(cursor, cached_below)  # the first uncached one of the unread blocks before this block
            if unread < block.index:
                return unread
            if block.status is not BlockStatus.IN_CACHE:
                return block.index
            cursor = block.index + 1
        return min(max(cursor, cached_below), len(self._blocks))

    def uncache(self) -> None:
        """Every ``IN_CACHE`` block becomes ``TO_CACHE`` (the request lost its pages)."""
        self._cached_below = 0
        for block in filter(None, self._blocks):
            if block.status is BlockStatus.IN_CACHE:
                block.status = BlockStatus.TO_CACHE
