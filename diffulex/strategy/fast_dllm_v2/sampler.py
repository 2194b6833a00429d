"""Fast-dLLM v2's acceptance: of the current sub-block's masks, those whose proposal is more probable than the
threshold, and always the most probable one (the first among equals), so that every forward decodes a token.

A commit forward samples one position, the open block's first, which the same rule always accepts. That is the
confidence rule of multi-block decoding with every block allowed to force (each request samples one block per
step: its current sub-block), so the sampler is `ConfidenceSampler` with ``force_every_block``: proposals are the
top-1 (or a draw at ``temperature > 0``) over the allowed ids, and greedy steps sample inside the decode CUDA
graph like ``multi_bd``'s.
"""

from __future__ import annotations

from diffulex.sampler.rows import SamplerSettings
from diffulex.strategy.multi_bd.sampler import ConfidenceSampler


class FastDllmV2Sampler(ConfidenceSampler):
    def __init__(self, settings: SamplerSettings) -> None:
        super().__init__(settings, force_every_block=True)
