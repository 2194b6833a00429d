"""One DiffusionGemma denoising step of one canvas, as transformers' generation loop defines it
(`DiffusionGemmaGenerationMixin._denoising_step` with `EntropyBoundSampler`, `LinearTemperatureScheduleLogitsProcessor`
and `StableAndConfidentStoppingCriteria`), for every canvas of an engine step at once (`denoise_canvases`): canvases
of many requests share a forward and the rule's launches, while each keeps its own state and random streams, and
the host reads nothing until the step's result is applied (`diffulex.strategy.diffusion_gemma.pending`). The same
rule for one canvas, written plainly, is `diffulex.testing.diffusion_gemma_canvas_reference.denoise_canvas`.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from diffulex.layers.dispatch import triton_available

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


def step_generator(seed: int, canvas: int, stream: int, device: torch.device) -> torch.Generator:
    """The generator of one random stream of a request (`stream_seed`), on ``device``."""
    return torch.Generator(device=device).manual_seed(stream_seed(seed, canvas, stream))


def initial_canvas(seed: int, canvas: int, length: int, vocab_limit: int, device: torch.device) -> torch.Tensor:
    """Canvas ``canvas``'s starting tokens, uniform over ``[0, vocab_limit)``, from the request's ``seed``.

    Drawn on the CPU whatever the device (then moved there): a CUDA generator gives other numbers for the same seed,
    and a request's answer must not depend on the device it runs on."""
    generator = step_generator(seed, canvas, NOISE_STREAM, torch.device("cpu"))
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


def draw_categorical(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of ``probs [C, vocab]``: `torch.multinomial(probs, 1)`'s own method for a single draw (the
    exponential race, argmax of ``p / q`` with ``q ~ Exp(1)`` from ``generator``), so the same numbers and the same
    generator state after it, without its checks of the distribution, which wait for the device on the host
    (`drawable` checks the draws instead)."""
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.div(probs, race, out=race).argmax(dim=-1)


def drawable(probs: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """0-dim bool: every row of ``probs`` was a distribution `torch.multinomial` accepts. A softmax row with a
    non-finite logit is not a number throughout, and the argmax of the race then picks a NaN entry, so the drawn
    entries' probabilities tell, without reading the whole distribution again."""
    return torch.isfinite(probs.gather(-1, drawn[:, None])).all()


def self_conditioning_probs(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The next step's self-conditioning probabilities in the model dtype: the softmax (in float32) of the scaled
    logits rounded to the model dtype, as the model's `soft_embeddings` computes it from logits it is handed in
    its dtype."""
    return scaled.to(dtype).softmax(dim=-1, dtype=torch.float32).to(dtype)


@dataclass(frozen=True)
class CanvasDraw:
    """What a sampled canvas's step takes from its scaled logits: each position's entropy and draw, whether every
    row was a distribution to draw from, and (unless the canvas ends) its self-conditioning probabilities."""

    entropy: torch.Tensor  # [C] float32
    drawn: torch.Tensor  # [C] int64
    drawable: torch.Tensor  # 0-dim bool
    probs: torch.Tensor | None  # [C, vocab] in the model dtype


def sample_canvas(
    scaled: torch.Tensor, generator: torch.Generator, probs_dtype: torch.dtype | None
) -> CanvasDraw:
    """One sampled canvas's entropies, draws (from ``generator``, which it leaves where `draw_categorical` does)
    and, with a ``probs_dtype``, self-conditioning probabilities, from its scaled logits ``[C, vocab]``: on a GPU
    with Triton `fused_sample_canvas`, else the PyTorch code (`torch_sample_canvas`, the reference)."""
    if scaled.is_cuda and triton_available():
        return fused_sample_canvas(scaled, generator, probs_dtype)
    return torch_sample_canvas(scaled, generator, probs_dtype)


def torch_sample_canvas(
    scaled: torch.Tensor, generator: torch.Generator, probs_dtype: torch.dtype | None
) -> CanvasDraw:
    """`sample_canvas` in PyTorch, the one-canvas rule's operations: about twenty float32 passes over the logits."""
    entropy = token_entropy(scaled)
    probs = torch.softmax(scaled, dim=-1)
    drawn = draw_categorical(probs, generator)
    valid = drawable(probs, drawn)
    del probs
    soft_probs = None if probs_dtype is None else self_conditioning_probs(scaled, probs_dtype)
    return CanvasDraw(entropy, drawn, valid, soft_probs)


def fused_sample_canvas(
    scaled: torch.Tensor, generator: torch.Generator, probs_dtype: torch.dtype | None
) -> CanvasDraw:
    """`sample_canvas` in two passes over the logits (`diffulex.kernels.canvas_sampling`): each row's maximum,
    normalizer and entropy (and those of the logits rounded to ``probs_dtype``), then the draw from the same
    exponential race as `draw_categorical`'s, with the probabilities written once in ``probs_dtype``. Within
    float32 rounding of `torch_sample_canvas`: the sums run in another order."""
    from diffulex.kernels.canvas_sampling import draw_and_probs, row_statistics

    stats = row_statistics(scaled, probs_dtype)
    race = torch.empty_like(scaled).exponential_(1.0, generator=generator)
    probs = None if probs_dtype is None else torch.empty(scaled.shape, dtype=probs_dtype, device=scaled.device)
    drawn, finite = draw_and_probs(scaled, race, stats, probs)
    return CanvasDraw(stats.entropy, drawn, finite.all(), probs)


@dataclass(frozen=True)
class CanvasSteps:
    """One step of a group of canvases, on the device until the step's result is read; `resolve` turns canvas
    ``b`` into its `CanvasStep` once the host holds its ``settled`` flag and mean entropy."""

    states: list[CanvasState]  # each canvas's next state (its self-conditioning input unless `last`)
    argmax: torch.Tensor  # [G, C]
    settled: torch.Tensor  # [G] bool: stable and confident
    mean_entropy: torch.Tensor  # [G] float32; 0 at temperature 0
    drawable: torch.Tensor  # [G] bool: False where a sampled canvas's logits gave no distribution to draw from
    last: tuple[bool, ...]  # the step is the canvas's last of the schedule (known on the host)

    def resolve(self, b: int, settled: bool, mean_entropy: float) -> CanvasStep:
        finished = self.last[b] or settled
        state = self.states[b]
        if finished and state.soft_embeds is not None:  # computed before it was known; never read
            state = replace(state, soft_embeds=None)
        return CanvasStep(state, self.argmax[b], finished, mean_entropy)


def denoise_canvases(
    logits: torch.Tensor,
    states: Sequence[CanvasState],
    temperatures: Sequence[float],
    seeds: Sequence[int],
    schedule: CanvasSchedule,
    vocab_limit: int,
    soft_embeddings: Callable[[torch.Tensor], torch.Tensor],
    token_soft_embeddings: Callable[[torch.Tensor], torch.Tensor],
    probs_dtype: torch.dtype,
) -> CanvasSteps:
    """One step of every canvas of a group from their decoder logits ``[G, C, vocab]`` (float32, soft-capped;
    overwritten: banned ids and each canvas's temperature applied in place); canvas ``b`` is at ``states[b]``, of a
    request with temperature ``temperatures[b]`` (which multiplies the schedule's; 0 is the greedy limit) and
    random streams of ``seeds[b]``.

    Nothing is read on the host, so the host queues the whole step without waiting for the device. Each canvas gets
    the numbers it would get in a group of its own, bit for bit, and on the CPU those of the rule written for one
    canvas (docs/strategies.md; on a GPU its sampled canvases take `sample_canvas`'s two-pass kernels, within
    float32 rounding of it): what one row computes alone whatever the rows beside it runs once for the group (the
    ban, the argmax, the stability check, the one-hot self-conditioning); what torch rounds differently with the
    number of rows it is launched over runs per canvas, with that canvas's shapes (the reductions over the
    vocabulary and over the canvas, whose split over thread blocks follows the row count, and the
    self-conditioning product, whose GEMM algorithm does), and so do the draws from each canvas's own generator.

    ``soft_embeddings(probs [1, C, vocab]) -> [1, C, hidden]`` (probabilities in ``probs_dtype``, the model's:
    `self_conditioning_probs`) and ``token_soft_embeddings(tokens [..., C])`` are the model's, for the next step's
    self-conditioning input; it is computed for every canvas that may go on (all but those at their schedule's
    last step), since whether one settled is known only when the step is read."""
    _, length, vocab = logits.shape
    device = logits.device
    if vocab_limit < vocab:
        logits[:, :, vocab_limit:] = float("-inf")
    scales = [t * schedule.temperature(state.steps) for t, state in zip(temperatures, states, strict=True)]
    for b, scale in enumerate(scales):
        if scale != 0.0:
            logits[b].div_(scale)  # the kernel of the one-canvas rule's ``logits / temperature``
    argmax = logits.argmax(dim=-1)
    last = tuple(state.steps + 1 >= schedule.max_steps for state in states)
    one_hot_soft = None
    if any(scale == 0.0 and not end for scale, end in zip(scales, last, strict=True)):
        one_hot_soft = token_soft_embeddings(argmax)
    zero, yes = torch.zeros((), device=device), torch.ones((), dtype=torch.bool, device=device)
    means, valid, next_states = [], [], []
    for b, (state, scale) in enumerate(zip(states, scales, strict=True)):
        soft = None
        if scale == 0.0:
            means.append(zero)
            valid.append(yes)
            tokens = argmax[b]
            if not last[b]:
                soft = one_hot_soft[b]
        else:
            generator = step_generator(seeds[b], state.index, state.steps, device)
            draw = sample_canvas(logits[b], generator, None if last[b] else probs_dtype)
            means.append(draw.entropy.mean())
            valid.append(draw.drawable)
            noise = torch.randint(0, vocab_limit, (length,), generator=generator, device=device)
            tokens = torch.where(entropy_bound_acceptance(draw.entropy, schedule.entropy_bound), draw.drawn, noise)
            if draw.probs is not None:
                soft = soft_embeddings(draw.probs[None])[0]
        history = (*state.history, argmax[b])[-schedule.stability_threshold :]
        next_states.append(CanvasState(state.index, tokens, soft, history, state.steps + 1))
    mean_entropy = torch.stack(means)
    # in float64, as the host compares the float32 mean with the threshold (a float32 threshold rounds)
    confident = mean_entropy.double() < schedule.confidence_threshold
    settled = stable_canvases(states, argmax, schedule.stability_threshold) & confident
    return CanvasSteps(next_states, argmax, settled, mean_entropy, torch.stack(valid), last)


def stable_canvases(states: Sequence[CanvasState], argmax: torch.Tensor, threshold: int) -> torch.Tensor:
    """``[G]`` bool: canvas ``b``'s argmax equals each of the ``threshold`` argmaxes before it (never before it has
    had that many steps)."""
    full = [len(state.history) == threshold for state in states]
    if not any(full):
        return torch.zeros(len(states), dtype=torch.bool, device=argmax.device)
    if all(full):
        history = torch.stack([torch.stack(state.history, dim=0) for state in states])  # [G, threshold, C]
        return (history == argmax[:, None]).flatten(1).all(dim=1)
    never = torch.zeros((), dtype=torch.bool, device=argmax.device)
    return torch.stack([
        (torch.stack(state.history, dim=0) == argmax[b]).all() if is_full else never
        for b, (state, is_full) in enumerate(zip(states, full, strict=True))
    ])  # fmt: skip
