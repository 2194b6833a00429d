"""A decoding strategy from outside the package: ``fixed_k``, in which every active block takes its ``k`` most
confident masks each step (``k`` = ``strategy_options={"tokens_per_block": k}``, default 2), whatever their
confidence. Everything else (running set, block-causal attention, prefix caching, commits) is multi_bd's.

Load it with ``plugins=["fixed_k"]`` (Python), ``--plugin fixed_k`` (CLI), ``plugins: [fixed_k]`` (YAML) or an entry
point of the ``diffulex.plugins`` group, with this folder on the Python path. docs/architecture.md walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffulex.sampler.host import HostSampler
from diffulex.sampler.rows import SamplerSettings
from diffulex.strategy.multi_bd import MultiBD
from diffulex.strategy.request import Request, SampleTarget
from diffulex.strategy.strategy import SamplerContext, register_strategy
from diffulex.validation import check_int


@dataclass(frozen=True)
class FixedKOptions:
    tokens_per_block: int = 2

    def __post_init__(self) -> None:
        check_int("tokens_per_block", self.tokens_per_block, low=1)


class FixedKSampler(HostSampler):
    """Proposals come from the shared machinery (top-1, or a draw at temperature > 0); the rule ranks a block's
    masks by confidence and keeps the first ``k`` (the earlier position first among equals)."""

    def __init__(self, settings: SamplerSettings, tokens_per_block: int) -> None:
        super().__init__(settings)
        self.tokens_per_block = tokens_per_block

    def block_writes(
        self, req: Request, target: SampleTarget, tokens: list[int], conf: list[float], logits: torch.Tensor
    ) -> list[tuple[int, int]]:
        ranked = sorted(range(len(tokens)), key=lambda i: (-conf[i], i))
        return [(target.positions[i], tokens[i]) for i in sorted(ranked[: self.tokens_per_block])]


class FixedK(MultiBD):
    name = "fixed_k"
    aliases = ()
    Options = FixedKOptions
    sampling_modes = ("naive",)
    samples_in_graph = False  # the rule runs on the host

    def make_sampler(self, context: SamplerContext) -> FixedKSampler:
        c = context
        settings = SamplerSettings(c.vocab_limit, c.mask_token_id, c.accept_threshold, c.base_seed)
        return FixedKSampler(settings, c.options.tokens_per_block)


register_strategy(FixedK())
