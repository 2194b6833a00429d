"""Config invariants of DMax token-merge edit decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffulex.config import EDIT_MODEL_NAMES, force_setting, invalid_value
from diffulex.registry import StrategyConfigRegistry

if TYPE_CHECKING:
    from diffulex.config import Config


@StrategyConfigRegistry.register("dmax")
def normalize(config: Config) -> None:
    """DMax rewrites already decoded tokens, which only the LLaDA2 edit samplers implement; attention is
    block-causal like multi_bd, so prefix caching defaults to on."""
    if config.sampling_mode != "edit" or config.model_name not in EDIT_MODEL_NAMES:
        raise invalid_value(
            "decoding_strategy",
            "dmax",
            f"requires sampling_mode='edit' and an edit-capable model_name ({', '.join(EDIT_MODEL_NAMES)}); "
            f"got sampling_mode={config.sampling_mode!r}, model_name={config.model_name!r}",
        )
    force_setting(config, "multi_block_prefix_full", False, "dmax uses block-causal attention")
    if config.enable_prefix_caching is None:
        config.enable_prefix_caching = True
