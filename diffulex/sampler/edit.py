"""Edit-mode sampling (``sampling_mode="edit"``, LLaDA2.1): fill masks and rewrite decoded tokens of a block.

Per active block of an `diffulex.engine.edit_request.EditRequest`, every generated position gets a proposal
``x`` (the top-1, or a draw at ``temperature > 0``) and its probability ``p``:

* mask to token: masks with ``p > accept_threshold``, else the single most confident mask;
* token to token: decoded positions whose proposal differs, with ``p > edit_threshold``;
* with ``penalty_lambda > 0`` a position's proposal is first penalized for repeating the token before it;
* the block is finished when nothing would be written, or when it has used its post-edit steps (then nothing is
  written); on its last allowed step (time-out) every mask left takes its proposal.

Padding ids and the mask id are never proposed (the original bans neither here; docs/strategies.md). This runs
on the host after the LM head, one block at a time, so steps in edit mode never sample inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffulex.engine.edit_request import BlockVerdict, EditRequest
from diffulex.engine.request import Request, SampleTarget
from diffulex.layers.dispatch import triton_available
from diffulex.layers.token_merge import TokenMergeSettings
from diffulex.sampler.confidence import PendingWrites, RowLayout, draw
from diffulex.sampler.token_sampling import propose_greedy


@dataclass(frozen=True)
class EditSettings:
    """What the edit samplers (this one and `diffulex.sampler.dmax.DMaxSampler`) read of the configuration."""

    vocab_limit: int
    mask_token_id: int
    accept_threshold: float
    edit_threshold: float
    penalty_lambda: float
    base_seed: int
    dmax_fast_path: bool = True  # DMax: exact confidences only where a mask was
    token_merge: TokenMergeSettings | None = None  # DMax: soft inputs for the next forward


class _HostLayout(RowLayout):
    """A row layout that never takes the greedy graph path."""

    @property
    def greedy(self) -> bool:
        return False


class EditSampler:
    samples_in_graph = False  # the runner builds no sampling graph for it

    def __init__(self, settings: EditSettings) -> None:
        self.settings = settings

    def row_layout(self, work: list[tuple[Request, list[SampleTarget]]]) -> RowLayout:
        return _HostLayout.of(work, force_every_block=True)

    def warm_up(self, device: torch.device, dtype: torch.dtype, vocab_size: int, max_rows: int) -> None:
        """Compile the top-1 kernel for every row count up to `max_rows` (CUDA), as the naive sampler does."""
        if not triton_available():
            return
        from diffulex.kernels.top1 import warm_up as warm_up_top1

        s = self.settings
        warm_up_top1(device, vocab_size, dtype, s.vocab_limit, s.mask_token_id, max_rows)

    def __call__(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]
    ) -> dict[int, list[tuple[int, int]]]:
        return self.launch(logits, work).result()

    def launch(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]], layout: RowLayout | None = None
    ) -> PendingWrites:
        """``logits`` has one row per target position, in the order of ``work``; the writes are computed at once
        (the caller waits for nothing more). Proposals for every row come first, with one copy to the host; the
        decisions then run per block on host lists."""
        for req, _ in work:
            if not isinstance(req, EditRequest):
                raise TypeError("edit sampling needs EditRequest requests (sampling_mode='edit')")
        if self.settings.penalty_lambda > 0:
            logits = self._penalize(logits, work)
        tokens, conf = self._propose(logits, work)
        writes: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for req, targets in work:
            req_writes = writes.setdefault(req.req_id, [])
            for target in targets:
                n = len(target.positions)
                rows = slice(row, row + n)
                block_writes, verdict = self._block_writes(req, target, tokens[rows], conf[rows], logits[rows])
                req_writes.extend(block_writes)
                req.sampled_blocks[target.block.index] = verdict  # type: ignore[union-attr]
                row += n
        return PendingWrites(writes)

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

    def _propose(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]
    ) -> tuple[list[int], list[float]]:
        """Every row's proposal and its probability: the top-1 (`propose_greedy`, the Triton kernel on CUDA), or
        a draw for requests at ``temperature > 0``; one copy to the host."""
        s = self.settings
        tokens, conf = propose_greedy(logits, s.vocab_limit, s.mask_token_id)
        row = 0
        for req, targets in work:
            n = sum(len(t.positions) for t in targets)
            if not req.sampling_params.greedy and n:
                rows = slice(row, row + n)
                tokens[rows], conf[rows] = draw(logits[rows], req, s.vocab_limit, s.mask_token_id, s.base_seed)
            row += n
        return tokens.tolist(), conf.tolist()

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
        progress = req.progress_of(target.block)
        timed_out = req.times_out(target.block)
        used_up = not masks and progress.steps_without_masks + 1 > req.settings.max_post_edit_steps
        finished = timed_out or used_up or not (fill or edit)
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
