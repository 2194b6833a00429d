"""Samplers: candidate tokens from logits, and the per-family rules that decide what is written."""

from diffulex.sampler import family_rules  # noqa: F401  (registers the rules of every family)
from diffulex.sampler.confidence import ConfidenceSampler, SamplerSettings
from diffulex.sampler.family_rules import AlwaysForceSampler

__all__ = ["AlwaysForceSampler", "ConfidenceSampler", "SamplerSettings"]
