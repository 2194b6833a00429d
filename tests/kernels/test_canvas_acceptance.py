"""DiffusionGemma's entropy-bound acceptance of every sampled canvas in one launch against the rule's torch code
(`diffulex.strategy.diffusion_gemma.canvas.entropy_bound_acceptance`, the mean entropy): on entropies whose sums are
exact in any order (multiples of 1/64) the same tokens and means; on any entropies each canvas gets the numbers it
gets alone."""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.canvas_acceptance import accept_canvases
from diffulex.strategy.diffusion_gemma.canvas import entropy_bound_acceptance
from tests.kernels.test_fused_norm import DEVICE


def canvases(n: int, length: int, seed: int, exact: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropies (with ties, zeros among them), draws and noise of ``n`` canvases."""
    gen = torch.Generator().manual_seed(seed)
    if exact:
        entropy = torch.randint(0, 48, (n, length), generator=gen).float() / 64
    else:
        entropy = torch.rand(n, length, generator=gen) * 0.7
        entropy[:, 1], entropy[:, 7] = entropy[:, 0], entropy[:, 3]  # ties
    drawn = torch.randint(0, 1000, (n, length), generator=gen)
    noise = torch.randint(1000, 2000, (n, length), generator=gen)
    return entropy, drawn, noise


def torch_rule(entropy: torch.Tensor, drawn: torch.Tensor, noise: torch.Tensor, bound: float):
    tokens = torch.stack([torch.where(entropy_bound_acceptance(h, bound), d, z)
                          for h, d, z in zip(entropy, drawn, noise, strict=True)])  # fmt: skip
    return tokens, torch.stack([h.mean() for h in entropy])


@pytest.mark.parametrize("length", [16, 48, 256])
@pytest.mark.parametrize("bound", [0.0, 0.1, 2.5, 1e9])
def test_the_tokens_and_means_are_the_rules(length: int, bound: float) -> None:
    """Lengths under, between and at powers of two; a bound that takes only the lowest entropies (and its ties at
    0), a few, many, and every position."""
    entropy, drawn, noise = canvases(5, length, seed=length, exact=True)
    tokens, means = accept_canvases(entropy.to(DEVICE), drawn.to(DEVICE), noise.to(DEVICE), bound)
    want_tokens, want_means = torch_rule(entropy, drawn, noise, bound)
    assert torch.equal(tokens.cpu(), want_tokens)
    # the sums are exact; the division by the length rounds once (torch's CUDA mean may multiply by its reciprocal)
    torch.testing.assert_close(means.cpu(), want_means, rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    accepted = (tokens.cpu() < 1000).sum(dim=1)
    assert (accepted >= 1).all(), "the lowest entropy is always accepted"
    if bound == 1e9:
        assert (accepted == length).all()


def test_a_canvas_gets_the_numbers_it_gets_alone() -> None:
    """Entropies of any value (sums that round): each canvas of a launch of six equals its launch alone, bit for
    bit, and the rule's tokens (no partial sum lands within rounding of the bound here), means within rounding."""
    entropy, drawn, noise = (t.to(DEVICE) for t in canvases(6, 48, seed=3, exact=False))
    tokens, means = accept_canvases(entropy, drawn, noise, 0.9)
    for b in range(6):
        alone_tokens, alone_means = accept_canvases(entropy[b : b + 1].contiguous(), drawn[b : b + 1].contiguous(),
                                                    noise[b : b + 1].contiguous(), 0.9)  # fmt: skip
        assert torch.equal(tokens[b], alone_tokens[0]) and torch.equal(means[b], alone_means[0])
    want_tokens, want_means = torch_rule(entropy.cpu(), drawn.cpu(), noise.cpu(), 0.9)
    assert torch.equal(tokens.cpu(), want_tokens)
    torch.testing.assert_close(means.cpu(), want_means, rtol=1e-6, atol=0)


def test_no_canvases() -> None:
    empty = torch.empty(0, 16, device=DEVICE)
    tokens, means = accept_canvases(empty, empty.long(), empty.long(), 0.1)
    assert tokens.shape == (0, 16) and means.shape == (0,)


def test_bad_arguments_are_refused_by_name() -> None:
    entropy, drawn, noise = canvases(2, 16, seed=0, exact=True)
    with pytest.raises(ValueError, match="entropy must be a contiguous"):
        accept_canvases(entropy.double(), drawn, noise, 0.1)
    with pytest.raises(ValueError, match="noise must be a contiguous int64 tensor of entropy's shape"):
        accept_canvases(entropy, drawn, noise[:, :8], 0.1)
    with pytest.raises(ValueError, match="drawn must be"):
        accept_canvases(entropy, drawn.int(), noise, 0.1)


def test_the_fused_acceptance_of_a_step_gives_the_reference_tokens_and_noise() -> None:
    """`accept_sampled` (the canvas rule's step after the draws) on the fused path against the PyTorch one: each
    canvas's noise from its own generator after its race (the same numbers, and the generators in the same state
    after), the same tokens, the means within rounding."""
    from diffulex.strategy.diffusion_gemma.canvas import SampledCanvas, accept_sampled

    entropy, drawn, _ = canvases(4, 16, seed=9, exact=False)
    draws = [SampledCanvas(h.to(DEVICE), d.to(DEVICE), torch.ones((), dtype=torch.bool), None)
             for h, d in zip(entropy, drawn, strict=True)]  # fmt: skip

    def run(fused: bool):
        generators = [torch.Generator(device=DEVICE).manual_seed(70 + i) for i in range(4)]
        got = accept_sampled(draws, generators, 500, 0.6, fused)
        return got, [torch.randint(0, 500, (3,), generator=g, device=DEVICE) for g in generators]

    (fused, fused_after), (reference, reference_after) = run(True), run(False)
    for (tokens, mean), (want_tokens, want_mean) in zip(fused, reference, strict=True):
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(mean, want_mean, rtol=1e-6, atol=0)
    for a, b in zip(fused_after, reference_after, strict=True):
        assert torch.equal(a, b)
    assert accept_sampled([], [], 500, 0.6, True) == []
