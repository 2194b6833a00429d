"""A request's block list: its prompt blocks are made when first read, and read as an eagerly made list would be.

Every statement compares a `BlockList` with what a plain list of eagerly made blocks gives under the same changes
(a prefix-cache hit, a loss of the cache, blocks opened after the prompt), and says how many blocks exist.
"""

from __future__ import annotations

import pytest

from diffulex.strategy.block import Block, BlockStatus
from diffulex.strategy.block_list import BlockList, UnreadBlocks

SIZE = 4
A, T, C = BlockStatus.ACTIVE, BlockStatus.TO_CACHE, BlockStatus.IN_CACHE


def described(blocks) -> list[tuple[int, int, int, BlockStatus]]:
    return [(b.index, b.start, b.end, b.status) for b in blocks]


def eager(num_prompt_blocks: int) -> list[Block]:
    return [Block(i, i * SIZE, SIZE, T) for i in range(num_prompt_blocks)]


def test_prompt_blocks_read_like_eagerly_made_final_blocks():
    blocks = BlockList(SIZE, 5)
    assert len(blocks) == 5
    assert described(blocks) == described(eager(5))


def test_nothing_is_made_until_read_and_a_read_block_is_the_same_object_every_time():
    blocks = BlockList(SIZE, 8000)
    assert blocks.num_made == 0
    third = blocks[2]
    assert blocks[2] is third and blocks[-7998] is third and blocks[1:3][1] is third
    assert blocks.num_made == 2  # the slice made block 1 too


def test_negative_indexes_and_slices_read_as_in_a_list():
    blocks, reference = BlockList(SIZE, 6), eager(6)
    assert described([blocks[-1]]) == described([reference[-1]])
    for piece in (slice(2, 5), slice(-3, None), slice(None, None, 2), slice(4, 2)):
        assert described(blocks[piece]) == described(reference[piece])
    with pytest.raises(IndexError):
        blocks[6]


def test_a_prefix_hit_marks_the_leading_blocks_cached_whether_read_before_or_not():
    blocks = BlockList(SIZE, 6)
    read_early = blocks[1]
    blocks.mark_cached(4)
    assert [b.status for b in blocks] == [C, C, C, C, T, T]
    assert read_early.status is C
    assert blocks.num_made == 6  # the iteration above made them


def test_a_prefix_hit_of_thousands_of_blocks_makes_none_of_them():
    blocks = BlockList(SIZE, 8000)
    blocks.mark_cached(7936)
    assert blocks.num_made == 0
    assert blocks[7935].status is C and blocks[7936].status is T


def test_losing_the_cache_makes_every_cached_block_to_cache_again_and_leaves_active_ones():
    blocks = BlockList(SIZE, 3)
    blocks.mark_cached(3)
    opened = Block(3, 12, SIZE, A)
    blocks.append(opened)
    read = blocks[0]
    blocks.uncache()
    assert [b.status for b in blocks] == [T, T, T, A]
    assert read.status is T and blocks[3] is opened


def test_a_block_stored_by_a_forward_keeps_its_status_through_later_reads():
    blocks = BlockList(SIZE, 4)
    blocks[0].status = C  # a step stored it
    assert blocks[0].status is C and blocks[1].status is T


def test_blocks_opened_after_the_prompt_are_appended_as_made():
    blocks = BlockList(SIZE, 2)
    opened = Block(2, 8, SIZE, A)
    blocks.append(opened)
    assert len(blocks) == 3 and blocks[-1] is opened and blocks.num_made == 1


def expanded(segments) -> list[tuple[int, BlockStatus, bool]]:
    """Each block the segments cover: its index, its status and whether it was given as a made block."""
    out = []
    for segment in segments:
        if isinstance(segment, UnreadBlocks):
            out.extend((i, segment.status, False) for i in segment.indices)
        else:
            out.append((segment.index, segment.status, True))
    return out


def test_segments_give_every_block_of_a_range_with_its_status_and_make_none():
    blocks = BlockList(SIZE, 40)
    blocks.mark_cached(12)
    read = [blocks[5], blocks[20], blocks[21]]
    read[1].status = C  # a forward stored it
    blocks.append(Block(40, 160, SIZE, A))
    ranges = ((0, 41), (3, 22), (12, 13), (21, 41), (30, 30))
    got = {(lo, hi): expanded(blocks.segments(lo, hi)) for lo, hi in ranges}
    assert blocks.num_made == 4, "segments make no block"
    for (lo, hi), covered in got.items():
        assert [(i, status) for i, status, _ in covered] == [(b.index, b.status) for b in blocks[lo:hi]]
        assert [i for i, _, was_made in covered if was_made] == [i for i in (5, 20, 21, 40) if lo <= i < hi]


def test_storing_a_cold_prompt_caches_its_blocks_without_making_them():
    blocks = BlockList(SIZE, 8000)
    blocks.append(Block(8000, 32000, SIZE, A))
    blocks.store(0, 8001)
    assert blocks.num_made == 1
    assert blocks[7999].status is C and blocks[8000].status is A
    assert blocks.first_not_cached(0) == 8000


def test_storing_a_range_caches_its_to_cache_blocks_as_an_eager_list_would():
    blocks, reference = BlockList(SIZE, 30), eager(30)
    for b in (blocks, reference):
        b.append(Block(30, 120, SIZE, A))
    blocks.mark_cached(6)
    for b in reference[:6]:
        b.status = C
    blocks[10].status = A  # a made block another rule holds back (it keeps its status)
    reference[10].status = A
    blocks.store(6, 20)
    for b in reference[6:20]:
        if b.status is T:
            b.status = C
    assert described(blocks) == described(reference)
    assert blocks.first_not_cached(0) == 10 and blocks.first_not_cached(11) == 20


def test_storing_past_an_unread_uncached_gap_keeps_the_gap_to_cache():
    blocks = BlockList(SIZE, 12)
    blocks.store(8, 12)  # blocks 0-7 were not stored: they stay TO_CACHE
    assert [b.status for b in blocks] == [T] * 8 + [C] * 4
    assert blocks.first_not_cached(0) == 0 and blocks.first_not_cached(8) == 12
