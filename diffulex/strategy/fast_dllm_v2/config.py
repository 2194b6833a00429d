"""Config invariants of Fast-dLLM v2: ``block_size`` is a sub-block, ``block_size * buffer_size`` a block."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffulex.config import force_setting, invalid_value, warn
from diffulex.registry import StrategyConfigRegistry

if TYPE_CHECKING:
    from diffulex.config import Config

# Fast-dLLM v2 checkpoints are trained with 32-token blocks (the paper uses 8-token sub-blocks x 4).
TRAINED_BLOCK_SIZE = 32


@StrategyConfigRegistry.register("fast_dllm_v2")
def normalize(config: Config) -> None:
    """The buffer holds the sub-blocks of one Fast-dLLM-v2 block, so it needs at least two of them; its
    dual cache keeps committed blocks in shared pages, so prefix caching is always on."""
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
    force_setting(config, "multi_block_prefix_full", False, "fast_dllm_v2 uses block-causal attention")
    force_setting(
        config, "enable_prefix_caching", True, "fast_dllm_v2 keeps committed blocks in shared pages"
    )
