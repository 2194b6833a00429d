"""A request's blocks in order, its prompt's whole blocks made only when something reads them.

A 32k-token prompt has 8,000 blocks of 4. Making them all when the request is created, and marking each one cached
when a prefix-cache hit supplies it, cost milliseconds of host time before the first token, although a hit's steps
read only the blocks of its uncached tail. Here a prompt block is a Block object only from its first read on (the
same object every read after, so identity comparisons hold); until then its status is implied: the prompt's blocks
are final from the start (``TO_CACHE``), and a prefix-cache hit makes the leading ones ``IN_CACHE`` in one step
(`mark_cached`). Blocks the request opens later are appended as made.
"""

from __future__ import annotations

from collections.abc import Iterator

from diffulex.strategy.block import Block, BlockStatus


class BlockList:
    """The list of a request's blocks: indexing (also negative), slicing, iteration, ``len`` and ``append``."""

    def __init__(self, block_size: int, num_prompt_blocks: int) -> None:
        self.block_size = block_size
        # None: a prompt block not read yet (its status follows from `_cached_below`)
        self._blocks: list[Block | None] = [None] * num_prompt_blocks
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

    def uncache(self) -> None:
        """Every ``IN_CACHE`` block becomes ``TO_CACHE`` (the request lost its pages)."""
        self._cached_below = 0
        for block in filter(None, self._blocks):
            if block.status is BlockStatus.IN_CACHE:
                block.status = BlockStatus.TO_CACHE
