"""Fast-dLLM v2: ``block_size`` is a sub-block, ``block_size * buffer_size`` a block (the span attention is
block-causal at); the blocks before the one being decoded live in shared pages, so prefix caching is always on, and
with ``fdv2_use_block_cache`` the open block's K/V is kept in its own pages while its sub-blocks are refined (the
authors' DualCache).

The request (`diffulex.strategy.fast_dllm_v2.request`) chooses each step's forward; the sampler
(`diffulex.strategy.fast_dllm_v2.sampler`) its tokens. Refinement steps attend to cached keys after their rows,
which only the PyTorch attention path reads: its steps run eagerly, without CUDA graphs, on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffulex.models.family import Family
from diffulex.strategy.fast_dllm_v2.request import FastDllmV2Request
from diffulex.strategy.fast_dllm_v2.sampler import FastDllmV2Sampler, FastDllmV2SamplerSettings
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
    cuda_graphs = False  # refinement steps read cached keys after their rows, which the graphs' kernels do not
    samples_in_graph = False
    continues_on_device = False

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

    def make_sampler(self, context: SamplerContext) -> FastDllmV2Sampler:
        c = context
        return FastDllmV2Sampler(
            FastDllmV2SamplerSettings(c.vocab_limit, c.mask_token_id, c.accept_threshold, c.base_seed)
        )


register_strategy(FastDllmV2())
