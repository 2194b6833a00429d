"""DiffusionGemma's generation algorithm at temperature 0, written plainly over `DiffusionGemmaForDiffusionLM`:
the yardstick the engine's ``diffusion_gemma`` strategy and transformers' own loop are compared against.

Canvases are produced one after another. The prompt, then each finished canvas, is encoded; a canvas starts from
given noise tokens and is denoised step by step. At temperature 0 every position's distribution is one-hot at its
argmax, so (as the limit of transformers' entropy-bound sampler) every position is accepted with its argmax, nothing
is re-noised, each step's entropy is 0 (always "confident"), and the next step is self-conditioned on that one-hot
prediction. A canvas stops when its argmax equals the argmax of each of the ``stability_threshold`` steps before
it, or after ``max_denoising_steps`` steps. After each canvas, a row that produced a stop token keeps the tokens up
to and including the first one and gets ``pad_token_id`` after it (and in every later canvas); generation ends when
every row has stopped or ``ceil(max_new_tokens / canvas_length)`` canvases are done. With ``vocab_limit`` the ids
at or above it are never predicted (their logits are ``-inf``), as the engine treats the embedding's padding rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from diffulex.models.diffusion_gemma import DiffusionGemmaForDiffusionLM


def one_hot_logits(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits whose softmax is exactly one-hot at ``tokens``: 0 there, ``-inf`` elsewhere."""
    logits = torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device)
    return logits.scatter_(-1, tokens[..., None], 0.0)


@dataclass(frozen=True)
class GreedyGeneration:
    """``tokens [B, prompt + canvases * canvas_length]`` (prompt included, as transformers returns them) and,
    per canvas, the number of denoising steps each row ran before it stopped."""

    tokens: torch.Tensor
    steps: list[list[int]]


def greedy_generate(
    model: DiffusionGemmaForDiffusionLM,
    prompt_ids: torch.Tensor,
    canvas_noise: list[torch.Tensor],
    max_new_tokens: int,
    max_denoising_steps: int,
    stability_threshold: int,
    stop_token_ids: tuple[int, ...],
    pad_token_id: int,
    vocab_limit: int | None = None,
) -> GreedyGeneration:
    """Temperature-0 generation; ``canvas_noise[c] [B, canvas_length]`` is canvas ``c``'s starting tokens."""
    canvas_length = model.config.canvas_length
    num_canvases = math.ceil(max_new_tokens / canvas_length)
    if len(canvas_noise) < num_canvases:
        raise ValueError(f"canvas_noise holds {len(canvas_noise)} canvases; {num_canvases} may be needed")
    batch = prompt_ids.shape[0]
    stops = torch.tensor(stop_token_ids, dtype=torch.long, device=prompt_ids.device)
    tokens = prompt_ids
    context = model.encode(prompt_ids)
    stopped = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    steps: list[list[int]] = []
    for index in range(num_canvases):
        if index > 0:
            context = model.encode(tokens[:, -canvas_length:], context)
        canvas, canvas_steps = _denoise(
            model, context, canvas_noise[index], max_denoising_steps, stability_threshold, vocab_limit
        )
        steps.append(canvas_steps)
        canvas = torch.where(stopped[:, None], torch.full_like(canvas, pad_token_id), canvas)
        is_stop = torch.isin(canvas, stops)
        after_first_stop = is_stop.cumsum(dim=-1) - is_stop.long() > 0
        canvas = torch.where(after_first_stop & ~stopped[:, None], torch.full_like(canvas, pad_token_id), canvas)
        stopped |= is_stop.any(dim=-1)
        tokens = torch.cat([tokens, canvas], dim=-1)
        if bool(stopped.all()):
            break
    return GreedyGeneration(tokens, steps)


def _denoise(
    model: DiffusionGemmaForDiffusionLM,
    context: object,
    noise: torch.Tensor,
    max_steps: int,
    stability_threshold: int,
    vocab_limit: int | None,
) -> tuple[torch.Tensor, list[int]]:
    """One canvas: ``(argmax canvas, steps per row)``; a row that has stopped keeps its canvas while others go on."""
    batch = noise.shape[0]
    canvas = noise
    previous = None
    history: list[torch.Tensor] = []
    done = torch.zeros(batch, dtype=torch.bool, device=noise.device)
    steps = [0] * batch
    for _ in range(max_steps):
        logits = model.denoise_step(canvas, context, previous)  # type: ignore[arg-type]
        if vocab_limit is not None:
            logits[..., vocab_limit:] = float("-inf")
        argmax = torch.where(done[:, None], canvas, logits.argmax(dim=-1))
        recent = history[-stability_threshold:] if stability_threshold else []
        stable = torch.ones(batch, dtype=torch.bool, device=noise.device)
        if len(recent) < stability_threshold:
            stable[:] = False
        for earlier in recent:
            stable &= (earlier == argmax).all(dim=-1)
        for row in range(batch):
            steps[row] += int(not done[row])
        history.append(argmax)
        sc = one_hot_logits(argmax, model.config.vocab_size)
        previous = sc if previous is None else torch.where(done[:, None, None], previous, sc)
        canvas = argmax
        done |= stable
        if bool(done.all()):
            break
    return canvas, steps
