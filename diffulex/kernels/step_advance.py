"""Triton version of `diffulex.engine.continuation.advance_inputs_reference`: one program per sampled block.

A block's sampled rows are contiguous (``starts[s] .. starts[s + 1]``), so the program that owns block ``s``
writes its accepted tokens into the next step's input rows, retires their sample rows, counts the rows still
to decode and, when none is left, turns on the K/V store of the block's input rows; with ``OPEN`` a block this step
stored becomes its request's next block (`diffulex.engine.continuation.open_next_block_reference`); with ``GATES``
a block also counts the rows left in the blocks before it (`diffulex.engine.continuation.BlockGates`): whether it
may force next step, and whether it is stored. Those counts read rows other programs retire, but a row is retired
only where it was accepted, and an accepted row counts as decoded either way, so the order cannot change them.
The whole step advances in one launch of a few microseconds, captured at the end of the sampling graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

if TYPE_CHECKING:
    from diffulex.engine.continuation import BlockGates, BlockOpening

# Requests a block's program searches for its own (`BlockOpening.cu_seqlens_q`): above the most a graph serves
# (`diffulex.engine.cuda_graph.MAX_GRAPH_REQUESTS`), one compiled variant for every bucket.
MAX_SEARCHED_REQUESTS = 1024


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
    positions_ptr,  # [T] int64 (OPEN only, as the four below)
    cu_seqlens_ptr,  # [R + 1] int32
    context_lens_ptr,  # [R] int32
    tables_ptr,  # [R, P] int32
    tables_stride,
    tables_width,
    num_requests,
    page_size,
    mask_token_id,
    force_ptr,  # [S + 1] int64 whether each block may force (GATES only, as the two below)
    gate_block_size,
    decoded_to_force,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    OPEN: tl.constexpr,  # open the next block of a block this step stored
    GATES: tl.constexpr,  # move forcing and stores on along the blocks' gates
    BLOCK_SIZE: tl.constexpr,  # a whole block's rows (OPEN)
    REQUESTS: tl.constexpr,  # MAX_SEARCHED_REQUESTS (OPEN)
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
    restore = decoded & (base >= 0)
    if OPEN:
        stored_now = tl.load(slots_ptr + row_lo, mask=row_hi > row_lo, other=-1) >= 0
        whole = (row_hi - row_lo == BLOCK_SIZE) & (last - first == BLOCK_SIZE)
        can_open = decoded & stored_now & whole
        r_offs = tl.arange(0, REQUESTS)
        ends = tl.load(cu_seqlens_ptr + 1 + r_offs, mask=r_offs < num_requests, other=2147483647)
        request = tl.sum((ends <= row_lo).to(tl.int32), axis=0)
        start = tl.load(positions_ptr + row_lo, mask=can_open, other=0) + BLOCK_SIZE
        page_index = start // page_size
        can_open = can_open & (page_index < tables_width)  # past the longest context the tables hold
        page = tl.load(tables_ptr + request * tables_stride + page_index, mask=can_open, other=-1)
        opened = can_open & (page >= 0)
        rows = offs < tl.where(opened, BLOCK_SIZE, 0)  # (a scalar flag and'ed with a vector: int32 when interpreted)
        # a shifted family's row before the block moves on to the stored block's last token; stored before the
        # block's rows are masked (those stores issue after this one, which waits for the token's load)
        before = opened & (shift > 0)
        last_token = tl.load(ids_ptr + row_hi - 1, mask=before, other=0)
        tl.store(ids_ptr + row_lo - shift, last_token, mask=before)
        position_before = tl.load(positions_ptr + row_lo - shift, mask=before, other=0)
        tl.store(positions_ptr + row_lo - shift, position_before + BLOCK_SIZE, mask=before)
        tl.store(slots_ptr + row_lo - shift, row_lo * 0 - 1, mask=before)
        tl.store(ids_ptr + row_lo + offs, tl.full((BLOCK,), mask_token_id, tl.int64), mask=rows)
        moved = tl.load(positions_ptr + row_lo + offs, mask=rows, other=0) + BLOCK_SIZE
        tl.store(positions_ptr + row_lo + offs, moved, mask=rows)
        tl.store(slots_ptr + row_lo + offs, tl.full((BLOCK,), -1, tl.int64), mask=rows)
        tl.store(source_ptr + first + offs, row_lo + offs - shift, mask=rows)
        context = tl.load(context_lens_ptr + request, mask=opened, other=0)
        tl.store(context_lens_ptr + request, context + BLOCK_SIZE, mask=opened)
        new_base = page.to(tl.int64) * page_size + start % page_size
        tl.store(blocks_ptr + 2 * blocks_stride + seg, new_base, mask=opened)
        restore = restore & (opened == 0)
    n_store = tl.where(restore, row_hi - row_lo, 0)
    store = offs < n_store
    tl.store(slots_ptr + row_lo + offs, base + offs, mask=store)


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
    """In place, as the reference; ``max_rows`` bounds both a block's sampled rows and its input rows."""
    num_blocks = starts.shape[0] - 1
    if num_blocks == 0:
        return
    block = max(16, triton.next_power_of_2(max_rows))
    use_pdl = pdl_enabled(input_ids.device, source_rows.shape[0])
    o = opening
    if o is not None and o.cu_seqlens_q.shape[0] - 1 > MAX_SEARCHED_REQUESTS:
        raise ValueError("blocks are opened on the device only for graph-sized batches")
    if o is not None:
        block = max(block, triton.next_power_of_2(o.block_size))
        layout = (o.positions, o.cu_seqlens_q, o.context_lens, o.page_tables, o.page_tables.stride(0),
                  o.page_tables.shape[1], o.cu_seqlens_q.shape[0] - 1, o.page_size, o.mask_token_id)  # fmt: skip
    else:
        layout = (input_ids, starts, starts, starts, 0, 0, 0, 1, 0)  # never read
    gating = (gates.force, gates.block_size, gates.decoded_to_force) if gates is not None else (starts, 0, 0)
    _advance_kernel[(num_blocks,)](
        input_ids, source_rows, slot_mapping, result, starts, blocks, result.stride(0), blocks.stride(0), shift,
        input_ids.shape[0], *layout, *gating,
        BLOCK=block, USE_PDL=use_pdl, OPEN=o is not None, GATES=gates is not None,
        BLOCK_SIZE=o.block_size if o is not None else 1, REQUESTS=MAX_SEARCHED_REQUESTS if o is not None else 1,
        num_warps=1, **launch_kwargs(use_pdl),
    )
