"""A request decoded in edit mode (``sampling_mode="edit"``, LLaDA2.1): a block's decoded tokens may still be
rewritten while it is active, and it commits only when the sampler stops changing it.

Per step and active block the sampler (`diffulex.strategy.edit.sampler.EditSampler`) proposes a token for every
generated position: masks are filled as in the naive mode (those above the threshold, else the most confident one), and
already decoded positions whose proposal differs take it when confident enough (token-to-token edits). A block
is finished, and commits like any complete block, when a step writes nothing into it, when it has spent
``max_post_edit_steps`` steps without a mask, or when it times out (``block_size + max_post_edit_steps`` steps,
after which the sampler fills every mask left). This is LLaDA2.1's edit rule; where this version departs from
the original implementation is listed in docs/strategies.md ("Edit mode").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diffulex.layers.token_merge import SoftInput
from diffulex.strategy.block import Block, BlockStatus
from diffulex.strategy.edit.acceptance import EditPhase, block_state
from diffulex.strategy.request import CompletionReason, Request, SampleTarget


@dataclass
class EditProgress:
    """What edit mode remembers of one active block."""

    steps: int = 0  # steps in which the block was sampled
    steps_without_masks: int = 0  # of those, steps that began with no mask left in it
    finished: bool = False  # the block's tokens are final
    stable_share: float = 0.0  # share of its decoded tokens the last step proposed again unchanged


@dataclass(frozen=True)
class BlockVerdict:
    """The sampler's word on one block after a step."""

    finished: bool
    stable_share: float  # share of the block's decoded tokens whose proposal equalled them (1.0 if none)


@dataclass
class EditRequest(Request):
    supports_prefill_chunks = False  # its steps sample and re-edit by rules of their own
    edits: dict[int, EditProgress] = field(init=False, default_factory=dict)  # block index -> progress
    # the blocks the sampler sampled in the step being applied, each with its verdict: finished or not (a step
    # that only computes prompt rows samples none)
    sampled_blocks: dict[int, BlockVerdict] = field(init=False, default_factory=dict)
    # DMax's token merge: candidates of decoded positions, set by the sampler for the next forward
    soft: dict[int, SoftInput] = field(init=False, default_factory=dict)
    next_soft: dict[int, SoftInput] | None = field(init=False, default=None)

    @property
    def settled_answer_end(self) -> int:
        """Only committed blocks are final: an active block's decoded tokens may still be edited."""
        return min(self.answer_end, max(self.prompt_len, self.committed_len))

    def _max_nfe(self) -> int:
        """The request's own ``max_nfe`` where it set one (a cap the user asked for); otherwise the naive bound plus
        every block's post-edit steps."""
        if self.sampling_params.max_nfe is not None:
            return self.sampling_params.max_nfe
        blocks = math.ceil(self.sampling_params.max_tokens / self.settings.block_size)
        return super()._max_nfe() + blocks * (self.settings.options.max_post_edit_steps + 1)

    def progress_of(self, block: Block) -> EditProgress:
        return self.edits.setdefault(block.index, EditProgress())

    def times_out(self, block: Block) -> bool:
        """Whether this step is the block's last chance: it has had its steps and post-edit steps."""
        return self.progress_of(block).steps + 1 >= block.size + self.settings.options.max_post_edit_steps

    def block_phase(self, block: Block, current: list[int]) -> EditPhase:
        """What the block may do this step, from its state before it (``current``: its sampled positions' tokens):
        its last step (time-out) comes first; a block without masks that has used its post-edit steps writes
        nothing."""
        if self.times_out(block):
            return EditPhase.TIMED_OUT
        used = self.progress_of(block).steps_without_masks + 1 > self.settings.options.max_post_edit_steps
        if used and self.settings.mask_token_id not in current:
            return EditPhase.CLOSED
        return EditPhase.EDITING

    def block_state(self, block: Block, phase: EditPhase) -> int:
        """The block's staged entry for the device rule (`diffulex.strategy.edit.acceptance.block_state`): its phase
        this step (`block_phase`) and what a continued step needs to give it the next one."""
        progress, max_post = self.progress_of(block), self.settings.options.max_post_edit_steps
        steps_left = block.size + max_post - progress.steps
        post_edit_left = max(0, max_post - progress.steps_without_masks)
        return block_state(phase, steps_left, post_edit_left)

    def next_step_has_same_rows(self) -> bool:
        """As a request's with one running block (``buffer_size=1``: the device rule moves one block's phase on),
        and the block's sampled positions are its whole decodable range (no stop token cuts them short): the
        device then counts the block's masks, which move its phase on, where the host counts them
        (`diffulex.strategy.edit.acceptance.advance_edit_inputs`, `EditProgress.steps_without_masks`)."""
        if self.settings.buffer_size != 1 or not super().next_step_has_same_rows():
            return False
        block = self.running[0]
        sampled = [p for target in self.sample_targets() for p in target.positions]
        return sampled == list(range(max(block.start, self.prompt_len), min(block.end, self.decode_limit)))

    def continued_rows(self, positions: list[int]) -> tuple[list[int], int]:
        """A continued edit step samples every position its predecessor sampled and stores nothing
        (`diffulex.strategy.edit.acceptance.advance_edit_inputs`)."""
        return list(positions), 0

    def maybe_activate_block(self) -> bool:
        """As in the naive mode, and the newest block's tokens must also be stable enough
        (``token_stability_threshold``: the share of its decoded tokens the last step left unchanged)."""
        if self.running and self.progress_of(self.running[-1]).stable_share < self.settings.token_stability_threshold:
            return False
        return super().maybe_activate_block()

    def sample_targets(self) -> list[SampleTarget]:
        """Every generated position of each unfinished active block, masks and decoded tokens alike, up to and
        including the first stop token (which an edit may remove)."""
        targets = []
        limit = self.generation_end if self.stop_pos is None else min(self.generation_end, self.stop_pos + 1)
        for block in self.running:
            if block.status is not BlockStatus.ACTIVE or self.progress_of(block).finished:
                continue
            lo, hi = max(block.start, self.prompt_len), min(block.end, limit)
            if lo < hi:
                targets.append(SampleTarget(block, list(range(lo, hi)), force_allowed=True))
        return targets

    def apply_tokens(self, writes: list[tuple[int, int]]) -> int:
        """Write the step's tokens, edits included; returns how many masks were filled. Each block sampled in
        this step counts the step, and takes the sampler's verdict on whether it is finished."""
        verdicts, self.sampled_blocks = self.sampled_blocks, {}
        mask = self.settings.mask_token_id
        for index in verdicts:
            progress = self.progress_of(self.blocks[index])
            progress.steps += 1
            progress.steps_without_masks += self.remaining(self.blocks[index]) == 0
        filled = 0
        for pos, token in writes:
            filled += self.token_ids[pos] == mask
            self.token_ids[pos] = token
        for index, verdict in verdicts.items():
            progress = self.progress_of(self.blocks[index])
            progress.finished, progress.stable_share = verdict.finished, verdict.stable_share
        if self.next_soft is not None:
            self.soft, self.next_soft = self.next_soft, None
        self._find_stop()
        while self.frontier < len(self.token_ids) and self.token_ids[self.frontier] != mask:
            self.frontier += 1
        self.num_new_tokens_total += filled
        return filled

    def _find_stop(self) -> None:
        """The first stop token among the generated positions: an edit may write or remove one. Committed
        tokens never change, so one found there stays the first, and the search starts after them."""
        if self.sampling_params.ignore_eos:
            return
        committed = max(self.prompt_len, self.committed_len)
        if self.stop_pos is not None and self.stop_pos < committed:
            return
        self.stop_pos = None
        stops = self.settings.stop_token_ids
        for pos in range(committed, len(self.token_ids)):
            if self.token_ids[pos] in stops:
                self.stop_pos = pos
                return

    def soft_inputs(self) -> dict[int, SoftInput]:
        """The candidates of positions in blocks still being edited: a finished block's K/V is computed from its
        final tokens (the original uses the last step's soft inputs for them; docs/strategies.md)."""
        size = self.settings.block_size

        def editing(block: Block) -> bool:
            return block.status is BlockStatus.ACTIVE and not self.progress_of(block).finished

        return {pos: soft for pos, soft in self.soft.items() if editing(self.blocks[pos // size])}

    def is_final(self, block: Block) -> bool:
        return self.progress_of(block).finished and self.remaining(block) == 0

    def check_completion(self) -> CompletionReason | None:
        """As in the naive mode, but only once no active block may still be edited."""
        if self.nfe >= self.max_nfe:
            return CompletionReason.MAX_NFE
        if any(b.status is BlockStatus.ACTIVE and b.start < self.decode_limit for b in self.running):
            return None
        return super().check_completion()
