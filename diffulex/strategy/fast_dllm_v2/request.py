"""A request decoded by Fast-dLLM v2: one block of ``B*K`` positions at a time, refined sub-block by sub-block.

Its block (``settings.block_size``, the attention span) holds ``K = settings.buffer_size`` sub-blocks of ``B``.
Each step is one of four forwards, chosen from the request's state alone (`FastDllmV2Request.forward_kind`), so
the scheduler, the runner and the step that applies the result all see the same one:

* ``COMMIT``: the block before is complete (or the prompt ends on a block boundary). The forward stores its K/V
  (and that of any other uncached committed block) and its last row predicts the open block's first token.
* ``INIT``: the current sub-block starts with a mask, the block has no kept K/V yet, or the block cache is off.
  The forward computes the whole block and samples the sub-block's masks; with the block cache it also stores the
  block's K/V in the block's pages (the kept K/V: not final, never shared).
* ``REFINE`` (block cache on): only the current sub-block's rows are computed; they attend to the committed
  prefix and to the rest of the block through the kept K/V, read from the cache (`keys_end`), and store nothing.
* ``REBUILD``: a preempted request lost its kept K/V; the forward computes it again from the block's tokens as
  they were when it was kept (`input_token_ids`) and samples nothing, so the next ``REFINE`` sees what it would
  have seen without the preemption.

A refinement that leaves masks in its sub-block is followed by a refinement of the same rows, so the engine may
continue it on the device (`next_step_has_same_rows`, `diffulex.engine.continuation`); it does so only when the
sub-block is unlikely to complete in the step in flight.

The sampler fills the current sub-block's masks whose greedy probability exceeds the threshold, and always the
most probable one (`diffulex.strategy.fast_dllm_v2.sampler`). Logits are shifted: position ``p`` is read from row
``p - 1``, which is always inside the computed rows. docs/strategies.md states the algorithm and its oracle.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from diffulex.strategy.block import Block, BlockStatus
from diffulex.strategy.request import CompletionReason, Request, SampleTarget

# A refinement is continued on the device only if completing its sub-block would take at least this many times
# the tokens the request's last sampling forward accepted: a wrong guess costs a whole forward on the GPU, a missed
# one only the host's gap between two steps (`FastDllmV2Request.next_step_has_same_rows`).
CONTINUE_ACCEPTANCE_FACTOR = 2
# ... and never on the sub-block's last mask, which the step in flight decodes for certain.
MIN_MASKS_TO_CONTINUE = 2


class ForwardKind(enum.Enum):
    COMMIT = "commit"
    INIT = "init"
    REFINE = "refine"
    REBUILD = "rebuild"


@dataclass(frozen=True)
class NextForward:
    """What a request's next forward is, from its state (`FastDllmV2Request.next_forward`)."""

    kind: ForwardKind
    block: Block | None  # the open block
    sub_start: int  # start of its current sub-block (``block.end``: none left); -1 without an open block


@dataclass
class FastDllmV2Request(Request):
    supports_prefill_chunks = False  # it chooses its own query range and stored blocks
    # The open block's tokens when its K/V was last computed over the whole block (None: not computed yet, or
    # the block cache is off); `kept_in_cache` says whether that K/V is in the block's pages (not after a
    # preemption, until a REBUILD forward puts it back).
    kept_tokens: list[int] | None = field(init=False, default=None)
    kept_in_cache: bool = field(init=False, default=False)
    last_accepted: int = field(init=False, default=0)  # tokens the last forward that sampled accepted
    _next: NextForward | None = field(init=False, default=None, repr=False, compare=False)  # `next_forward`

    @property
    def sub_block_size(self) -> int:
        return self.settings.block_size // self.settings.buffer_size

    @property
    def uses_block_cache(self) -> bool:
        return self.settings.options.fdv2_use_block_cache

    @property
    def open_block(self) -> Block | None:
        """The block being decoded (at most one), or None."""
        return next((b for b in self.running if b.status is BlockStatus.ACTIVE), None)

    # ----- state -----------------------------------------------------------------------------------------

    def remaining(self, block: Block) -> int:
        """Masks of ``block`` before the generation end: a stop token does not end its block early (the positions
        after it in its sub-block are still decoded, and they take part in which mask is the most probable)."""
        lo, hi = max(block.start, self.prompt_len), min(block.end, self.generation_end)
        return self.token_ids[lo:hi].count(self.settings.mask_token_id) if lo < hi else 0

    def _decodable(self, sub_start: int) -> range:
        """The positions of the sub-block starting at ``sub_start`` that may hold a mask: after the prompt and
        before the generation end."""
        return range(max(sub_start, self.prompt_len), min(sub_start + self.sub_block_size, self.generation_end))

    def sub_block_masks(self, sub_start: int) -> list[int]:
        """The masks of the sub-block starting at ``sub_start``, before the generation end."""
        mask = self.settings.mask_token_id
        return [p for p in self._decodable(sub_start) if self.token_ids[p] == mask]

    def current_sub_block(self, block: Block) -> int:
        """Start of the first sub-block of ``block`` with a mask left (``block.end`` if none)."""
        mask = self.settings.mask_token_id
        for sub_start in range(block.start, block.end, self.sub_block_size):
            span = self._decodable(sub_start)  # a slice test: a step asks this several times
            if mask in self.token_ids[span.start : span.stop]:
                return sub_start
        return block.end

    def forward_kind(self) -> ForwardKind:
        """The forward this request's next step runs (the module docstring says when each one does)."""
        return self.next_forward().kind

    def next_forward(self) -> NextForward:
        """The next forward's kind, open block and current sub-block, worked out once per state: the scheduler,
        the runner and the engine each ask several times a step, and every answer scanned the block. The methods
        that change what it reads (the tokens, the open block, the kept K/V) forget it (`_state_changed`)."""
        if self._next is None:
            self._next = self._plan_next_forward()
        return self._next

    def _plan_next_forward(self) -> NextForward:
        block = self.open_block
        if block is None:
            return NextForward(ForwardKind.COMMIT, None, -1)
        mask = self.settings.mask_token_id
        sub_start = self.current_sub_block(block)
        if self.token_ids[block.start] == mask:
            return NextForward(ForwardKind.COMMIT, block, sub_start)
        if sub_start == block.end:  # nothing left to decode: the request has finished
            return NextForward(ForwardKind.INIT, block, sub_start)
        if self.kept_tokens is None or self.token_ids[sub_start] == mask:
            return NextForward(ForwardKind.INIT, block, sub_start)
        return NextForward(ForwardKind.REFINE if self.kept_in_cache else ForwardKind.REBUILD, block, sub_start)

    def _state_changed(self) -> None:
        self._next = None

    # ----- the forward -----------------------------------------------------------------------------------

    def maybe_activate_block(self) -> bool:
        """Open the next block once the one before is complete (the step that commits it samples the new block's
        first position), unless the request has reached its end or a stop token."""
        if self.open_block is not None or self.stop_pos is not None or len(self.token_ids) >= self.generation_end:
            return False
        self._open_block()
        self.kept_tokens = None
        self.kept_in_cache = False
        self._state_changed()
        return True

    @property
    def stored_len(self) -> int:
        """With the block cache, the open block's pages hold its kept K/V (from its first INIT on)."""
        block = self.open_block
        if self.uses_block_cache and block is not None and self.token_ids[block.start] != self.settings.mask_token_id:
            return block.end
        return self.committed_len

    @property
    def max_stored_len(self) -> int:
        """With the block cache, up to the end of the block that holds the generation end."""
        if not self.uses_block_cache:
            return self.generation_end
        size = self.settings.block_size
        return -(-self.generation_end // size) * size

    def query_range(self) -> tuple[int, int]:
        plan = self.next_forward()
        block, kind = plan.block, plan.kind
        start = self.num_cached_tokens
        if kind is ForwardKind.COMMIT:
            end = self.committed_len if block is None else block.start
            return min(start, end - 1), end  # the last committed row predicts the open block's first position
        if kind is ForwardKind.REFINE:
            return plan.sub_start, plan.sub_start + self.sub_block_size
        return start, block.end

    def keys_end(self) -> int | None:
        plan = self.next_forward()
        return plan.block.end if plan.kind is ForwardKind.REFINE else None

    def input_token_ids(self, start: int, end: int) -> list[int]:
        plan = self.next_forward()
        if plan.kind is not ForwardKind.REBUILD:
            return super().input_token_ids(start, end)
        block = plan.block
        return self.token_ids[start : block.start] + self.kept_tokens[: end - block.start]

    def stores_kv(self, block: Block) -> bool:
        if block.status is BlockStatus.TO_CACHE:
            return True
        plan = self.next_forward()
        keeps = plan.kind is ForwardKind.REBUILD or (plan.kind is ForwardKind.INIT and self.uses_block_cache)
        return keeps and block is plan.block

    def sample_targets(self) -> list[SampleTarget]:
        plan = self.next_forward()
        block, kind = plan.block, plan.kind
        if block is None or kind is ForwardKind.REBUILD:
            return []
        if kind is ForwardKind.COMMIT:
            return [SampleTarget(block, [block.start], True)]
        sub_start = plan.sub_start
        return [SampleTarget(block, self.sub_block_masks(sub_start), True)] if sub_start < block.end else []

    def next_step_has_same_rows(self) -> bool:
        """Whether the refinement about to run is followed by a refinement of the same sub-block, judged before
        its result: it is when the refinement leaves a mask of the sub-block. That is unknown here, so this
        says yes only when the sub-block has at least `MIN_MASKS_TO_CONTINUE` masks and at least
        `CONTINUE_ACCEPTANCE_FACTOR` times the tokens the last forward accepted: a step accepting one token per
        forward is continued on every refinement but its sub-block's last, one accepting many more rarely. A
        wrong yes is caught once the result is applied (the host's next step computes other rows) and costs the
        continued forward; the continuation stores nothing (`stores_when_decoded`)."""
        plan = self.next_forward()
        if plan.kind is not ForwardKind.REFINE:
            return False
        masks = len(self.sub_block_masks(plan.sub_start))
        return masks >= max(MIN_MASKS_TO_CONTINUE, CONTINUE_ACCEPTANCE_FACTOR * self.last_accepted)

    def stores_when_decoded(self, block: Block) -> bool:
        """Never: a refinement stores nothing, and once its sub-block is decoded the next forward is another one
        (a whole block, or the commit), which a continuation is not."""
        return False

    # ----- after the forward -----------------------------------------------------------------------------

    def apply_tokens(self, writes: list[tuple[int, int]]) -> int:
        """Remember what the forward just run kept in the cache, then write its tokens."""
        plan = self.next_forward()  # the state is still the one the forward was built from
        self._state_changed()
        if plan.kind is ForwardKind.INIT and self.uses_block_cache:
            block = plan.block
            self.kept_tokens = self.token_ids[block.start : block.end]
            self.kept_in_cache = True
        elif plan.kind is ForwardKind.REBUILD:
            self.kept_in_cache = True
            if self.sampling_params.max_nfe is None:  # the automatic cap counts decoding forwards
                self.max_nfe += 1
            return super().apply_tokens(writes)
        self.last_accepted = super().apply_tokens(writes)
        return self.last_accepted

    def retire_and_commit(self) -> None:
        super().retire_and_commit()
        self._state_changed()  # a decoded block is no longer the open one

    def check_completion(self) -> CompletionReason | None:
        """A decoded stop token ends the request once every position before it is decoded and its own sub-block
        is complete."""
        stop = self.stop_pos
        if stop is not None and self.frontier >= stop:
            if not self.sub_block_masks(stop - stop % self.sub_block_size):
                return CompletionReason.EOS
            return CompletionReason.MAX_NFE if self.nfe >= self.max_nfe else None
        return super().check_completion()

    def forget_cache(self) -> None:
        super().forget_cache()
        self.kept_in_cache = False
        self._state_changed()
