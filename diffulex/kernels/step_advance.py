"""Triton version of `diffulex.engine.continuation.advance_inputs_reference`: two small launches.

The first has one program per sampled block. A block's sampled rows are contiguous (``starts[s] .. starts[s + 1]``),
so the program that owns block ``s`` writes its accepted tokens into the next step's input rows, retires their
sample rows, counts the rows still to decode and, when none is left, turns on the K/V store of the block's input
rows; with ``GATES`` a block also counts the rows left in the blocks before it (`diffulex.engine.continuation.
BlockGates`): whether it may force next step, and whether it is stored. Those counts read rows other programs
retire, but a row is retired only where it was accepted, and an accepted row counts as decoded either way, so the
order cannot change them.

The second, with a `BlockOpening`, has one program per request: where the step stored the request's leading block,
the request's blocks move on by one (`diffulex.engine.continuation.move_window_reference`). Each block's rows take
the next block's, which another block's program would still be writing in the first launch; within one program
they are moved in order. Both launches take a few microseconds and are captured at the end of the sampling graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

if TYPE_CHECKING:
    from diffulex.engine.continuation import BlockGates, BlockOpening


# Blocks the window kernel's program looks at at once while it scans the launch's blocks for its request's: one
# compiled variant whatever the bucket, and few registers (a bucket of 512 requests has 2,048 blocks at buffer 4).
_BLOCKS_SCANNED = 128


@triton.jit
def _rows_left(source_ptr, result_ptr, starts_ptr, seg, BLOCK: tl.constexpr):
    """Sampled rows of block ``seg`` still to decode after this step (0 for ``seg`` < 0)."""
    first = tl.load(starts_ptr + seg, mask=seg >= 0, other=0)
    last = tl.load(starts_ptr + seg + 1, mask=seg >= 0, other=0)
    offs = tl.arange(0, BLOCK)
    ok = offs < last - first
    source = tl.load(source_ptr + first + offs, mask=ok, other=-1)
    accepted = tl.load(result_ptr + first + offs, mask=ok, other=0)
    return tl.sum(((source >= 0) & (accepted == 0)).to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["num_rows"])  # one variant for every bucket's row count
def _advance_kernel(
    ids_ptr,  # [T] int64 input tokens of the step
    source_ptr,  # [N] int64 hidden-state row each sampled row reads, -1: not sampled
    slots_ptr,  # [T] int64 cache slot of each input row, -1: not stored
    result_ptr,  # [2, N] int64 accepted flag, then token, of each sampled row
    starts_ptr,  # [S + 1] int64 first sampled row of each block
    blocks_ptr,  # [4, >= S] int64 per block: its first input row, one past its last, the first row's slot, its gate
    result_stride,
    blocks_stride,
    shift,
    num_rows,  # input rows of the step: a token whose input row lies past them is not written
    force_ptr,  # [S + 1] int64 whether each block may force (GATES only, as the two below)
    gate_block_size,
    decoded_to_force,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    GATES: tl.constexpr,  # move forcing and stores on along the blocks' gates
):
    release_dependents(USE_PDL)
    seg = tl.program_id(0)
    first = tl.load(starts_ptr + seg)
    last = tl.load(starts_ptr + seg + 1)
    offs = tl.arange(0, BLOCK)
    ok = offs < last - first
    # the layout is step metadata, and only this kernel writes the source rows: both may be read before the wait
    source = tl.load(source_ptr + first + offs, mask=ok, other=-1)
    row_lo = tl.load(blocks_ptr + seg)
    row_hi = tl.load(blocks_ptr + blocks_stride + seg)
    base = tl.load(blocks_ptr + 2 * blocks_stride + seg)  # -1: the block has no page yet
    wait_for_inputs(USE_PDL)  # the result comes from the sampler's kernels just before
    accepted = tl.load(result_ptr + first + offs, mask=ok, other=0)
    token = tl.load(result_ptr + result_stride + first + offs, mask=ok, other=0)
    take = (source >= 0) & (accepted != 0)
    tl.store(ids_ptr + source + shift, token, mask=take & (source + shift < num_rows))
    tl.store(source_ptr + first + offs, tl.full((BLOCK,), -1, tl.int64), mask=take)
    left = tl.sum(((source >= 0) & (accepted == 0)).to(tl.int32), axis=0)
    decoded = left == 0
    if GATES:
        gate = tl.load(blocks_ptr + 3 * blocks_stride + seg)
        gate_left = _rows_left(source_ptr, result_ptr, starts_ptr, gate, BLOCK)
        forces = (gate >= 0) & (gate_block_size - gate_left >= decoded_to_force)
        tl.store(force_ptr + seg, tl.full((), 1, tl.int64), mask=forces)
        # stored once every block along its gates is decoded
        while decoded & (gate >= 0):
            decoded = _rows_left(source_ptr, result_ptr, starts_ptr, gate, BLOCK) == 0
            gate = tl.load(blocks_ptr + 3 * blocks_stride + gate)
    n_store = tl.where(decoded & (base >= 0), row_hi - row_lo, 0)
    store = offs < n_store
    tl.store(slots_ptr + row_lo + offs, base + offs, mask=store)


@triton.jit
def _move_window_kernel(
    ids_ptr,  # [T] int64 input tokens, as the first launch left them
    source_ptr,  # [N] int64 (after the first launch: -1 where decoded)
    slots_ptr,  # [T] int64
    result_ptr,  # [2, N] int64 (the accepted flags: a block that accepted nothing this step was decoded before it)
    starts_ptr,  # [S + 1] int64
    blocks_ptr,  # [4, >= S] int64
    blocks_stride,
    num_blocks,
    force_ptr,  # [S + 1] int64
    positions_ptr,  # [T] int64
    cu_seqlens_ptr,  # [R + 1] int32
    context_lens_ptr,  # [R] int32
    tables_ptr,  # [R, P] int32
    ends_ptr,  # [R] int32 each request's answer end (HAS_ENDS only): no position at or past it is sampled
    tables_stride,
    tables_width,
    shift,
    page_size,
    mask_token_id,
    decoded_to_force,
    decoded_to_join,
    BLOCK_SIZE: tl.constexpr,  # a whole block's rows
    BLOCK: tl.constexpr,  # a power of two >= BLOCK_SIZE
    ROWS: tl.constexpr,  # a power of two >= a request's rows
    SCANNED: tl.constexpr,  # blocks looked at at once (`_BLOCKS_SCANNED`)
    HAS_ENDS: tl.constexpr,
):
    request = tl.program_id(0)
    lo = tl.load(cu_seqlens_ptr + request).to(tl.int64)
    hi = tl.load(cu_seqlens_ptr + request + 1).to(tl.int64)
    first_row = lo + shift
    # the request's blocks: those whose first input row lies in its rows (consecutive block numbers, disjoint rows:
    # whole blocks as many as its rows hold tile them in order)
    count = tl.zeros((), tl.int32)
    not_whole = tl.zeros((), tl.int32)
    lead = tl.full((), 2147483647, tl.int32)
    for first_scanned in range(0, num_blocks, SCANNED):
        segs = first_scanned + tl.arange(0, SCANNED)
        seg_ok = segs < num_blocks
        seg_lo = tl.load(blocks_ptr + segs, mask=seg_ok, other=-1)
        seg_hi = tl.load(blocks_ptr + blocks_stride + segs, mask=seg_ok, other=-1)
        mine = seg_ok & (seg_lo >= first_row) & (seg_lo < hi) & (seg_hi > seg_lo)  # (padded blocks have no rows)
        seg_first = tl.load(starts_ptr + segs, mask=mine, other=0)
        seg_last = tl.load(starts_ptr + segs + 1, mask=mine, other=0)
        whole = (seg_hi - seg_lo == BLOCK_SIZE) & (seg_last - seg_first == BLOCK_SIZE)
        count += tl.sum(mine.to(tl.int32), axis=0)
        not_whole += tl.sum((mine & ~whole).to(tl.int32), axis=0)
        lead = tl.minimum(lead, tl.min(tl.where(mine, segs, 2147483647), axis=0))
    movable = (count > 0) & (hi - first_row == count * BLOCK_SIZE) & (not_whole == 0)
    # the leading block was decoded before this step (so stored by it): nothing left, nothing accepted now
    offs = tl.arange(0, BLOCK)
    in_block = offs < BLOCK_SIZE
    # (a scalar flag and'ed with a vector is int32 when interpreted: such masks compare offsets instead)
    lead_rows = offs < tl.where(movable, BLOCK_SIZE, 0)
    lead_first = tl.load(starts_ptr + lead, mask=movable, other=0)
    lead_source = tl.load(source_ptr + lead_first + offs, mask=lead_rows, other=-1)
    lead_took = tl.load(result_ptr + lead_first + offs, mask=lead_rows, other=0)
    lead_base = tl.load(blocks_ptr + 2 * blocks_stride + lead, mask=movable, other=-1)
    movable = movable & (tl.sum(((lead_source >= 0) | (lead_took != 0)).to(tl.int32), axis=0) == 0)
    movable = movable & (lead_base >= 0)
    newest = lead + count - 1
    newest_first = tl.load(starts_ptr + newest, mask=movable, other=0)
    newest_source = tl.load(source_ptr + newest_first + offs, mask=offs < tl.where(movable, BLOCK_SIZE, 0), other=-1)
    newest_left = tl.sum((newest_source >= 0).to(tl.int32), axis=0)
    start = tl.load(positions_ptr + hi - 1, mask=movable, other=0) + 1
    if HAS_ENDS:
        end = tl.load(ends_ptr + request).to(tl.int64)
    else:
        end = tl.full((), 2147483647, tl.int64)
    # past the answer's end no block joins: the running set drains, the window's last block a placeholder (a lone
    # block there was the answer's last: the request is finished)
    draining = start >= end
    movable = movable & ~(draining & (count == 1))
    movable = movable & ((count == 1) | draining | (BLOCK_SIZE - newest_left >= decoded_to_join))
    page_index = start // page_size
    movable = movable & (draining | (page_index < tables_width))  # past the longest context the tables hold
    page = tl.load(tables_ptr + request * tables_stride + page_index, mask=movable & ~draining, other=-1).to(tl.int64)
    if movable & (draining | (page >= 0)):
        rows = tl.arange(0, ROWS)
        in_request = rows < hi - lo
        # a shifted family's row before the blocks takes the stored block's last token
        last_token = tl.load(ids_ptr + first_row + BLOCK_SIZE - 1)
        tl.store(slots_ptr + lo + rows, tl.full((ROWS,), -1, tl.int64), mask=in_request)
        moved_positions = tl.load(positions_ptr + lo + rows, mask=in_request, other=0) + BLOCK_SIZE
        # a placeholder block (its first position at or past the end) keeps a position the rotary table holds
        in_blocks = in_request & (rows >= shift)
        block_first = lo + shift + ((rows - shift) // BLOCK_SIZE) * BLOCK_SIZE
        block_start = tl.load(positions_ptr + block_first, mask=in_blocks, other=0) + BLOCK_SIZE
        moved_positions = tl.where(in_blocks & (block_start >= end), end - 1, moved_positions)
        tl.store(positions_ptr + lo + rows, moved_positions, mask=in_request)
        tl.debug_barrier()
        if shift > 0:
            tl.store(ids_ptr + lo, last_token)
        decoded = lead >= 0  # the blocks moved so far are decoded (the stored one before them is)
        for i in range(0, count - 1):
            s = lead + i
            t = s + 1
            row_s = first_row + i * BLOCK_SIZE
            tokens = tl.load(ids_ptr + row_s + BLOCK_SIZE + offs, mask=in_block, other=0)
            tl.store(ids_ptr + row_s + offs, tokens, mask=in_block)
            t_first = tl.load(starts_ptr + t)
            s_first = tl.load(starts_ptr + s)
            moved = tl.load(source_ptr + t_first + offs, mask=in_block, other=-1)
            tl.store(source_ptr + s_first + offs, tl.where(moved >= 0, moved - BLOCK_SIZE, moved), mask=in_block)
            tl.store(force_ptr + s, tl.load(force_ptr + t))
            base = tl.load(blocks_ptr + 2 * blocks_stride + t)
            tl.store(blocks_ptr + 2 * blocks_stride + s, base)
            decoded = decoded & (tl.sum((moved >= 0).to(tl.int32), axis=0) == 0)
            tl.store(slots_ptr + row_s + offs, base + offs, mask=offs < tl.where(decoded & (base >= 0), BLOCK_SIZE, 0))
            tl.debug_barrier()
        newest_row = first_row + (count - 1) * BLOCK_SIZE
        tl.store(ids_ptr + newest_row + offs, tl.full((BLOCK,), mask_token_id, tl.int64), mask=in_block)
        # an answer's last block may end early: its rows past the end are inputs only
        sampled_rows = tl.where(start + offs < end, newest_row - shift + offs, -1)
        tl.store(source_ptr + newest_first + offs, sampled_rows, mask=in_block)
        forces = (BLOCK_SIZE - newest_left >= decoded_to_force) & ~draining
        tl.store(force_ptr + newest, forces.to(tl.int64))
        tl.store(blocks_ptr + 2 * blocks_stride + newest, tl.where(draining, -1, page * page_size + start % page_size))
        context = tl.load(context_lens_ptr + request)
        tl.store(context_lens_ptr + request, context + BLOCK_SIZE)


def triton_advance_inputs(
    input_ids: torch.Tensor,
    source_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    result: torch.Tensor,
    starts: torch.Tensor,
    blocks: torch.Tensor,
    shift: int,
    max_rows: int,
    opening: BlockOpening | None = None,
    gates: BlockGates | None = None,
) -> None:
    """In place, as the reference; ``max_rows`` bounds a block's sampled rows and input rows, and a request's rows."""
    num_blocks = starts.shape[0] - 1
    if num_blocks == 0:
        return
    block = max(16, triton.next_power_of_2(max_rows))
    use_pdl = pdl_enabled(input_ids.device, source_rows.shape[0])
    gating = (gates.force, gates.block_size, gates.decoded_to_force) if gates is not None else (starts, 0, 0)
    _advance_kernel[(num_blocks,)](
        input_ids, source_rows, slot_mapping, result, starts, blocks, result.stride(0), blocks.stride(0), shift,
        input_ids.shape[0], *gating,
        BLOCK=block, USE_PDL=use_pdl, GATES=gates is not None, num_warps=1, **launch_kwargs(use_pdl),
    )
    o = opening
    if o is None:
        return
    if gates is None:
        raise ValueError("a continuation that opens blocks moves their force flags on too: pass gates")
    _move_window_kernel[(o.cu_seqlens_q.shape[0] - 1,)](
        input_ids, source_rows, slot_mapping, result, starts, blocks, blocks.stride(0), num_blocks, gates.force,
        o.positions, o.cu_seqlens_q, o.context_lens, o.page_tables,
        o.answer_ends if o.answer_ends is not None else o.context_lens, o.page_tables.stride(0), o.page_tables.shape[1],
        shift, o.page_size, o.mask_token_id, gates.decoded_to_force, o.decoded_to_join,
        BLOCK_SIZE=o.block_size, BLOCK=max(16, triton.next_power_of_2(o.block_size)),
        ROWS=max(16, triton.next_power_of_2(max_rows)), SCANNED=_BLOCKS_SCANNED, HAS_ENDS=o.answer_ends is not None,
        num_warps=1,
    )
