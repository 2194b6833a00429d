"""DiffusionGemma canvas denoising: canvases of the checkpoint's ``canvas_length`` tokens are produced one after
another, each denoised as a whole, conditioned on the encoder's K/V of the prompt and of the canvases before it.
Block and page are the canvas; the running set is one canvas. Its sampler settings default from the checkpoint's
``generation_config.json``.

The model's forward is an encoder and a canvas decoder, so the strategy brings its own runner
(`runner.CanvasRunner`, via `Strategy.make_runner`), which keeps the encoder K/V in pages of the engine's pool;
the request (`request.CanvasRequest`) holds the canvases, and `canvas` is the denoising rule of one step
(docs/strategies.md, "DiffusionGemma").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffulex.checkpoint_folder import checkpoint_path
from diffulex.sampling_params import MAX_TEMPERATURE
from diffulex.strategy.diffusion_gemma.canvas import CanvasSchedule
from diffulex.strategy.diffusion_gemma.request import CanvasRequest
from diffulex.strategy.diffusion_gemma.runner import CanvasRunner, CanvasRunnerSettings, default_graph_buckets
from diffulex.strategy.strategy import RunnerContext, StepRunner, Strategy, register_strategy
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


# Denoising steps of one canvas at most (the checkpoint's own is 48): a canvas that never converges ends only here.
MAX_DENOISING_STEPS = 1024


@dataclass(frozen=True)
class DiffusionGemmaOptions:
    diffusion_gemma_max_denoising_steps: int = 48  # denoising steps per canvas at most
    diffusion_gemma_stability_threshold: int = 2  # equal argmaxes in a row that mean converged
    diffusion_gemma_confidence_threshold: float = 0.1  # mean-entropy bound for convergence
    diffusion_gemma_t_min: float = 0.0  # lowest temperature of the denoising schedule
    diffusion_gemma_t_max: float = 1.0  # highest (first) temperature of the schedule
    diffusion_gemma_entropy_bound: float = 1.0  # entropy bound of stochastic re-noising

    def __post_init__(self) -> None:
        steps = self.diffusion_gemma_max_denoising_steps
        check_int("diffusion_gemma_max_denoising_steps", steps, low=1, high=MAX_DENOISING_STEPS)
        check_int("diffusion_gemma_stability_threshold", self.diffusion_gemma_stability_threshold, low=1)
        for name, high in (
            ("diffusion_gemma_confidence_threshold", None),
            ("diffusion_gemma_t_min", MAX_TEMPERATURE),
            ("diffusion_gemma_t_max", MAX_TEMPERATURE),
            ("diffusion_gemma_entropy_bound", None),
        ):
            object.__setattr__(self, name, check_number(name, getattr(self, name), low=0.0, high=high))
        if self.diffusion_gemma_t_min > self.diffusion_gemma_t_max:
            raise invalid_value(
                "diffusion_gemma_t_min",
                self.diffusion_gemma_t_min,
                f"must be <= diffusion_gemma_t_max={self.diffusion_gemma_t_max:g}",
            )

    @property
    def schedule(self) -> CanvasSchedule:
        return CanvasSchedule(
            max_steps=self.diffusion_gemma_max_denoising_steps,
            stability_threshold=self.diffusion_gemma_stability_threshold,
            confidence_threshold=self.diffusion_gemma_confidence_threshold,
            t_min=self.diffusion_gemma_t_min,
            t_max=self.diffusion_gemma_t_max,
            entropy_bound=self.diffusion_gemma_entropy_bound,
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
    request_class = CanvasRequest
    families = ("diffusion_gemma",)
    budgets_prompt_tokens = False  # it schedules whole canvases; its budget is checked per request
    samples_in_graph = False  # its runner replays graphs of the decoder pass; the canvas rule runs eagerly after
    runner_follows_ranks = True  # the workers repeat the encoder and decoder passes; rank 0 alone runs the rule

    def normalize(self, config: Config) -> None:
        """Block and page are the checkpoint's canvas, the running set one canvas. The checkpoint's own sampler
        settings replace the defaults (a value the user changed is kept)."""
        canvas = config.model_config_dict.get("canvas_length", config.family.canvas_size)
        reason = f"diffusion_gemma denoises one {canvas}-token canvas at a time"
        for name in ("block_size", "page_size"):
            if getattr(config, name) == config.family.canvas_size:  # the family's default: no user choice to warn of
                setattr(config, name, canvas)
            force_setting(config, name, canvas, reason)
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

    def continues_steps(self, config: Config) -> bool:
        """Its runner continues a denoising step itself from the states the step before proposes
        (`CanvasRunner.launch_continuation`), where no canvas can end at that step."""
        return self.continues_on_device

    def make_runner(self, context: RunnerContext) -> StepRunner:
        settings = CanvasRunnerSettings(
            device=context.device,
            kv_dtype=context.dtype,
            page_size=context.page_size,
            vocab_limit=context.vocab_limit,
            base_seed=context.base_seed,
            schedule=context.options.schedule,
            graph_buckets=default_graph_buckets(context.device, context.enforce_eager),
        )
        return CanvasRunner(settings, context.model)


register_strategy(DiffusionGemma())
