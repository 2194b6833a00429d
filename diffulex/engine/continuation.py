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

And once a step has stored a request's leading block, the next one decodes its running blocks one block further
on (`BlockOpening`): the same rows, each block's taking the next one's, the last ones the block that joins, all
masks and sampled, attending to one block more of cached keys, in pages the host lent in advance (`diffulex.
engine.kv_cache_manager.KVCacheManager.reserve_running_pages`). Without that, at large batches some request is
always at its storing step, and no step could be continued for anyone. An answer's last block may end before the
block does (its prompt length and ``max_tokens`` put the end anywhere): its rows past the request's answer end are
inputs only (masks, as the host's own step has them), never sampled; with requests arriving at their own times,
some request is always at that block too. Past that block no block joins, and each stored leading block leaves the
blocks after it to decode alone (the running set drains): the blocks move on all the same, the last rows a
placeholder block, masks that are never sampled nor stored, at the answer's last position (no other row attends to
them, and the rotary table holds it).

`advance_inputs` makes exactly these changes to a replayed graph's device buffers at the end of its sampling
graph, so replaying the same graphs again *is* the next step. Rows decoded this step stay in the layout as rows
that are no candidates (source row ``-1``, confidence ``-inf``), so the sampled rows keep their order and the
acceptance picks what it would pick over the remaining rows alone.

When the host applies the result it checks that the continuation is what it would have launched itself
(`diffulex.engine.engine`); a stop token in the middle of a block, for example, changes which positions may be
decoded, and such a continuation is dropped and the right step launched instead.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from diffulex.layers.dispatch import triton_available


class ContinuationRefusal(enum.StrEnum):
    """Why the engine launched a step itself rather than continue the one in flight on the device (counted in
    `diffulex.engine.engine_load.EngineLoad.refused_continuations`): each is a step whose host work the GPU waits
    for."""

    NOT_GRAPHED = "not_graphed"  # the step in flight was not replayed by graphs that continue (a prefill, eager)
    NO_PAGE = "no_page"  # a block the step in flight may store has no page: none was free to lend
    ADMISSION = "admission"  # a waiting request can be admitted: its prefill needs the host's step
    RUNNING_SET = "running_set"  # a running request is not in the step in flight (admitted, waiting for a chunk)
    REQUEST_CHANGED = "request_changed"  # a request of the step was rescheduled since its launch
    # a request's prompt rows ran in the step in flight with its blocks (a short prompt riding whole in a chunk graph,
    # a chunk of a long one): its next step computes other rows
    PREFILL_IN_STEP = "prefill_in_step"
    ROWS_CHANGE = "rows_change"  # a request's next step computes other rows (a block joins, a forward of another kind)
    HOST_OPENS_BLOCK = "host_opens_block"  # a request's next block can be opened by the host only (pages, layout)


# The answer end of a request that has none (a hand-built step, a padded request): every position may be sampled.
NO_ANSWER_END = 2**31 - 1


@dataclass(frozen=True)
class BlockOpening:
    """What a continuation reads and moves to decode a request's next block once it stored the one before: the
    step's device views (``positions [T]`` int64; ``cu_seqlens_q [R + 1]``, ``context_lens [R]`` and
    ``page_tables [R, P]`` int32) and the geometry; with several running blocks, the decoded positions of its
    newest block from which the next one joins the running set (``add_block_threshold`` as a count, as
    `diffulex.strategy.request.decoded_for_progress` counts it; a lone block's successor always joins); and each
    request's answer end (``answer_ends [R]`` int32, `diffulex.strategy.request.Request.generation_end`; None: no
    end): no position at or past it is sampled, and a block that would start there is a placeholder (the running
    set drains: its blocks move on, the last rows masks never sampled nor stored, at the answer's last position)."""

    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    page_tables: torch.Tensor
    page_size: int
    block_size: int
    mask_token_id: int
    decoded_to_join: int = 0
    answer_ends: torch.Tensor | None = None


@dataclass(frozen=True)
class BlockGates:
    """How a continuation moves the blocks of one request on together (``buffer_size > 1``): block ``s``'s gate
    (``blocks[3, s]``) is the block before it in its request where that one is sampled too (-1: the block before it
    is committed, or not sampled). Once its gate has ``decoded_to_force`` of its ``block_size`` positions decoded a
    block may force its best row (``force [S + 1]``, which the next acceptance reads), as the host's rule says
    (`diffulex.strategy.request.decoded_for_progress`); and a decoded block is stored only when every block along its
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

    With ``opening`` (and ``gates``), a request whose leading block this step stored moves on by one block
    (`move_window_reference`), where its rows are its running blocks, whole, and the block after them joins.
    """
    accepted, tokens = result[0].tolist(), result[1].tolist()
    num_rows = input_ids.shape[0]
    num_blocks = starts.shape[0] - 1
    left, took = [0] * num_blocks, [False] * num_blocks
    for block in range(num_blocks):
        for row in range(int(starts[block]), int(starts[block + 1])):
            source = int(source_rows[row])
            if source < 0:
                continue
            if accepted[row]:
                if source + shift < num_rows:
                    input_ids[source + shift] = tokens[row]
                source_rows[row] = -1
                took[block] = True
            else:
                left[block] += 1
    for block in range(num_blocks):
        lo, hi, base, gate = (int(v) for v in blocks[:, block])
        decoded = left[block] == 0
        if gates is not None:
            if gate >= 0 and gates.block_size - left[gate] >= gates.decoded_to_force:
                gates.force[block] = 1
            while decoded and gate >= 0:  # stored once every block before it is decoded
                decoded, gate = left[gate] == 0, int(blocks[3, gate])
        if decoded and base >= 0:
            slot_mapping[lo:hi] = torch.arange(base, base + hi - lo, dtype=slot_mapping.dtype)
    if opening is not None:
        if gates is None:
            raise ValueError("a continuation that opens blocks moves their force flags on too: pass gates")
        for request in range(opening.cu_seqlens_q.shape[0] - 1):
            move_window_reference(opening, gates, request, input_ids, source_rows, slot_mapping, starts, blocks,
                                  shift, left, took)  # fmt: skip


def move_window_reference(
    opening: BlockOpening,
    gates: BlockGates,
    request: int,
    input_ids: torch.Tensor,
    source_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    starts: torch.Tensor,
    blocks: torch.Tensor,
    shift: int,
    left: list[int],
    took: list[bool],
) -> bool:
    """Move ``request``'s running blocks on by one block, once this step stored the leading one: each block's
    rows take the block after it (its tokens, its sampled rows, its force flag, its slots), the last rows become
    the next block (masks at positions one block further on, sampled up to the request's answer end), its first
    slot looked up in the page
    table; one block more of the request's context is cached; a block that is decoded after blocks that are is
    stored by the next step. A shifted family's row before the blocks (the position the first is predicted from)
    moves on to the stored block's last token.

    ``left`` and ``took`` say of each block how many of its sampled rows are left to decode and whether it
    accepted one this step. False, and nothing changed, unless the request's rows are its blocks, whole
    (``block_size`` input and sampled rows each, plus the row before them if shifted), the leading one decoded
    before this step (so stored by it), the next block joins (a lone block's always does; else the newest's
    decoded positions reach ``decoded_to_join``), it starts before the answer end and its page is there. Past the
    answer's end no block joins and the running set drains: the blocks still move on, the last rows a placeholder
    block (masks never sampled nor stored, at the answer's last position, which no other row attends to)."""
    size = opening.block_size
    lo, hi = int(opening.cu_seqlens_q[request]), int(opening.cu_seqlens_q[request + 1])
    first_row = lo + shift
    segments = [  # (a padded block has no rows)
        s for s in range(starts.shape[0] - 1) if first_row <= int(blocks[0, s]) < hi and blocks[1, s] > blocks[0, s]
    ]
    count = len(segments)
    if count == 0 or hi - first_row != count * size:
        return False
    for i, s in enumerate(segments):
        whole = int(blocks[1, s]) - int(blocks[0, s]) == size and int(starts[s + 1]) - int(starts[s]) == size
        if not whole or int(blocks[0, s]) != first_row + i * size:
            return False
    lead, newest = segments[0], segments[-1]
    if left[lead] != 0 or took[lead] or int(blocks[2, lead]) < 0:  # not stored by this step
        return False
    start = int(opening.positions[hi - 1]) + 1
    end = int(opening.answer_ends[request]) if opening.answer_ends is not None else NO_ANSWER_END
    draining = start >= end  # no block joins past the answer: the window's last block is a placeholder
    if draining and count == 1:  # its only block was its answer's last: the request is finished
        return False
    if count > 1 and not draining and size - left[newest] < opening.decoded_to_join:
        return False
    page = -1
    if not draining:
        page_index = start // opening.page_size
        if page_index >= opening.page_tables.shape[1]:  # past the longest context the step's tables hold
            return False
        page = int(opening.page_tables[request, page_index])
        if page < 0:
            return False
    if shift:
        input_ids[lo] = input_ids[first_row + size - 1]
    for i in range(count - 1):
        s, t = segments[i], segments[i + 1]
        rows = slice(first_row + i * size, first_row + (i + 1) * size)
        input_ids[rows] = input_ids[first_row + (i + 1) * size : first_row + (i + 2) * size].clone()
        moved = source_rows[int(starts[t]) : int(starts[t + 1])]
        source_rows[int(starts[s]) : int(starts[s + 1])] = torch.where(moved >= 0, moved - size, moved)
        gates.force[s] = gates.force[t]
        blocks[2, s] = blocks[2, t]
    input_ids[hi - size : hi] = opening.mask_token_id
    opened_rows = torch.arange(hi - size - shift, hi - shift, dtype=source_rows.dtype)
    past_end = torch.arange(start, start + size) >= end  # inputs only: masks never sampled
    source_rows[int(starts[newest]) : int(starts[newest + 1])] = opened_rows.masked_fill(past_end, -1)
    gates.force[newest] = int(not draining and size - left[newest] >= gates.decoded_to_force)
    blocks[2, newest] = page * opening.page_size + start % opening.page_size if not draining else -1
    opening.positions[lo:hi] += size
    for i in range(count):  # a placeholder block (at or past the end) keeps a position the rotary table holds
        rows = slice(first_row + i * size, first_row + (i + 1) * size)
        if int(opening.positions[rows.start]) >= end:
            opening.positions[rows] = end - 1
    opening.context_lens[request] += size
    slot_mapping[lo:hi] = -1
    decoded = True
    for i in range(count - 1):  # the blocks after the stored one, decoded in order: stored by the next step
        decoded = decoded and left[segments[i + 1]] == 0
        base = int(blocks[2, segments[i]])
        if decoded and base >= 0:
            rows = first_row + i * size
            slot_mapping[rows : rows + size] = torch.arange(base, base + size, dtype=slot_mapping.dtype)
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
