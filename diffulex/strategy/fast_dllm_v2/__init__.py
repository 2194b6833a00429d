"""Fast-dLLM v2: ``block_size`` is a sub-block, ``block_size * buffer_size`` a block; the blocks before the one being
decoded live in shared pages (the dual cache), so prefix caching is always on.

Its configuration is complete (options, invariants); the engine's sub-block refinement step is still to come, so
the engine refuses to run it (``request_class`` is None). Fast-dLLM-v2 checkpoints run under ``multi_bd`` meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffulex.strategy.strategy import Strategy, register_strategy
from diffulex.validation import check_bool, invalid_value, warn

if TYPE_CHECKING:
    from diffulex.config import Config

# Fast-dLLM v2 checkpoints are trained with 32-token blocks (the paper uses 8-token sub-blocks x 4).
TRAINED_BLOCK_SIZE = 32


@dataclass(frozen=True)
class FastDllmV2Options:
    fdv2_use_block_cache: bool = True  # reuse the K/V of refined sub-blocks; False recomputes every sub-block

    def __post_init__(self) -> None:
        check_bool("fdv2_use_block_cache", self.fdv2_use_block_cache)


class FastDllmV2(Strategy):
    name = "fast_dllm_v2"
    Options = FastDllmV2Options
    request_class = None
    requires_prefix_caching = True

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


register_strategy(FastDllmV2())
