"""Edit-mode sampling (``sampling_mode="edit"``, LLaDA2.1): fill masks and rewrite decoded tokens of a block.

Per active block of an `diffulex.strategy.edit.request.EditRequest`, every generated position gets a proposal
``x`` (the top-1, or a draw at ``temperature > 0``) and its probability ``p``:

* mask to token: masks with ``p > accept_threshold``, else the single most confident mask;
* token to token: decoded positions whose proposal differs, with ``p > edit_threshold``;
* with ``penalty_lambda > 0`` a position's proposal is first penalized for repeating the token before it;
* the block is finished when nothing would be written, or when it has used its post-edit steps (then nothing is
  written); on its last allowed step (time-out) every mask left takes its proposal.

Padding ids and the mask id are never proposed (the original bans neither here; docs/strategies.md). This runs
on the host after the LM head, one block at a time (`diffulex.sampler.host`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffulex.layers.token_merge import TokenMergeSettings
from diffulex.sampler.host import HostSampler
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


class EditSampler(HostSampler):
    settings: EditSettings

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
        progress = req.progress_of(target.block)
        timed_out = req.times_out(target.block)
        used_up = not masks and progress.steps_without_masks + 1 > req.settings.options.max_post_edit_steps
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
