"""Edit-mode sampling (``sampling_mode="edit"``, LLaDA2.1): fill masks and rewrite decoded tokens of a block.

Per active block of an `diffulex.strategy.edit.request.EditRequest`, every generated position gets a proposal
``x`` (the top-1, or a draw at ``temperature > 0``) and its probability ``p``:

* mask to token: masks with ``p > accept_threshold``, else the single most confident mask;
* token to token: decoded positions whose proposal differs, with ``p > edit_threshold``;
* with ``penalty_lambda > 0`` a position's proposal is first penalized for repeating the token before it;
* the block is finished when nothing would be written, or when it has used its post-edit steps (then nothing is
  written); on its last allowed step (time-out) every mask left takes its proposal.

Padding ids and the mask id are never proposed (the original bans neither here; docs/strategies.md). A step
whose requests all decode greedily (and ``penalty_lambda == 0``) runs the rule inside the decode CUDA graph's
sampling graph (`EditSampler.greedy_result`, `diffulex.strategy.edit.acceptance`): the host then reads each
block's verdict off the step's result (`EditLayout`). Other steps run it on the host after the LM head, one block
at a time (`diffulex.sampler.host`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diffulex.layers.token_merge import StaticTokenMerge, TokenMergeSettings
from diffulex.sampler.host import HostSampler
from diffulex.sampler.rows import PendingWrites, RowLayout, new_result
from diffulex.sampler.token_sampling import propose_greedy
from diffulex.strategy.edit.acceptance import EditPhase, accept_edits, advance_edit_inputs
from diffulex.strategy.edit.request import BlockVerdict, EditRequest
from diffulex.strategy.request import Request, SampleTarget


@dataclass(frozen=True)
class EditSettings:
    """What the edit samplers (this one and `diffulex.strategy.dmax.sampler.DMaxSampler`) read of the configuration."""

    vocab_limit: int
    mask_token_id: int
    accept_threshold: float
    edit_threshold: float
    penalty_lambda: float
    base_seed: int
    dmax_fast_path: bool = True  # DMax: exact confidences only where a mask was
    token_merge: TokenMergeSettings | None = None  # DMax: soft inputs for the next forward


@dataclass(frozen=True)
class SampledBlock:
    """One block of an edit step's layout: whose it is, its rows, its phase and the tokens those rows held."""

    req: EditRequest
    index: int  # the block's index in its request
    rows: range  # its rows in the step's layout
    phase: EditPhase
    current: list[int]  # the token at each of its rows' positions before the step

    def again(self, positions: list[int]) -> SampledBlock:
        """The block as the step after this one finds it (a continuation's, `EditLayout.continued`), once the
        host has applied this step: its rows' tokens and phase read from its request again."""
        req = self.req
        current = [req.token_ids[p] for p in positions[self.rows.start : self.rows.stop]]
        return dataclasses.replace(self, phase=req.block_phase(req.blocks[self.index], current), current=current)


@dataclass
class EditLayout(RowLayout):
    """An edit step's rows. The staged ``force`` entries carry each block's `EditPhase` and counts (edit decoding
    always forces where it may, so the device rule reads the phase instead; `acceptance.block_state`). A step is
    ``greedy`` (sampled inside the graph) when no request draws and no penalty changes the logits."""

    blocks: list[SampledBlock] = field(default_factory=list)
    in_graph: bool = True  # the device rule applies (no repetition penalty)
    mask_token_id: int = -1
    # a continuation's layout: its blocks as the host finds them once it has applied the step before (`continued`)
    reread_blocks: bool = False

    @property
    def greedy(self) -> bool:
        return self.in_graph and not self.sampled

    def pending(
        self, accepted_tokens: torch.Tensor | None = None, ready: torch.cuda.Event | None = None
    ) -> PendingWrites:
        pending = super().pending(accepted_tokens, ready)
        if accepted_tokens is None:
            return pending
        return _EditPendingWrites(pending.writes, self.owners, self.positions, accepted_tokens, ready, self)

    def continued(self) -> EditLayout:
        """The layout to read a continuation of this step with (`diffulex.engine.continuation`): the same rows, each
        block's tokens and phase read again when its result is applied, after this step's."""
        return dataclasses.replace(self, reread_blocks=True)

    def sampled_blocks(self) -> list[SampledBlock]:
        """The step's blocks, as its result is applied (read again for a continuation's, `continued`)."""
        return [block.again(self.positions) for block in self.blocks] if self.reread_blocks else self.blocks

    def give_verdicts(self, accepted: list[int], tokens: list[int], result: torch.Tensor) -> None:
        """Each block's verdict from the device rule's flags and every row's proposal (``result``, host memory, as
        lists), as the host rule gives it: finished once it writes nothing or is past editing; stable as the share of
        decoded tokens proposed again."""
        for block in self.sampled_blocks():
            rows = block.rows
            decoded = [i for i, token in enumerate(block.current) if token != self.mask_token_id]
            agree = sum(tokens[rows[i]] == block.current[i] for i in decoded)
            timed_out = block.phase is EditPhase.TIMED_OUT
            finished = block.phase is not EditPhase.EDITING or not any(accepted[rows.start : rows.stop])
            stable = 1.0 if timed_out or not decoded else agree / len(decoded)
            block.req.sampled_blocks[block.index] = BlockVerdict(finished, stable)


@dataclass
class _EditPendingWrites(PendingWrites):
    """A graph-sampled edit step's writes; reading them also hands each block its verdict."""

    layout: EditLayout | None = None

    def read_rows(self, accepted: list[int], tokens: list[int]) -> None:
        if self.layout is not None:
            self.layout.give_verdicts(accepted, tokens, self.accepted_tokens)


class EditSampler(HostSampler):
    settings: EditSettings
    # its greedy step reads the tokens the sampled rows hold (`diffulex.engine.model_runner.ModelRunner.greedy_sample`)
    greedy_reads_inputs = True

    def continuation_advance(
        self, shift: int, soft_records: Callable[[int], StaticTokenMerge] | None = None
    ) -> Callable[..., None]:
        """What a sampling graph runs after this rule to turn the step's inputs into its continuation's (the graphs'
        `diffulex.engine.cuda_graph.Advance`): `advance_edit_inputs`. Edit decoding has no soft inputs."""
        if soft_records is not None:
            raise ValueError("edit decoding's continuations write no soft inputs")
        mask_token_id = self.settings.mask_token_id

        def advance(input_ids: torch.Tensor, source_rows: torch.Tensor, slot_mapping: torch.Tensor,
                    result: torch.Tensor, starts: torch.Tensor, blocks: torch.Tensor, segment: torch.Tensor,
                    force: torch.Tensor) -> None:  # fmt: skip
            advance_edit_inputs(input_ids, source_rows, result, segment, force, mask_token_id, shift)

        return advance

    def row_layout(self, work: list[tuple[Request, list[SampleTarget]]]) -> RowLayout:
        """Every block forces where it may (the host rule), and carries its `EditPhase` for the device rule."""
        layout = self.edit_layout(EditLayout, work)
        for number, block in enumerate(layout.blocks):
            layout.force[number] = block.req.block_state(block.req.blocks[block.index], block.phase)
        return layout

    def edit_layout(self, layout_class: type[EditLayout], work: list[tuple[Request, list[SampleTarget]]]) -> EditLayout:
        """A layout of ``layout_class`` with each sampled block: its rows, the tokens they hold and its phase."""
        s = self.settings
        layout = layout_class.of(work, force_every_block=True)
        layout.in_graph = s.penalty_lambda == 0
        layout.mask_token_id = s.mask_token_id
        row = 0
        for req, targets in work:
            if not isinstance(req, EditRequest):
                raise TypeError("edit sampling needs EditRequest requests (sampling_mode='edit')")
            for target in targets:
                current = [req.token_ids[p] for p in target.positions]
                rows = range(row, row + len(current))
                phase = req.block_phase(target.block, current)
                layout.blocks.append(SampledBlock(req, target.block.index, rows, phase, current))
                row = rows.stop
        return layout

    def greedy_result(
        self,
        logits: torch.Tensor,
        source_rows: torch.Tensor,
        segment: torch.Tensor,
        force: torch.Tensor,
        starts: torch.Tensor,
        max_block_rows: int,
        current: torch.Tensor,
    ) -> torch.Tensor:
        """A greedy edit step on the device alone (what the sampling graph captures): ``[2, N]`` (written flag,
        proposal) for ``logits[source_rows]``, whose rows now hold ``current [N]``; ``force`` carries each block's
        `EditPhase` (`EditLayout`). Proposals as the host rule's (`propose_greedy`)."""
        s = self.settings
        result = new_result(source_rows.shape[0], logits.device)
        tokens, conf = propose_greedy(logits, s.vocab_limit, s.mask_token_id, source_rows, tokens_out=result[1])
        accept_edits(
            tokens, conf, current, segment, starts, force, s.mask_token_id, s.accept_threshold, s.edit_threshold,
            max_block_rows, out=result[0],
        )  # fmt: skip
        return result

    def block_writes(
        self, req: Request, target: SampleTarget, tokens: list[int], conf: list[float], logits: torch.Tensor
    ) -> list[tuple[int, int]]:
        """The block's writes; the verdict on the block (finished or not) goes to the request with them."""
        if not isinstance(req, EditRequest):
            raise TypeError("edit sampling needs EditRequest requests (sampling_mode='edit')")
        writes, verdict = self._block_writes(req, target, tokens, conf, logits)
        req.sampled_blocks[target.block.index] = verdict
        return writes

    def prepare_logits(self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]) -> torch.Tensor:
        return self._penalize(logits, work) if self.settings.penalty_lambda > 0 else logits

    def _penalize(self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]) -> torch.Tensor:
        """Each row's logit of the token at the position before it lowered by ``penalty_lambda`` (within a block,
        where that position holds a token)."""
        s = self.settings
        logits = logits.float().clone()
        rows, ids, row = [], [], 0
        for req, targets in work:
            for target in targets:
                positions = target.positions
                for i in range(1, len(positions)):
                    before = req.token_ids[positions[i - 1]]
                    if positions[i] - 1 == positions[i - 1] and before != s.mask_token_id:
                        rows.append(row + i)
                        ids.append(before)
                row += len(positions)
        if rows:
            index = torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)
            logits[index] -= s.penalty_lambda
        return logits

    def _block_writes(
        self, req: EditRequest, target: SampleTarget, tokens: list[int], conf: list[float], logits: torch.Tensor
    ) -> tuple[list[tuple[int, int]], BlockVerdict]:
        """The block's writes and the verdict on it, from its rows' proposals (``logits``: its rows, for samplers
        that read more than the top-1)."""
        s = self.settings
        positions = target.positions
        current = [req.token_ids[p] for p in positions]
        masks = [i for i, token in enumerate(current) if token == s.mask_token_id]
        fill = [i for i in masks if conf[i] > s.accept_threshold]
        if masks and not fill:
            fill = [max(masks, key=lambda i: conf[i])]
        edit = [
            i for i, token in enumerate(current)
            if token != s.mask_token_id and tokens[i] != token and conf[i] > s.edit_threshold
        ]  # fmt: skip
        phase = req.block_phase(target.block, current)
        timed_out = phase is EditPhase.TIMED_OUT
        finished = phase is not EditPhase.EDITING or not (fill or edit)
        if timed_out:
            chosen = masks + edit
        elif finished:
            chosen = []
        else:
            chosen = fill + edit
        decoded = [i for i, token in enumerate(current) if token != s.mask_token_id]
        agree = sum(tokens[i] == current[i] for i in decoded)
        stable = 1.0 if timed_out or not decoded else agree / len(decoded)
        return [(positions[i], tokens[i]) for i in sorted(chosen)], BlockVerdict(finished, stable)
