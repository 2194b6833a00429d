"""One DiffusionGemma denoising step of one canvas, written plainly: the yardstick the strategy's batched rule
(`diffulex.strategy.diffusion_gemma.canvas.denoise_canvases`) is held to, token for token, at every temperature.

It is the rule of docs/strategies.md ("DiffusionGemma") for a single canvas, reading the device on the host
wherever that is the plain way to write it (the stability check, the mean entropy, `torch.multinomial`'s own
checks); tests/strategy/test_diffusion_gemma_canvas.py holds it to the pieces of transformers' generation loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffulex.strategy.diffusion_gemma.canvas import (
    CanvasSchedule,
    CanvasState,
    CanvasStep,
    entropy_bound_acceptance,
    step_generator,
    token_entropy,
)


def is_stable(history: tuple[torch.Tensor, ...], argmax: torch.Tensor, threshold: int) -> bool:
    return len(history) == threshold and all(bool(torch.equal(earlier, argmax)) for earlier in history)


def denoise_canvas(
    logits: torch.Tensor,
    state: CanvasState,
    schedule: CanvasSchedule,
    temperature: float,
    vocab_limit: int,
    seed: int,
    soft_embeddings: Callable[[torch.Tensor], torch.Tensor],
    token_soft_embeddings: Callable[[torch.Tensor], torch.Tensor],
) -> CanvasStep:
    """One step of one canvas from its decoder logits ``[C, vocab]`` (float32, soft-capped); ``temperature`` is
    the request's, which multiplies the schedule's (a product of 0 is the greedy limit).

    ``soft_embeddings(logits [1, C, vocab]) -> [1, C, hidden]`` and ``token_soft_embeddings(tokens [C])`` are the
    model's, for the next step's self-conditioning input."""
    if vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    step = state.steps
    temperature = temperature * schedule.temperature(step)
    if temperature == 0.0:
        argmax = logits.argmax(dim=-1)
        tokens, mean_entropy, confident = argmax, 0.0, schedule.confidence_threshold > 0.0
        soft = None
    else:
        scaled = logits / temperature
        entropy = token_entropy(scaled)
        mean_entropy = float(entropy.mean())
        confident = mean_entropy < schedule.confidence_threshold
        argmax = scaled.argmax(dim=-1)
        generator = step_generator(seed, state.index, step, logits.device)
        probs = torch.softmax(scaled, dim=-1)
        drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        noise = torch.randint(0, vocab_limit, drawn.shape, generator=generator, device=logits.device)
        tokens = torch.where(entropy_bound_acceptance(entropy, schedule.entropy_bound), drawn, noise)
        soft = scaled
    stable = is_stable(state.history, argmax, schedule.stability_threshold)
    finished = (stable and confident) or step + 1 >= schedule.max_steps
    kept = schedule.stability_threshold
    history = (*state.history, argmax)[-kept:] if kept else ()
    if finished:
        next_soft = None
    elif soft is None:
        next_soft = token_soft_embeddings(argmax)
    else:
        next_soft = soft_embeddings(soft[None])[0]
    return CanvasStep(CanvasState(state.index, tokens, next_soft, history, step + 1), argmax, finished, mean_entropy)
