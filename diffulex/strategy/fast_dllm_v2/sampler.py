"""Fast-dLLM v2's acceptance: of the current sub-block's masks, those whose proposal is more probable than the
threshold, and always the most probable one (the first among equals), so that every forward decodes a token.

A commit forward samples one position, the open block's first, which the same rule always accepts. Proposals are
the top-1 (or a draw at ``temperature > 0``) over the allowed ids (`diffulex.sampler.host`); the rule runs on the
host, so no step samples inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffulex.sampler.acceptance import accept_confident
from diffulex.sampler.host import HostSampler
from diffulex.strategy.request import Request, SampleTarget


@dataclass(frozen=True)
class FastDllmV2SamplerSettings:
    vocab_limit: int
    mask_token_id: int
    accept_threshold: float
    base_seed: int


class FastDllmV2Sampler(HostSampler):
    settings: FastDllmV2SamplerSettings

    def block_writes(
        self, req: Request, target: SampleTarget, tokens: list[int], conf: list[float], logits: torch.Tensor
    ) -> list[tuple[int, int]]:
        chosen = accept_confident(conf, self.settings.accept_threshold, force_allowed=True)
        return [(target.positions[i], tokens[i]) for i in chosen]
