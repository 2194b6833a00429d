"""One DiffusionGemma denoising step of one canvas, as transformers' generation loop defines it
(`DiffusionGemmaGenerationMixin._denoising_step` with `EntropyBoundSampler`, `LinearTemperatureScheduleLogitsProcessor`
and `StableAndConfidentStoppingCriteria`), written per request so that canvases of many requests share a forward
while each keeps its own state and random stream.

A canvas starts from uniformly random tokens and is denoised for at most ``max_denoising_steps`` (N) steps. Step
``k`` (0-based) divides the logits by ``T_k = t_min + (t_max - t_min) * (N - k) / N`` (``t_max`` first, never
quite ``t_min``), times the request's temperature. Then:

* every position draws a token from ``softmax(logits / T_k)`` and has an entropy ``H``;
* the positions sorted by ``H`` are accepted while the sum of the entropies before them is at most
  ``entropy_bound``; accepted positions keep their draw, the others get fresh uniformly random tokens;
* the canvas is *stable* when its argmax equals each of the ``stability_threshold`` argmaxes before it, and
  *confident* when the mean ``H`` is below ``confidence_threshold``; stable and confident, or N steps done, ends
  the canvas, whose tokens are then that step's argmax;
* otherwise the next step is self-conditioned on ``softmax(logits / T_k)``.

At temperature 0 every distribution is one-hot at its argmax: every position is accepted with it, nothing is
re-noised, ``H = 0`` (confident whenever ``confidence_threshold > 0``) and the self-conditioning is one-hot: the
limit transformers approaches as ``T`` falls, and `diffulex.testing.diffusion_gemma_reference.greedy_generate`.

Token ids at or above ``vocab_limit`` (padding rows of the embedding, which the tokenizer cannot decode) are
never drawn, neither as noise nor from the logits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Stream index of a canvas's initial noise among its random streams (steps use 0, 1, ...).
NOISE_STREAM = -1


@dataclass(frozen=True)
class CanvasSchedule:
    """The options that shape one canvas's denoising (`DiffusionGemmaOptions`, under short names)."""

    max_steps: int
    stability_threshold: int
    confidence_threshold: float
    t_min: float
    t_max: float
    entropy_bound: float

    def temperature(self, step: int) -> float:
        """The schedule's temperature at 0-based ``step``: transformers counts its steps down from N to 1."""
        remaining = self.max_steps - step
        return self.t_min + (self.t_max - self.t_min) * remaining / self.max_steps


@dataclass(frozen=True)
class CanvasState:
    """A canvas between two steps: its input tokens, the self-conditioning input of its next step (None before
    the first), the argmaxes its stability is judged against (oldest first) and the steps done. Immutable: a step
    returns a new one, which the request adopts only when the step's result is applied."""

    index: int  # which canvas of the request (0: the first after the prompt)
    tokens: torch.Tensor  # [C] the next step's input canvas
    soft_embeds: torch.Tensor | None  # [C, hidden]
    history: tuple[torch.Tensor, ...]  # [C] argmaxes of the last `stability_threshold` steps
    steps: int


@dataclass(frozen=True)
class CanvasStep:
    """What one step did to a canvas: its state for the next step, the argmax (what a viewer is shown while the
    canvas is denoised, and its tokens once it ends) and whether it ended."""

    state: CanvasState
    argmax: torch.Tensor  # [C]
    finished: bool
    mean_entropy: float


def stream_seed(seed: int, canvas: int, stream: int) -> int:
    """The seed of one random stream of a request: its initial noise of a canvas, or one of its steps. Derived
    from the request's seed alone, so a request draws the same numbers in any batch and after a preemption."""
    digest = hashlib.blake2b(f"{seed}:{canvas}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(seed: int, canvas: int, stream: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(stream_seed(seed, canvas, stream))


def initial_canvas(seed: int, canvas: int, length: int, vocab_limit: int, device: torch.device) -> torch.Tensor:
    """Canvas ``canvas``'s starting tokens, uniform over ``[0, vocab_limit)``, from the request's ``seed``.

    Drawn on the CPU whatever the device (then moved there): a CUDA generator gives other numbers for the same seed,
    and a request's answer must not depend on the device it runs on."""
    generator = _generator(seed, canvas, NOISE_STREAM, torch.device("cpu"))
    return torch.randint(0, vocab_limit, (length,), generator=generator).to(device)


def fresh_state(seed: int, canvas: int, length: int, vocab_limit: int, device: torch.device) -> CanvasState:
    return CanvasState(canvas, initial_canvas(seed, canvas, length, vocab_limit, device), None, (), 0)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per row; ``-inf`` entries (banned ids) contribute 0."""
    log_probs = torch.log_softmax(logits, dim=-1)
    terms = torch.where(log_probs > float("-inf"), log_probs.exp() * log_probs, 0.0)
    return -terms.sum(dim=-1)


def entropy_bound_acceptance(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """``[C]`` bool: the positions sorted by entropy, each accepted while the entropies before it sum to at most
    ``bound`` (the lowest is always accepted)."""
    ordered, order = torch.sort(entropy, stable=True)
    before = torch.cumsum(ordered, dim=0) - ordered
    return torch.zeros_like(entropy, dtype=torch.bool).scatter(0, order, before <= bound)


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
        generator = _generator(seed, state.index, step, logits.device)
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
