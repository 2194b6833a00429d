"""The confidence-threshold sampler used by SDAR and other non-shifted block-diffusion families."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffulex.engine.request import Request, SampleTarget
from diffulex.registry import AutoSampler
from diffulex.sampler.acceptance import accept_confident
from diffulex.sampler.token_sampling import ban_tokens, greedy, sample, step_generator


@dataclass
class SamplerSettings:
    vocab_limit: int  # ids at or above this are padding rows of the embedding, never proposed
    mask_token_id: int
    accept_threshold: float
    base_seed: int  # seed for requests that do not bring their own


@AutoSampler.register("sdar")
class ConfidenceSampler:
    """Logits at position p predict the token at p; accept confident positions, force one when allowed."""

    def __init__(self, settings: SamplerSettings) -> None:
        self.settings = settings

    def __call__(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]
    ) -> dict[int, list[tuple[int, int]]]:
        """``logits`` has one row per target position, in the order of ``work``; returns writes per request."""
        s = self.settings
        logits = ban_tokens(logits, s.vocab_limit, s.mask_token_id)
        tokens, conf = self._propose(logits, work)
        tokens_l, conf_l = tokens.tolist(), conf.tolist()
        writes: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for req, targets in work:
            out = writes.setdefault(req.req_id, [])
            for target in targets:
                n = len(target.positions)
                keep = accept_confident(conf_l[row : row + n], s.accept_threshold, target.force_allowed)
                out.extend((target.positions[i], tokens_l[row + i]) for i in keep)
                row += n
        return writes

    def _propose(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, conf = greedy(logits)
        row = 0
        for req, targets in work:
            n = sum(len(t.positions) for t in targets)
            sp = req.sampling_params
            if sp.temperature > 0 and n:
                seed = sp.seed if sp.seed is not None else self.settings.base_seed + req.req_id
                g = step_generator(seed, req.nfe, logits.device)
                t, c = sample(logits[row : row + n], sp.temperature, sp.top_k, sp.top_p, g)
                tokens[row : row + n], conf[row : row + n] = t, c
            row += n
        return tokens, conf
