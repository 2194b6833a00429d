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
from typing import TYPE_CHECKING

import torch

from diffulex.layers.dispatch import triton_available

if TYPE_CHECKING:
    from diffulex.kernels.canvas_sampling import RowStatistics

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


def torch_sample_canvas(
    scaled: torch.Tensor, generator: torch.Generator, probs_dtype: torch.dtype | None
) -> CanvasDraw:
    """A sampled canvas's step in PyTorch, the one-canvas rule's operations: about twenty float32 passes over the
    logits."""
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
    """`torch_sample_canvas` in two passes over the logits (`diffulex.kernels.canvas_sampling`): each row's maximum,
    normalizer and entropy (and those of the logits rounded to ``probs_dtype``), then the draw from the same
    exponential race as `draw_categorical`'s, with the probabilities written once in ``probs_dtype``. Within
    float32 rounding of `torch_sample_canvas`: the sums run in another order."""
    probs = None if probs_dtype is None else torch.empty(scaled.shape, dtype=probs_dtype, device=scaled.device)
    stats, drawn, finite = fused_sample_rows(scaled, [generator], probs)
    return CanvasDraw(stats.entropy, drawn, finite.all(), probs)


def fused_sample_rows(
    scaled: torch.Tensor, generators: Sequence[torch.Generator], probs_out: torch.Tensor | None
) -> tuple[RowStatistics, torch.Tensor, torch.Tensor]:
    """The fused passes over the rows of several canvases at once, ``scaled [n * C, vocab]`` (canvas ``i``'s rows
    ``i * C`` to ``(i + 1) * C``): canvas ``i``'s exponential race drawn from ``generators[i]`` as `draw_categorical`
    draws it for that canvas alone, then one launch of each pass over every row. Each row is one program of
    either pass, so a row's numbers do not depend on the rows launched beside it. With ``probs_out`` (``[n * C,
    vocab]``) the self-conditioning probabilities are written there, in its dtype. Returns the rows' statistics
    (`diffulex.kernels.canvas_sampling.RowStatistics`), draws and finiteness flags."""
    from diffulex.kernels.canvas_sampling import draw_and_probs, row_statistics

    rows_per_canvas = scaled.shape[0] // len(generators)
    race = torch.empty_like(scaled)
    for i, generator in enumerate(generators):
        race[i * rows_per_canvas : (i + 1) * rows_per_canvas].exponential_(1.0, generator=generator)
    stats = row_statistics(scaled, None if probs_out is None else probs_out.dtype)
    drawn, finite = draw_and_probs(scaled, race, stats, probs_out)
    return stats, drawn, finite


# Rows of one self-conditioning product (``probs @ E``) on the fused path: the canvases of a step are taken
# together up to this many rows and a launch holding fewer is padded with zero rows, so that every canvas's product
# has the same GEMM shape in any group (its numbers alone, bit for bit) while a step of many short canvases reads
# the embedding matrix once per this many rows instead of once per canvas (32 canvases of 16 rows: 7.2 of a 39 ms
# step on an H200). A canvas of this many rows or more takes a launch of its own, as before.
SOFT_PRODUCT_ROWS = 128


def canvases_per_product(length: int) -> int:
    """Canvases of ``length`` rows whose self-conditioning products share one launch on the fused path."""
    return max(1, SOFT_PRODUCT_ROWS // length)


@dataclass(frozen=True)
class SampledCanvas:
    """What a sampled canvas's step takes from its scaled logits: each position's entropy and draw, whether every
    row was a distribution to draw from, and (unless the canvas ends) its next step's self-conditioning input."""

    entropy: torch.Tensor  # [C] float32
    drawn: torch.Tensor  # [C] int64
    drawable: torch.Tensor  # 0-dim bool
    soft_embeds: torch.Tensor | None  # [C, hidden]


def sample_canvases(
    logits: torch.Tensor,
    members: Sequence[int],
    generators: Sequence[torch.Generator],
    goes_on: Sequence[bool],
    probs_dtype: torch.dtype,
    soft_embeddings: Callable[[torch.Tensor], torch.Tensor],
    fused: bool,
) -> list[SampledCanvas]:
    """The sampled canvases ``logits[members]`` (scaled, ``[G, C, vocab]``), member ``i`` drawing from
    ``generators[i]`` and, where ``goes_on[i]``, getting its self-conditioning input (``soft_embeddings`` of its
    probabilities in ``probs_dtype``). ``fused`` (`denoise_canvases` takes it on a GPU with Triton): the canvases go
    through the fused passes and the product `canvases_per_product` at a time; else one at a time through the
    PyTorch code (the reference)."""
    if not fused:
        sampled = []
        for b, generator, wanted in zip(members, generators, goes_on, strict=True):
            draw = torch_sample_canvas(logits[b], generator, probs_dtype if wanted else None)
            soft = None if draw.probs is None else soft_embeddings(draw.probs[None])[0]
            sampled.append(SampledCanvas(draw.entropy, draw.drawn, draw.drawable, soft))
        return sampled
    length = logits.shape[1]
    per_launch = canvases_per_product(length)
    sampled = []
    for first in range(0, len(members), per_launch):
        part = list(members[first : first + per_launch])
        wanted = list(goes_on[first : first + per_launch])
        sampled += _fused_sample_part(logits, part, generators[first : first + per_launch], wanted, probs_dtype,
                                      soft_embeddings, per_launch)  # fmt: skip
    return sampled


def _fused_sample_part(
    logits: torch.Tensor,
    part: list[int],
    generators: Sequence[torch.Generator],
    goes_on: list[bool],
    probs_dtype: torch.dtype,
    soft_embeddings: Callable[[torch.Tensor], torch.Tensor],
    per_launch: int,
) -> list[SampledCanvas]:
    """`sample_canvases` for at most ``per_launch`` canvases: one launch of each fused pass over their rows and
    (when one goes on) one self-conditioning product over ``per_launch`` canvases' rows, the unused ones zero."""
    n, length, vocab = len(part), logits.shape[1], logits.shape[2]
    if part == list(range(part[0], part[0] + n)):
        rows = logits[part[0] : part[0] + n].view(n * length, vocab)
    else:  # greedy canvases between them: their rows gathered (a copy)
        rows = logits[part].view(n * length, vocab)
    padded = None
    if any(goes_on):
        padded = torch.empty(per_launch * length, vocab, dtype=probs_dtype, device=logits.device)
        padded[n * length :].zero_()
    stats, drawn, finite = fused_sample_rows(rows, generators, None if padded is None else padded[: n * length])
    soft = None if padded is None else soft_embeddings(padded[None])[0]
    return [
        SampledCanvas(
            stats.entropy[i * length : (i + 1) * length], drawn[i * length : (i + 1) * length],
            finite[i * length : (i + 1) * length].all(),
            soft[i * length : (i + 1) * length] if soft is not None and goes_on[i] else None,
        )
        for i in range(n)
    ]  # fmt: skip


def accept_sampled(
    draws: Sequence[SampledCanvas], generators: Sequence[torch.Generator], vocab_limit: int, bound: float, fused: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sampled canvas's next input tokens and mean entropy: its draws where the entropy bound accepts them,
    fresh noise elsewhere (the generator's next numbers after its race, as in the one-canvas rule). ``fused``: the
    acceptance of every canvas in one launch (`diffulex.kernels.canvas_acceptance`, its sums within float32 rounding of
    the sorted running sum), else canvas by canvas in PyTorch (the reference)."""
    if not draws:
        return []
    length, device = draws[0].drawn.shape[0], draws[0].drawn.device
    noise = torch.empty(len(draws), length, dtype=torch.long, device=device)
    for row, generator in zip(noise, generators, strict=True):
        torch.randint(0, vocab_limit, (length,), generator=generator, device=device, out=row)
    if not fused:
        return [
            (torch.where(entropy_bound_acceptance(draw.entropy, bound), draw.drawn, row), draw.entropy.mean())
            for draw, row in zip(draws, noise, strict=True)
        ]
    from diffulex.kernels.canvas_acceptance import accept_canvases

    entropy = torch.stack([draw.entropy for draw in draws])
    tokens, means = accept_canvases(entropy, torch.stack([draw.drawn for draw in draws]), noise, bound)
    return list(zip(tokens, means, strict=True))


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
    canvas (docs/strategies.md; on a GPU its sampled canvases take the fused two-pass kernels, within float32
    rounding of it): what one row computes alone whatever the rows beside it runs once for the group (the ban, the
    argmax, the stability check, the one-hot self-conditioning, the fused passes over the sampled rows); what torch
    rounds differently with the number of rows it is launched over runs per canvas, with that canvas's shapes (on
    the PyTorch path the reductions over the vocabulary and over the canvas, whose split over thread blocks follows
    the row count), or one program a canvas (on the fused path the acceptance and mean over the canvas:
    `accept_sampled`), or in launches of one fixed shape (the self-conditioning product, whose GEMM algorithm follows
    the row count: `SOFT_PRODUCT_ROWS`), and the draws come from each canvas's own generator.

    ``soft_embeddings(probs [1, rows, vocab]) -> [1, rows, hidden]`` (probabilities in ``probs_dtype``, the model's:
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
    sampled = [b for b, scale in enumerate(scales) if scale != 0.0]
    generators = [step_generator(seeds[b], states[b].index, states[b].steps, device) for b in sampled]
    fused = logits.is_cuda and triton_available()
    draws = sample_canvases(logits, sampled, generators, [not last[b] for b in sampled], probs_dtype,
                            soft_embeddings, fused=fused)  # fmt: skip
    accepted = accept_sampled(draws, generators, vocab_limit, schedule.entropy_bound, fused)
    slot = {b: i for i, b in enumerate(sampled)}  # a sampled canvas's place among the draws
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
            draw = draws[slot[b]]
            tokens, mean = accepted[slot[b]]
            means.append(mean)
            valid.append(draw.drawable)
            soft = draw.soft_embeds
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
        history = torch.stack([entry for state in states for entry in state.history])  # [G * threshold, C]
        return (history.view(len(states), threshold, -1) == argmax[:, None]).flatten(1).all(dim=1)
    never = torch.zeros((), dtype=torch.bool, device=argmax.device)
    return torch.stack([
        (torch.stack(state.history, dim=0) == argmax[b]).all() if is_full else never
        for b, (state, is_full) in enumerate(zip(states, full, strict=True))
    ])  # fmt: skip
