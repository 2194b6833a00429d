"""Multi-Block Diffusion: a running set of up to ``buffer_size`` blocks, block-causal attention, prefix caching.

With ``buffer_size=1`` this is SingleBD, the semi-autoregressive block diffusion SDAR and LLaDA2 were trained for.
Every block, prompt blocks included, sees only itself and earlier blocks, so committed pages never change and can be
shared between requests: prefix caching is on unless turned off. Acceptance is the confidence rule
(`diffulex.strategy.multi_bd.sampler`); under ``sampling_mode="edit"`` it runs as edit decoding
(`diffulex.strategy.edit`).
"""

from __future__ import annotations

from diffulex.sampler.rows import SamplerSettings
from diffulex.strategy.edit import EditDecoding
from diffulex.strategy.multi_bd.sampler import ConfidenceSampler
from diffulex.strategy.strategy import SamplerContext, Strategy, register_strategy


class MultiBD(Strategy):
    name = "multi_bd"
    aliases = ("multi_block_diffusion", "block_diffusion", "fast_dllm")  # names of it in older configs
    sampling_modes = ("naive", "edit")

    def for_sampling_mode(self, mode: str) -> Strategy:
        if mode == "edit" and mode in self.sampling_modes:
            return EditDecoding(self.name)
        return super().for_sampling_mode(mode)

    def make_sampler(self, context: SamplerContext) -> ConfidenceSampler:
        c = context
        settings = SamplerSettings(c.vocab_limit, c.mask_token_id, c.accept_threshold, c.base_seed)
        return ConfidenceSampler(settings, force_every_block=c.family.force_every_block)


register_strategy(MultiBD())
