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

`advance_inputs` makes exactly these changes to a replayed graph's device buffers at the end of its sampling
graph, so replaying the same graphs again *is* the next step. Rows decoded this step stay in the layout as rows
that are no candidates (source row ``-1``, confidence ``-inf``), so the sampled rows keep their order and the
acceptance picks what it would pick over the remaining rows alone.

When the host applies the result it checks that the continuation is what it would have launched itself
(`diffulex.engine.engine`); a stop token in the middle of a block, for example, changes which positions may be
decoded, and such a continuation is dropped and the right step launched instead.
"""

from __future__ import annotations

import torch

from diffulex.layers.dispatch import triton_available


def advance_inputs_reference(
    input_ids: torch.Tensor,
    source_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    result: torch.Tensor,
    starts: torch.Tensor,
    blocks: torch.Tensor,
    shift: int,
) -> None:
    """Turn a replayed step's inputs into the next step's, in place.

    ``result [2, N]`` holds the accepted flag and token of each sampled row; ``source_rows [N]`` the hidden-state
    row each sampled row reads (-1: not sampled), so its position's input row is ``source + shift`` (1 for
    families whose logits at p predict p + 1); a position past the step's last row (Fast-dLLM v2's commit reads
    the block after its rows from their last one) has no input row, and such a step is never continued. Block
    ``s`` owns sampled rows ``starts[s] .. starts[s + 1]`` and input rows ``blocks[0, s] .. blocks[1, s]`` (an
    empty range: nothing to store once it is decoded), whose cache slots start at ``blocks[2, s]`` (-1: no page
    yet).
    """
    accepted, tokens = result[0].tolist(), result[1].tolist()
    num_rows = input_ids.shape[0]
    for block in range(starts.shape[0] - 1):
        left = 0
        for row in range(int(starts[block]), int(starts[block + 1])):
            source = int(source_rows[row])
            if source < 0:
                continue
            if accepted[row]:
                if source + shift < num_rows:
                    input_ids[source + shift] = tokens[row]
                source_rows[row] = -1
            else:
                left += 1
        lo, hi, base = (int(v) for v in blocks[:, block])
        if left == 0 and base >= 0:
            slot_mapping[lo:hi] = torch.arange(base, base + hi - lo, dtype=slot_mapping.dtype)


def advance_inputs(
    input_ids: torch.Tensor,
    source_rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    result: torch.Tensor,
    starts: torch.Tensor,
    blocks: torch.Tensor,
    shift: int,
    max_rows: int,
) -> None:
    """`advance_inputs_reference` in one Triton launch on CUDA (graph-capturable: no host reads), the reference
    elsewhere. ``max_rows`` bounds a block's rows."""
    if input_ids.is_cuda and triton_available():
        from diffulex.kernels.step_advance import triton_advance_inputs

        triton_advance_inputs(input_ids, source_rows, slot_mapping, result, starts, blocks, shift, max_rows)
        return
    advance_inputs_reference(input_ids, source_rows, slot_mapping, result, starts, blocks, shift)
