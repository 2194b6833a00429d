"""Samplers: candidate tokens from logits, and the per-family rules that decide what is written."""

from diffulex.sampler.confidence import ConfidenceSampler, SamplerSettings

__all__ = ["ConfidenceSampler", "SamplerSettings"]
