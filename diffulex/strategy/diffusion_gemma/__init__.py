"""DiffusionGemma canvas denoising: the model denoises one whole canvas (256 tokens) at a time, conditioned on the
encoded prompt, so block, page and running set are fixed by the model. Its sampler settings default from the
checkpoint's ``generation_config.json``.

Its configuration is complete (options, invariants, checkpoint defaults); the engine's canvas step is still to
come, so the engine refuses to run it (``request_class`` is None).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffulex.checkpoint_folder import checkpoint_path
from diffulex.strategy.strategy import Strategy, register_strategy
from diffulex.validation import check_int, check_number, force_setting, invalid_value

if TYPE_CHECKING:
    from diffulex.config import Config

# generation_config.json key -> option
GENERATION_CONFIG_KEYS = {
    "max_denoising_steps": "diffusion_gemma_max_denoising_steps",
    "stability_threshold": "diffusion_gemma_stability_threshold",
    "t_min": "diffusion_gemma_t_min",
    "t_max": "diffusion_gemma_t_max",
    "confidence_threshold": "diffusion_gemma_confidence_threshold",
}


@dataclass(frozen=True)
class DiffusionGemmaOptions:
    diffusion_gemma_max_denoising_steps: int = 48  # denoising steps per canvas at most
    diffusion_gemma_stability_threshold: int = 2  # equal argmaxes in a row that mean converged
    diffusion_gemma_confidence_threshold: float = 0.1  # mean-entropy bound for convergence
    diffusion_gemma_t_min: float = 0.0  # lowest temperature of the denoising schedule
    diffusion_gemma_t_max: float = 1.0  # highest (first) temperature of the schedule
    diffusion_gemma_entropy_bound: float = 1.0  # entropy bound of stochastic re-masking

    def __post_init__(self) -> None:
        check_int("diffusion_gemma_max_denoising_steps", self.diffusion_gemma_max_denoising_steps, low=1)
        check_int("diffusion_gemma_stability_threshold", self.diffusion_gemma_stability_threshold, low=1)
        for name, low in (
            ("diffusion_gemma_confidence_threshold", 0.0),
            ("diffusion_gemma_t_min", None),
            ("diffusion_gemma_t_max", None),
            ("diffusion_gemma_entropy_bound", 0.0),
        ):
            object.__setattr__(self, name, check_number(name, getattr(self, name), low=low))
        if self.diffusion_gemma_t_min > self.diffusion_gemma_t_max:
            raise invalid_value(
                "diffusion_gemma_t_min",
                self.diffusion_gemma_t_min,
                f"must be <= diffusion_gemma_t_max={self.diffusion_gemma_t_max:g}",
            )


def _read_generation_config(model: str) -> dict[str, Any]:
    path = checkpoint_path(model, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model={model!r} has an unreadable generation_config.json: {e}") from None
    return data if isinstance(data, dict) else {}


class DiffusionGemma(Strategy):
    name = "diffusion_gemma"
    Options = DiffusionGemmaOptions
    request_class = None
    families = ("diffusion_gemma",)
    budgets_prompt_tokens = False  # it schedules whole canvases; its budget is checked per request

    def normalize(self, config: Config) -> None:
        """Block and page are the canvas, the running set one canvas. The checkpoint's own sampler settings replace
        the defaults (a value the user changed is kept)."""
        canvas = config.family.canvas_size
        reason = f"diffusion_gemma denoises one {canvas}-token canvas at a time"
        force_setting(config, "block_size", canvas, reason)
        force_setting(config, "page_size", canvas, reason)
        force_setting(config, "buffer_size", 1, reason)
        super().normalize(config)

        generation = _read_generation_config(config.model)
        overrides = {option: generation[key] for key, option in GENERATION_CONFIG_KEYS.items() if key in generation}
        sampler = generation.get("sampler_config")
        if isinstance(sampler, dict) and "entropy_bound" in sampler:
            overrides["diffusion_gemma_entropy_bound"] = sampler["entropy_bound"]
        defaults = type(config).__dataclass_fields__
        for field, value in overrides.items():
            if getattr(config, field) == defaults[field].default:
                setattr(config, field, value)


register_strategy(DiffusionGemma())
