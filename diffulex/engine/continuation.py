"""Continuation steps: the next decode step launched before the host has seen this one's result.

Without them, at batch 1 the GPU idles between steps while the host reads a step's result, applies it, schedules and
stages the next step and launches it (about 0.1 ms of a 1.8 ms step on an H100 host). With ``async_scheduling``
the engine queues the next step first whenever its rows are already known: a request whose running set is a
single active block right after its cache (``buffer_size=1``) computes the same rows next step whatever this
step accepts (`diffulex.strategy.request.Request.next_step_has_same_rows`); a Fast-dLLM v2 refinement does so
unless it completes its sub-block, which its request judges unlikely before it says yes. Only two things differ,
and the device can derive both from the step's own result:

* the input tokens: the accepted tokens replace their masks;
* whether the block is stored: once none of its positions is left to decode, the next forward writes its K/V
  (the block became ``TO_CACHE``), and otherwise stores nothing; a request whose next forward would be another
  one (`Request.stores_when_decoded`) gives its block no rows to store.

With several blocks running (``buffer_size > 1``) the rows stay the same while the running set is full and stores
nothing yet; two more things then move with the result, and the device derives them too: a block may force its
best row once the block before it is decoded far enough (``semi_complete_threshold``: `BlockGates`), and a decoded
block is stored only after every block before it is.

And once a step has stored a request's block, the next one decodes the block after it (`BlockOpening`): the same
rows, one block further on, all masks and sampled, attending to one block more of cached keys, whose page the
host lent in advance (`diffulex.engine.kv_cache_manager.KVCacheManager.reserve_running_pages`). Without that, at
large batches some request is always at its storing step, and no step could be continued for anyone.

`advance_inputs` makes exactly these changes to a replayed graph's device buffers at the end of its sampling
graph, so replaying the same graphs again *is* the next step. Rows decoded this step stay in the layout as rows
that are no candidates (source row ``-1``, confidence ``-inf``), so the sampled rows keep their order and the
acceptance picks what it would pick over the remaining rows alone.

When the host applies the result it checks that the continuation is what it would have launched itself
(`diffulex.engine.engine`); a stop token in the middle of a block, for example, changes which positions may be
decoded, and such a continuation is dropped and the right step launched instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffulex.layers.dispatch import triton_available


@dataclass(frozen=True)
class BlockOpening:
    """What a continuation reads and moves to decode a request's next block once it stored the one before: the
    step's device views (``positions [T]`` int64; ``cu_seqlens_q [R + 1]``, ``context_lens [R]`` and
    ``page_tables [R, P]`` int32) and the geometry."""

    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    page_tables: torch.Tensor
    page_size: int
    block_size: int
    mask_token_id: int


@dataclass(frozen=True)
class BlockGates:
    """How a continuation moves the blocks of one request on together (``buffer_size > 1``): block ``s``'s gate
    (``blocks[3, s]``) is the block before it in its request where that one is sampled too (-1: the block before it
    is committed, or not sampled). Once its gate has ``decoded_to_force`` of its ``block_size`` positions decoded a
    block may force its best row (``force [S + 1]``, which the next acceptance reads), as the host's rule says
    (`diffulex.strategy.request.decoded_to_force`); and a decoded block is stored only when every block along its
    gates is decoded too (a block's K/V are final once the blocks before it are)."""

    force: torch.Tensor
    block_size: int
    decoded_to_force: int


def advance_inputs_reference(
    input_ids: torch.Tensor,
    source_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    result: torch.Tensor,
    starts: torch.Tensor,
    blocks: torch.Tensor,
    shift: int,
    opening: BlockOpening | None = None,
    gates: BlockGates | None = None,
) -> None:
    """Turn a replayed step's inputs into the next step's, in place.

    ``result [2, N]`` holds the accepted flag and token of each sampled row; ``source_rows [N]`` the hidden-state
    row each sampled row reads (-1: not sampled), so its position's input row is ``source + shift`` (1 for
    families whose logits at p predict p + 1); a position past the step's last row (Fast-dLLM v2's commit reads
    the block after its rows from their last one) has no input row, and such a step is never continued. Block
    ``s`` owns sampled rows ``starts[s] .. starts[s + 1]`` and input rows ``blocks[0, s] .. blocks[1, s]`` (an
    empty range: nothing to store once it is decoded), whose cache slots start at ``blocks[2, s]`` (-1: no page
    yet); ``blocks[3, s]`` is its gate (`BlockGates`; -1: none), which only ``gates`` reads.

    With ``opening``, a block that this step stored (its first row's slot set) and whose rows are all decoded
    becomes the request's next block in place (`open_next_block_reference`), where it is a whole block of sampled
    rows whose next block has its page; elsewhere it is stored again (an idempotent write).
    """
    accepted, tokens = result[0].tolist(), result[1].tolist()
    num_rows = input_ids.shape[0]
    num_blocks = starts.shape[0] - 1
    left = [0] * num_blocks
    for block in range(num_blocks):
        for row in range(int(starts[block]), int(starts[block + 1])):
            source = int(source_rows[row])
            if source < 0:
                continue
            if accepted[row]:
                if source + shift < num_rows:
                    input_ids[source + shift] = tokens[row]
                source_rows[row] = -1
            else:
                left[block] += 1
    for block in range(num_blocks):
        lo, hi, base, gate = (int(v) for v in blocks[:, block])
        first, last = int(starts[block]), int(starts[block + 1])
        decoded = left[block] == 0
        if gates is not None:
            if gate >= 0 and gates.block_size - left[gate] >= gates.decoded_to_force:
                gates.force[block] = 1
            while decoded and gate >= 0:  # stored once every block before it is decoded
                decoded, gate = left[gate] == 0, int(blocks[3, gate])
        stored_now = hi > lo and int(slot_mapping[lo]) >= 0
        if opening is not None and decoded and stored_now:
            if open_next_block_reference(opening, input_ids, source_rows, slot_mapping, blocks, block, first, last,
                                         shift):  # fmt: skip
                continue
        if decoded and base >= 0:
            slot_mapping[lo:hi] = torch.arange(base, base + hi - lo, dtype=slot_mapping.dtype)


def open_next_block_reference(
    opening: BlockOpening,
    input_ids: torch.Tensor,
    source_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    blocks: torch.Tensor,
    block: int,
    first: int,
    last: int,
    shift: int = 0,
) -> bool:
    """Turn block ``block``'s input rows (just stored) into its request's next block: masks at positions one block
    further on, not stored, each sampled from the row ``shift`` before it (sampled rows ``first .. last``), one
    block more of the request's context cached, and the new block's first slot looked up in its page table. A
    shifted family's request also has the row before its block (the position its first row is predicted from): it
    moves on too, to the stored block's last token. False, and nothing changed, unless the block is whole
    (``block_size`` input and sampled rows) and the next block's page is there."""
    size = opening.block_size
    lo, hi = int(blocks[0, block]), int(blocks[1, block])
    if hi - lo != size or last - first != size:
        return False
    request = int(torch.searchsorted(opening.cu_seqlens_q[1:], torch.tensor(lo, dtype=opening.cu_seqlens_q.dtype),
                                     right=True))  # fmt: skip
    start = int(opening.positions[lo]) + size
    page_index = start // opening.page_size
    if page_index >= opening.page_tables.shape[1]:  # past the longest context the step's tables hold
        return False
    page = int(opening.page_tables[request, page_index])
    if page < 0:
        return False
    if shift:
        input_ids[lo - shift] = input_ids[hi - 1]
    input_ids[lo:hi] = opening.mask_token_id
    opening.positions[lo - shift : hi] += size
    slot_mapping[lo - shift : hi] = -1
    source_rows[first:last] = torch.arange(lo - shift, hi - shift, dtype=source_rows.dtype)
    opening.context_lens[request] += size
    blocks[2, block] = page * opening.page_size + start % opening.page_size
    return True


def advance_inputs(
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
    """`advance_inputs_reference` in one Triton launch on CUDA (graph-capturable: no host reads), the reference
    elsewhere. ``max_rows`` bounds a block's rows."""
    if input_ids.is_cuda and triton_available():
        from diffulex.kernels.step_advance import triton_advance_inputs

        triton_advance_inputs(input_ids, source_rows, slot_mapping, result, starts, blocks, shift, max_rows, opening,
                              gates)  # fmt: skip
        return
    advance_inputs_reference(input_ids, source_rows, slot_mapping, result, starts, blocks, shift, opening, gates)
