"""DMax sampling (``decoding_strategy="dmax"``, LLaDA2 in edit mode).

Per active block, every generated position gets its top-1 (or a draw at ``temperature > 0``):

* decoded positions take it unconditionally (a refresh, no threshold);
* masks are filled left to right while their confidence stays at or above ``accept_threshold``; when the first
  mask is below it, that one alone is filled (at least one per step);
* the block is finished when the step changes nothing in it, or when every position is confident
  (`CONFIDENT`), provided no mask is left. There is no step cap: a block that keeps changing runs until the
  request's ``max_nfe``.

With ``dmax_fast_path`` (the default) a decoded position's confidence counts as 1.0 and only the positions that
were masks get their probability, as in the original. With ``token_merge_weight > 0`` every position holding a
token after the step gets candidates for the next forward's input (`diffulex.layers.token_merge`).

A greedy step without a repetition penalty (and with no merge or ``dmax_topk``'s) runs the rule inside the decode
graph's sampling graph (`diffulex.strategy.dmax.acceptance`), whose result also carries each row's confidence: the
host then judges each block and sets its soft inputs from the device's flags with `DMaxSampler.judge_block`, the
code the host rule uses. Such steps are continued on the device too (`advance_dmax_inputs` writes the soft
inputs). ``iter_smooth_topk`` reads each position's top-k, which stays on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffulex.layers.token_merge import SoftInput, StaticTokenMerge
from diffulex.sampler.rows import RowLayout, new_result
from diffulex.sampler.token_sampling import ban_tokens, propose_greedy
from diffulex.strategy.dmax.acceptance import advance_dmax_inputs, dmax_acceptance
from diffulex.strategy.edit.request import BlockVerdict, EditRequest
from diffulex.strategy.edit.sampler import EditLayout, EditSampler
from diffulex.strategy.request import Request, SampleTarget

# Confidence at which every position of a block counts as settled (the original's constant, not accept_threshold).
CONFIDENT = 0.9
# The row of a graph-sampled step's result that holds each row's confidence (float64 bits; `new_result`).
CONFIDENCE_FIELD = 2


@dataclass
class DMaxLayout(EditLayout):
    """A DMax step's rows; a graph-sampled step's blocks are judged from its result by the sampler's `judge`."""

    judge: Callable[..., BlockVerdict] | None = None  # `DMaxSampler.judge_block`

    def give_verdicts(self, accepted: list[int], tokens: list[int], result: torch.Tensor) -> None:
        conf = result[CONFIDENCE_FIELD].view(torch.float64).tolist()
        for block in self.sampled_blocks():
            lo, hi = block.rows.start, block.rows.stop
            verdict = self.judge(block.req, self.positions[lo:hi], block.current, tokens[lo:hi], conf[lo:hi],
                                 accepted[lo:hi])  # fmt: skip
            block.req.sampled_blocks[block.index] = verdict


class DMaxSampler(EditSampler):
    """DMax's rule: on the host (`_block_writes`), or on the device for greedy steps (`greedy_result`)."""

    result_fields = 3  # the accepted flag, the token and its confidence (`CONFIDENCE_FIELD`)

    def row_layout(self, work: list[tuple[Request, list[SampleTarget]]]) -> RowLayout:
        """Greedy steps sample in the graph unless a repetition penalty changes the logits or the soft inputs need
        each position's top-k (``iter_smooth_topk``)."""
        merge = self.settings.token_merge
        layout = self.edit_layout(DMaxLayout, work)
        layout.in_graph = layout.in_graph and (merge is None or merge.mode == "dmax_topk")
        layout.judge = self.judge_block
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
        """A greedy DMax step on the device alone (what the sampling graph captures): ``[3, N]`` (written flag,
        proposal, confidence as float64 bits) for ``logits[source_rows]``, whose rows now hold ``current [N]``;
        ``force [S + 1]`` only counts the blocks."""
        s = self.settings
        result = new_result(source_rows.shape[0], logits.device, self.result_fields)
        tokens, conf = propose_greedy(logits, s.vocab_limit, s.mask_token_id, source_rows, tokens_out=result[1])
        flags = dmax_acceptance(tokens, conf, current, segment, force.shape[0], s.mask_token_id, s.accept_threshold)
        result[0].copy_(flags)
        result[CONFIDENCE_FIELD].copy_(conf.double().view(torch.int64))
        return result

    def continuation_advance(
        self, shift: int, soft_records: Callable[[int], StaticTokenMerge] | None = None
    ) -> Callable[..., None]:
        """What a sampling graph runs after this rule to turn the step's inputs into its continuation's:
        `advance_dmax_inputs`, writing the soft inputs into ``soft_records`` (the static records of a bucket's
        rows) where token merge is on."""
        s = self.settings

        def advance(input_ids: torch.Tensor, source_rows: torch.Tensor, slot_mapping: torch.Tensor,
                    result: torch.Tensor, starts: torch.Tensor, blocks: torch.Tensor, segment: torch.Tensor,
                    force: torch.Tensor) -> None:  # fmt: skip
            merge = soft_records(input_ids.shape[0]) if soft_records is not None else None
            advance_dmax_inputs(input_ids, source_rows, result, merge, s.mask_token_id, shift, s.dmax_fast_path)

        return advance

    def _block_writes(
        self, req: EditRequest, target: SampleTarget, tokens: list[int], conf: list[float], logits: torch.Tensor
    ) -> tuple[list[tuple[int, int]], BlockVerdict]:
        s = self.settings
        positions = target.positions
        current = [req.token_ids[p] for p in positions]
        masks = [i for i, token in enumerate(current) if token == s.mask_token_id]
        fill = []
        for i in masks:
            if conf[i] < s.accept_threshold:
                break
            fill.append(i)
        if masks and not fill:
            fill = masks[:1]
        filled = set(fill)
        accepted = [i in filled or (token != s.mask_token_id and tokens[i] != token) for i, token in enumerate(current)]
        verdict = self.judge_block(req, positions, current, tokens, conf, accepted, logits)
        return [(positions[i], tokens[i]) for i, take in enumerate(accepted) if take], verdict

    def judge_block(
        self,
        req: EditRequest,
        positions: list[int],
        current: list[int],
        tokens: list[int],
        conf: list[float],
        accepted: list[int] | list[bool],
        logits: torch.Tensor | None = None,
    ) -> BlockVerdict:
        """The verdict on a block whose rows held ``current`` and took ``accepted`` of their proposals ``tokens``
        (at ``conf``), and the soft inputs it gives the next forward: finished once the step changed nothing or
        every position is confident, provided no mask is left; stable as the share of its decoded tokens proposed
        again. ``logits`` (its rows) only for ``iter_smooth_topk``, which reads each position's top-k."""
        s = self.settings
        was_mask = [token == s.mask_token_id for token in current]
        if s.dmax_fast_path:
            conf = [c if m else 1.0 for c, m in zip(conf, was_mask, strict=True)]
        settled = not any(accepted) or all(c >= CONFIDENT for c in conf)
        finished = settled and all(take for take, m in zip(accepted, was_mask, strict=True) if m)
        if s.token_merge is not None:
            holding = [i for i, m in enumerate(was_mask) if not m or accepted[i]]
            self._set_soft_inputs(req, positions, holding, tokens, conf, logits)
        decoded = [i for i, m in enumerate(was_mask) if not m]
        stable = sum(tokens[i] == current[i] for i in decoded) / len(decoded) if decoded else 1.0
        return BlockVerdict(finished, stable)

    def _set_soft_inputs(
        self,
        req: EditRequest,
        positions: list[int],
        decoded: list[int],
        tokens: list[int],
        conf: list[float],
        logits: torch.Tensor | None,
    ) -> None:
        """The candidates of every position that holds a token after this step, for the next forward: its token
        at its confidence (``dmax_topk``), or the top-k of its distribution (``iter_smooth_topk``); the rest of
        the probability goes to the mask."""
        s = self.settings
        merge = s.token_merge
        assert merge is not None
        if req.next_soft is None:
            req.next_soft = {}
        if merge.mode == "iter_smooth_topk" and decoded:
            if logits is None:
                raise ValueError("iter_smooth_topk's soft inputs read the logits: its steps sample on the host")
            banned = ban_tokens(logits[decoded].float(), s.vocab_limit, s.mask_token_id)
            top = banned.softmax(dim=-1).topk(merge.top_k, dim=-1)
            for row, i in enumerate(decoded):
                probs = tuple(top.values[row].tolist())
                req.next_soft[positions[i]] = SoftInput(tuple(top.indices[row].tolist()), probs, 1.0 - sum(probs))
            return
        for i in decoded:
            c = min(max(conf[i], 0.0), 1.0)
            req.next_soft[positions[i]] = SoftInput((tokens[i],), (c,), 1.0 - c)
