"""The rule of one DiffusionGemma denoising step, written for one canvas
(`diffulex.testing.diffusion_gemma_canvas_reference`, from the pieces of `diffulex.strategy.diffusion_gemma.canvas`),
against the pieces of transformers' generation loop it restates: the temperature schedule, the entropy-bound
acceptance and the stable-and-confident stopping criterion, on random logits. The strategy's batched rule is held
to it in test_diffusion_gemma_canvas_batch.py."""

from __future__ import annotations

import pytest
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from diffulex.strategy.diffusion_gemma import DiffusionGemmaOptions
from diffulex.strategy.diffusion_gemma.canvas import (
    CanvasSchedule,
    entropy_bound_acceptance,
    fresh_state,
    initial_canvas,
    token_entropy,
)
from diffulex.testing.diffusion_gemma_canvas_reference import denoise_canvas

CANVAS, VOCAB = 16, 50


def schedule(**changes) -> CanvasSchedule:
    values = dict(max_steps=6, stability_threshold=2, confidence_threshold=0.5, t_min=0.4, t_max=0.8, entropy_bound=0.3)
    values.update(changes)
    return CanvasSchedule(**values)


def _no_soft(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x.shape[-2] if x.dim() > 1 else x.shape[0], 4)


def test_temperature_schedule_is_transformers_counted_down() -> None:
    """Step k of N divides by transformers' temperature at ``cur_step = N - k``: t_max first, never t_min."""
    s = schedule()
    processor = LinearTemperatureScheduleLogitsProcessor(s.t_min, s.t_max, s.max_steps)
    ones = torch.ones(1, 3, dtype=torch.float64)
    for step in range(s.max_steps):
        expected = 1.0 / float(processor(None, ones, s.max_steps - step)[0, 0])
        assert abs(s.temperature(step) - expected) < 1e-12
    assert s.temperature(0) == s.t_max and s.temperature(s.max_steps - 1) > s.t_min


def test_entropy_and_acceptance_equal_transformers_sampler() -> None:
    """Per-position entropy equals `Categorical.entropy`, and the accepted positions equal
    `EntropyBoundSampler.accept_canvas`'s for several bounds (the lowest-entropy position always accepted)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(CANVAS, VOCAB, generator=g) * 3
    entropy = token_entropy(logits)
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=logits).entropy())
    for bound in (0.05, 0.5, 3.0, 100.0):
        sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), CANVAS, VOCAB, 6)
        current = torch.zeros(1, CANVAS, dtype=torch.long)
        sampler.accept_canvas(current, current + 1, logits[None], 1)
        accepted = entropy_bound_acceptance(entropy, bound)
        assert torch.equal(accepted, sampler.accepted_token_mask[0])
        assert bool(accepted[entropy.argmin()])


def test_stopping_follows_transformers_stable_and_confident_criterion() -> None:
    """Over a run of argmax canvases (changing, then repeating) the canvas ends at the step where transformers'
    criterion first says stop (stability threshold 2: equal to each of the two argmaxes before)."""
    g = torch.Generator().manual_seed(1)
    sharp = torch.randn(CANVAS, VOCAB, generator=g)
    sharp[torch.arange(CANVAS), 3] = 40.0  # low entropy at any temperature here: confident
    s = schedule(max_steps=10, stability_threshold=2)
    criterion = StableAndConfidentStoppingCriteria(s.stability_threshold, s.confidence_threshold)
    state = fresh_state(seed=0, canvas=0, length=CANVAS, vocab_limit=VOCAB, device=torch.device("cpu"))
    for step in range(s.max_steps):
        logits = sharp.clone()
        if step < 2:  # the first two steps predict something else at position 0
            logits[0, 10 + step] = 80.0
        result = denoise_canvas(logits, state, s, 0.0, VOCAB, 0, _no_soft, _no_soft)
        scaled = logits / s.temperature(step)
        expected = bool(criterion(scaled.argmax(-1)[None], scaled[None])[0])
        assert result.finished == expected, f"step {step}"
        state = result.state
        if result.finished:
            break
    assert step == 4  # argmaxes a, b, c, c, c: the third c is the first equal to the two before it


def test_temperature_zero_accepts_every_argmax_and_self_conditions_on_it() -> None:
    """The greedy limit: the next canvas is the argmax, the next step's self-conditioning is the argmax tokens'
    soft embedding, and only ids below ``vocab_limit`` are ever chosen."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(CANVAS, VOCAB, generator=g)
    logits[:, VOCAB - 5 :] += 100.0  # padding rows would win: they are banned
    state = fresh_state(seed=3, canvas=0, length=CANVAS, vocab_limit=VOCAB - 5, device=torch.device("cpu"))
    seen = []
    result = denoise_canvas(logits, state, schedule(), 0.0, VOCAB - 5, 3, _no_soft, lambda t: seen.append(t) or t)
    expected = logits[:, : VOCAB - 5].argmax(-1)
    assert torch.equal(result.argmax, expected) and torch.equal(result.state.tokens, expected)
    assert torch.equal(seen[0], expected) and not result.finished and result.mean_entropy == 0.0


def test_sampled_step_draws_from_the_request_stream_and_renoises_below_the_limit() -> None:
    """At temperature > 0 the same seed gives the same canvas, accepted positions hold draws and the others fresh
    noise, all below ``vocab_limit``; initial canvases differ per canvas index."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(CANVAS, VOCAB, generator=g) * 2
    limit = VOCAB - 5
    state = fresh_state(seed=5, canvas=1, length=CANVAS, vocab_limit=limit, device=torch.device("cpu"))
    one = denoise_canvas(logits, state, schedule(), 1.0, limit, 5, _no_soft, _no_soft)
    two = denoise_canvas(logits, state, schedule(), 1.0, limit, 5, _no_soft, _no_soft)
    other = denoise_canvas(logits, state, schedule(), 1.0, limit, 6, _no_soft, _no_soft)
    assert torch.equal(one.state.tokens, two.state.tokens)
    assert not torch.equal(one.state.tokens, other.state.tokens)
    assert int(one.state.tokens.max()) < limit
    cpu = torch.device("cpu")
    assert not torch.equal(initial_canvas(5, 0, CANVAS, limit, cpu), initial_canvas(5, 1, CANVAS, limit, cpu))


def test_a_schedule_at_zero_is_the_greedy_limit() -> None:
    """With ``t_max = t_min = 0`` every step's temperature is 0: a request at temperature 1 denoises exactly as
    one at temperature 0 (no division by zero, no draw)."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(CANVAS, VOCAB, generator=g)
    state = fresh_state(seed=7, canvas=0, length=CANVAS, vocab_limit=VOCAB, device=torch.device("cpu"))
    cold = schedule(t_min=0.0, t_max=0.0)
    sampled = denoise_canvas(logits, state, cold, 1.0, VOCAB, 7, _no_soft, lambda t: t)
    greedy = denoise_canvas(logits, state, schedule(), 0.0, VOCAB, 7, _no_soft, lambda t: t)
    assert torch.equal(sampled.state.tokens, greedy.state.tokens) and sampled.mean_entropy == 0.0


def test_negative_schedule_temperatures_are_refused_by_name() -> None:
    for name in ("diffusion_gemma_t_min", "diffusion_gemma_t_max"):
        with pytest.raises(ValueError, match=f"{name}=-0.5 is invalid"):
            DiffusionGemmaOptions(**{name: -0.5})
