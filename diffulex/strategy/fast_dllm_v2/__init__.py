"""Fast-dLLM v2: ``block_size`` is a sub-block, ``block_size * buffer_size`` a block (the span attention is
block-causal at); the blocks before the one being decoded live in shared pages, so prefix caching is always on, and
with ``fdv2_use_block_cache`` the open block's K/V is kept in its own pages while its sub-blocks are refined (the
authors' DualCache).

The request (`diffulex.strategy.fast_dllm_v2.request`) chooses each step's forward; the sampler
(`diffulex.strategy.fast_dllm_v2.sampler`) its tokens. Refinement steps attend to cached keys after their rows
(`attends_past_rows`: the attention kernels read them through the step's key ends), so a step mixing commits,
whole-block forwards and refinements replays one decode CUDA graph, greedy sampling included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffulex.models.family import Family
from diffulex.sampler.rows import SamplerSettings
from diffulex.strategy.fast_dllm_v2.request import FastDllmV2Request
from diffulex.strategy.fast_dllm_v2.sampler import FastDllmV2Sampler
from diffulex.strategy.strategy import SamplerContext, Strategy, register_strategy
from diffulex.validation import check_bool, invalid_value, warn

if TYPE_CHECKING:
    from diffulex.config import Config

# Fast-dLLM v2 checkpoints are trained with 32-token blocks (the paper uses 8-token sub-blocks x 4).
TRAINED_BLOCK_SIZE = 32


@dataclass(frozen=True)
class FastDllmV2Options:
    # keep the open block's K/V and recompute only the current sub-block; False computes the whole block every forward
    fdv2_use_block_cache: bool = True

    def __post_init__(self) -> None:
        check_bool("fdv2_use_block_cache", self.fdv2_use_block_cache)


class FastDllmV2(Strategy):
    name = "fast_dllm_v2"
    Options = FastDllmV2Options
    request_class = FastDllmV2Request
    requires_prefix_caching = True
    attends_past_rows = True  # a refinement's rows read the rest of their block from the kept K/V
    short_buckets_past_max_requests = True  # `short_step_buckets`

    def attention_block_size(self, config: Config) -> int:
        return config.block_size * config.buffer_size

    def check_family(self, family: Family) -> None:
        """The algorithm reads position ``p`` from row ``p - 1``: the family must predict shifted."""
        super().check_family(family)
        if not family.logits_shift:
            raise invalid_value(
                "decoding_strategy",
                self.name,
                f"requires a model family with shifted logits (row p - 1 predicts p), got model_name={family.name!r}",
            )

    def normalize(self, config: Config) -> None:
        """The buffer holds the sub-blocks of one block, so it needs at least two of them."""
        if config.buffer_size <= 1:
            raise invalid_value(
                "buffer_size", config.buffer_size, "fast_dllm_v2 needs buffer_size > 1 (sub-blocks per block)"
            )
        span = config.block_size * config.buffer_size
        if span != TRAINED_BLOCK_SIZE:
            warn(
                f"fast_dllm_v2: block_size * buffer_size = {config.block_size} * {config.buffer_size} = {span}, "
                f"but the checkpoints are trained with {TRAINED_BLOCK_SIZE}-token blocks (e.g. 8 * 4)"
            )
        super().normalize(config)

    def continues_steps(self, config: Config) -> bool:
        """Refinements are continued on the device (`FastDllmV2Request.next_step_has_same_rows`): with the block
        cache only, since without it every forward computes the whole block and no step is a refinement."""
        return self.continues_on_device and config.strategy_options.fdv2_use_block_cache

    def short_step_rows(self, config: Config, logits_shift: bool) -> int | None:
        """Two sub-blocks of rows per request: a refinement computes one, and a block of ``K`` sub-blocks has about
        ``K`` whole-block forwards (its inits and its commit) for ``K * (B - 1)`` refinements at one token per
        forward, so in a batch a few requests' whole blocks ride on the others' spare rows; the full graphs pad every
        request to a whole block plus the shifted row. A lone request's refinement fits too (``2 * B`` rows)."""
        return min(2 * config.block_size, config.block_size * config.buffer_size)

    def short_step_buckets(self, buckets: list[int]) -> list[int]:
        """Every bucket: a lone request's refinement computes one sub-block of the four a whole-block forward
        computes (the 7B geometry at batch 1 on an H100: 1.25x its floor with them), and a batch's rows vary with how
        many of its requests compute a whole block, which the finer buckets past 32 requests follow; and those past
        the engine's request count (`short_buckets_past_max_requests`): a batch whose requests half refine and half
        compute a whole block (about 21 rows a request) fits a short bucket of more requests in about two thirds of
        the rows the full graphs pad it to (the 7B geometry at batch 32 on an H200: 23.2 -> 20.2 ms a step)."""
        return buckets

    def make_sampler(self, context: SamplerContext) -> FastDllmV2Sampler:
        c = context
        return FastDllmV2Sampler(SamplerSettings(c.vocab_limit, c.mask_token_id, c.accept_threshold, c.base_seed))


register_strategy(FastDllmV2())
