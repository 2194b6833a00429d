"""One DiffusionGemma denoising step of one canvas, written plainly: the yardstick the strategy's batched rule
(`diffulex.strategy.diffusion_gemma.canvas.denoise_canvases`) is held to, token for token, at every temperature.

It is the rule of docs/strategies.md ("DiffusionGemma") for a single canvas, reading the device on the host
wherever that is the plain way to write it (the stability check, the mean entropy, `torch.multinomial`'s own
checks); tests/strategy/test_diffusion_gemma_canvas.py holds it to the pieces of transformers' generation loop.
`per_request_launch` is the engine step around it: the runner's launch with the rule run request by request.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffulex.errors import RequestFailure
from diffulex.sampler.rows import PendingWrites
from diffulex.strategy.diffusion_gemma.canvas import (
    CanvasSchedule,
    CanvasState,
    CanvasStep,
    entropy_bound_acceptance,
    fresh_state,
    step_generator,
    token_entropy,
)
from diffulex.strategy.diffusion_gemma.request import CanvasRequest
from diffulex.strategy.diffusion_gemma.runner import CanvasRunner


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


@torch.inference_mode()
def per_request_launch(runner: CanvasRunner, batch: list[CanvasRequest], micro_batch: int = 0) -> PendingWrites:
    """`CanvasRunner.launch` with the canvas rule run request by request (`denoise_canvas`), each outcome read on
    the host at once: the engine step the batched rule must reproduce token for token. Install it on a runner
    with ``runner.launch = types.MethodType(per_request_launch, runner)``."""
    s, model = runner.settings, runner.model
    runner._encode_missing(batch)
    states = [
        req.canvas
        if req.canvas is not None
        else fresh_state(runner._seed(req), req.canvases_done, req.canvas_length, s.vocab_limit, s.device)
        for req in batch
    ]
    canvas_ids = torch.stack([state.tokens for state in states])
    dtype = model.model.decoder.embed_tokens.weight.dtype
    soft = None
    if any(state.soft_embeds is not None for state in states):
        zeros = torch.zeros(model.config.canvas_length, model.config.hidden_size, dtype=dtype, device=s.device)
        soft = torch.stack([zeros if state.soft_embeds is None else state.soft_embeds for state in states])
    hidden = runner.decode(canvas_ids, soft, [req.encoded_len for req in batch], [req.page_table for req in batch])
    writes: dict[int, list[tuple[int, int]]] = {}
    group = runner._logits_group_size(len(batch))
    for first in range(0, len(batch), group):
        logits = model.logits(hidden[first : first + group])
        for offset, req in enumerate(batch[first : first + group]):
            try:
                step = denoise_canvas(
                    logits[offset], states[first + offset], s.schedule, req.sampling_params.temperature,
                    s.vocab_limit, runner._seed(req),
                    soft_embeddings=lambda scaled: model.soft_embeddings(scaled.to(dtype)),
                    token_soft_embeddings=model.token_soft_embeddings,
                )  # fmt: skip
            except RuntimeError as err:
                raise RequestFailure([req.req_id], f"denoising its canvas failed: {err}") from err
            req.proposed = step
            writes[req.req_id] = list(enumerate(step.argmax.tolist(), req.running[0].start))
    return PendingWrites(writes)
