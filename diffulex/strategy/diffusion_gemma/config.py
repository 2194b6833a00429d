"""Config invariants of DiffusionGemma canvas denoising; its sampler defaults from generation_config.json."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from diffulex.config import DIFFUSION_GEMMA_CANVAS, force_setting
from diffulex.registry import StrategyConfigRegistry

if TYPE_CHECKING:
    from diffulex.config import Config

# generation_config.json key -> Config field.
GENERATION_CONFIG_KEYS = {
    "max_denoising_steps": "diffusion_gemma_max_denoising_steps",
    "stability_threshold": "diffusion_gemma_stability_threshold",
    "t_min": "diffusion_gemma_t_min",
    "t_max": "diffusion_gemma_t_max",
    "confidence_threshold": "diffusion_gemma_confidence_threshold",
}


def _read_generation_config(model: str) -> dict[str, Any]:
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model={model!r} has an unreadable generation_config.json: {e}") from None
    return data if isinstance(data, dict) else {}


@StrategyConfigRegistry.register("diffusion_gemma")
def normalize(config: Config) -> None:
    """The model denoises one whole 256-token canvas at a time, so the block, the page and the running set
    are fixed by the model, not tunable. The checkpoint's own sampler settings replace the Config defaults
    (a value the user changed is kept)."""
    reason = "diffusion_gemma denoises one 256-token canvas at a time"
    force_setting(config, "block_size", DIFFUSION_GEMMA_CANVAS, reason)
    force_setting(config, "page_size", DIFFUSION_GEMMA_CANVAS, reason)
    force_setting(config, "buffer_size", 1, reason)
    force_setting(config, "multi_block_prefix_full", False, "diffusion_gemma uses block-causal attention")
    if config.enable_prefix_caching is None:
        config.enable_prefix_caching = True

    generation = _read_generation_config(config.model)
    overrides = {field: generation[key] for key, field in GENERATION_CONFIG_KEYS.items() if key in generation}
    sampler = generation.get("sampler_config")
    if isinstance(sampler, dict) and "entropy_bound" in sampler:
        overrides["diffusion_gemma_entropy_bound"] = sampler["entropy_bound"]
    defaults = type(config).__dataclass_fields__
    for field, value in overrides.items():
        if getattr(config, field) == defaults[field].default:
            setattr(config, field, value)
