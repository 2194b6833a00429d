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
"""

from __future__ import annotations

import torch

from diffulex.layers.token_merge import SoftInput
from diffulex.sampler.host import HostSampler
from diffulex.sampler.rows import RowLayout
from diffulex.sampler.token_sampling import ban_tokens
from diffulex.strategy.edit.request import BlockVerdict, EditRequest
from diffulex.strategy.edit.sampler import EditSampler
from diffulex.strategy.request import Request, SampleTarget

# Confidence at which every position of a block counts as settled (the original's constant, not accept_threshold).
CONFIDENT = 0.9


class DMaxSampler(EditSampler):
    """Its rule (a left-to-right run of masks, and the soft inputs it sets) runs on the host only."""

    def row_layout(self, work: list[tuple[Request, list[SampleTarget]]]) -> RowLayout:
        return HostSampler.row_layout(self, work)

    def _block_writes(
        self, req: EditRequest, target: SampleTarget, tokens: list[int], conf: list[float], logits: torch.Tensor
    ) -> tuple[list[tuple[int, int]], BlockVerdict]:
        s = self.settings
        positions = target.positions
        current = [req.token_ids[p] for p in positions]
        was_mask = [token == s.mask_token_id for token in current]
        if s.dmax_fast_path:
            conf = [c if m else 1.0 for c, m in zip(conf, was_mask, strict=True)]
        masks = [i for i, m in enumerate(was_mask) if m]
        fill = []
        for i in masks:
            if conf[i] < s.accept_threshold:
                break
            fill.append(i)
        if masks and not fill:
            fill = masks[:1]
        refresh = [i for i, m in enumerate(was_mask) if not m and tokens[i] != current[i]]
        chosen = sorted(fill + refresh)
        settled = not chosen or all(c >= CONFIDENT for c in conf)
        finished = settled and len(fill) == len(masks)
        if s.token_merge is not None:
            filled = set(fill)
            decoded = [i for i in range(len(positions)) if not was_mask[i] or i in filled]
            self._set_soft_inputs(req, positions, decoded, tokens, conf, logits)
        decoded = [i for i, m in enumerate(was_mask) if not m]
        stable = sum(tokens[i] == current[i] for i in decoded) / len(decoded) if decoded else 1.0
        return [(positions[i], tokens[i]) for i in chosen], BlockVerdict(finished, stable)

    def _set_soft_inputs(
        self,
        req: EditRequest,
        positions: list[int],
        decoded: list[int],
        tokens: list[int],
        conf: list[float],
        logits: torch.Tensor,
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
            banned = ban_tokens(logits[decoded].float(), s.vocab_limit, s.mask_token_id)
            top = banned.softmax(dim=-1).topk(merge.top_k, dim=-1)
            for row, i in enumerate(decoded):
                probs = tuple(top.values[row].tolist())
                req.next_soft[positions[i]] = SoftInput(tuple(top.indices[row].tolist()), probs, 1.0 - sum(probs))
            return
        for i in decoded:
            c = min(max(conf[i], 0.0), 1.0)
            req.next_soft[positions[i]] = SoftInput((tokens[i],), (c,), 1.0 - c)
