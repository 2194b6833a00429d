"""Config invariants of Multi-Block Diffusion: block-causal attention, prefix caching on unless turned off."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffulex.config import force_setting
from diffulex.registry import StrategyConfigRegistry

if TYPE_CHECKING:
    from diffulex.config import Config


@StrategyConfigRegistry.register("multi_bd")
def normalize(config: Config) -> None:
    """Every block, prompt blocks included, sees only itself and earlier blocks, so committed pages never
    change and can be shared between requests: prefix caching defaults to on."""
    force_setting(config, "multi_block_prefix_full", False, "multi_bd uses block-causal attention")
    if config.enable_prefix_caching is None:
        config.enable_prefix_caching = True
