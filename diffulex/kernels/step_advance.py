"""Triton version of `diffulex.engine.continuation.advance_inputs_reference`: one program per sampled block.

A block's sampled rows are contiguous (``starts[s] .. starts[s + 1]``), so the program that owns block ``s``
writes its accepted tokens into the next step's input rows, retires their sample rows, counts the rows still
to decode and, when none is left, turns on the K/V store of the block's input rows. Programs share nothing, so
the whole step advances in one launch of a few microseconds, captured at the end of the sampling graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs


@triton.jit(do_not_specialize=["num_rows"])  # one variant for every bucket's row count
def _advance_kernel(
    ids_ptr,  # [T] int64 input tokens of the step
    source_ptr,  # [N] int64 hidden-state row each sampled row reads, -1: not sampled
    slots_ptr,  # [T] int64 cache slot of each input row, -1: not stored
    result_ptr,  # [2, N] int64 accepted flag, then token, of each sampled row
    starts_ptr,  # [S + 1] int64 first sampled row of each block
    blocks_ptr,  # [3, >= S] int64 per block: its first input row, one past its last, the first row's slot
    result_stride,
    blocks_stride,
    shift,
    num_rows,  # input rows of the step: a token whose input row lies past them is not written
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
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
    n_store = tl.where((left == 0) & (base >= 0), row_hi - row_lo, 0)
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
) -> None:
    """In place, as the reference; ``max_rows`` bounds both a block's sampled rows and its input rows."""
    num_blocks = starts.shape[0] - 1
    if num_blocks > 0:
        block = max(16, triton.next_power_of_2(max_rows))
        use_pdl = pdl_enabled(input_ids.device, source_rows.shape[0])
        _advance_kernel[(num_blocks,)](
            input_ids, source_rows, slot_mapping, result, starts, blocks, result.stride(0), blocks.stride(0), shift,
            input_ids.shape[0],
            BLOCK=block, USE_PDL=use_pdl, num_warps=1, **launch_kwargs(use_pdl),
        )
