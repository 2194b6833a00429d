"""DiffusionGemma's sampled canvas step in two passes against the torch code of
`diffulex.strategy.diffusion_gemma.canvas`: the argmax, maximum and draw exactly `torch.argmax`'s, `torch.max`'s and
`draw_categorical`'s; the entropy `token_entropy`'s and the probabilities ``torch.softmax``'s up to float32 rounding
(another summation order); non-finite rows flagged as `drawable` flags them."""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.canvas_sampling import BLOCK, RowStatistics, draw_and_probs, row_statistics
from diffulex.strategy.diffusion_gemma.canvas import self_conditioning_probs, token_entropy
from tests.kernels.test_fused_norm import DEVICE, assert_matches, ulps

NEG_INF = float("-inf")
# Vocabularies: one not a multiple of the tile and above it, an exact multiple, and one under a single tile.
VOCABS = [5000, 2 * BLOCK, 300]
ENTROPY_RTOL = 1e-5
ENTROPY_ATOL = 1e-6  # a nearly one-hot row: log(s) with s a hair above 1, in float32 (the torch code's too)
# float32 probabilities against exp(x - max) / sum: two exponentials' and two sums' roundings apart (4 measured)
PROBS_ULPS = 8


def canvas_rows(vocab: int, seed: int) -> torch.Tensor:
    """Scaled logits rows like a canvas step's: spread-out rows, a banned tail, a tie at the maximum, a nearly
    one-hot row and a uniform one."""
    gen = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(6, vocab, generator=gen)
    x[1, vocab - vocab // 7 :] = NEG_INF  # ids at and above the vocabulary limit
    x[2, [vocab // 2, 3, vocab - 1]] = 30.0  # equal maxima: the lowest index wins
    x[3] = -40.0
    x[3, vocab // 3] = 25.0  # entropy ~0
    x[4] = 0.7  # uniform: entropy log(vocab)
    x[5, : vocab // 2] = NEG_INF  # a banned head: the first tiles are all -inf
    return x


def torch_quotients(x: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1) / race


def assert_statistics_are_the_torch_codes(stats: RowStatistics, x: torch.Tensor) -> None:
    finite = torch.isfinite(x).any(dim=-1) & ~torch.isnan(x).any(dim=-1) & ~(x == float("inf")).any(dim=-1)
    assert stats.argmax.dtype == torch.int64 and stats.finite.dtype == torch.bool
    assert torch.equal(stats.argmax.cpu(), x.argmax(dim=-1))
    torch.testing.assert_close(stats.max.cpu(), x.max(dim=-1).values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(stats.finite.cpu(), finite)
    m = x.max(dim=-1, keepdim=True).values
    rows = finite
    want_sum = torch.exp(x[rows] - m[rows]).sum(dim=-1)
    torch.testing.assert_close(stats.sum.cpu()[rows], want_sum, rtol=1e-6, atol=0)
    # log(s) is off by about the sum's relative error, absolutely (s near 1: log(s) near 0)
    torch.testing.assert_close(stats.log_sum.cpu()[rows], want_sum.log(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.entropy.cpu()[rows], token_entropy(x[rows]), rtol=ENTROPY_RTOL, atol=ENTROPY_ATOL)
    assert stats.entropy.cpu()[~rows].isnan().all(), "a row with no distribution has entropy NaN, as torch's"


@pytest.mark.parametrize("vocab", VOCABS)
def test_the_row_statistics_are_the_torch_codes(vocab):
    x = canvas_rows(vocab, seed=vocab)
    stats = row_statistics(x.to(DEVICE))
    assert_statistics_are_the_torch_codes(stats, x)
    assert stats.finite.all()
    assert stats.argmax[2].item() == 3, "equal maxima: the lowest index"
    assert abs(stats.entropy[3].item()) < ENTROPY_ATOL, "a nearly one-hot row has entropy ~0"
    assert stats.entropy[4].item() == pytest.approx(torch.tensor(float(vocab)).log().item(), rel=1e-6)


def test_equal_maxima_in_other_tiles_and_lanes_go_to_the_lowest_index():
    x = torch.zeros(4, 3 * BLOCK + 11)
    x[0, [BLOCK + 3, 2 * BLOCK + 3, 3]] = 5.0  # one lane, three tiles
    x[1, [2 * BLOCK + 1, BLOCK + 9, 2 * BLOCK + 5]] = 5.0  # a later tile in a lower lane
    x[2, [3 * BLOCK + 10, 3 * BLOCK + 2]] = 5.0  # in the last, partial tile
    x[3] = NEG_INF
    x[3, [BLOCK + 7, 2 * BLOCK + 2]] = 1.0  # only banned ids before them
    stats = row_statistics(x.to(DEVICE))
    assert stats.argmax.cpu().tolist() == [3, BLOCK + 9, 3 * BLOCK + 2, BLOCK + 7]
    assert_statistics_are_the_torch_codes(stats, x)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf - inf and log(0)
def test_a_row_with_nan_or_inf_or_nothing_finite_is_no_distribution():
    x = canvas_rows(5000, seed=1)[:4]
    x[0, [4500, 17]] = float("nan")
    x[1, [4200, 3000]] = float("inf")
    x[2] = NEG_INF
    stats = row_statistics(x.to(DEVICE))
    assert stats.finite.cpu().tolist() == [False, False, False, True]
    assert stats.argmax.cpu().tolist()[:2] == [17, 3000], "torch.argmax's: the first NaN, else the first +inf"
    assert_statistics_are_the_torch_codes(stats, x)
    race = torch.empty_like(x).exponential_(1.0, generator=torch.Generator().manual_seed(2))
    drawn, valid = draw_and_probs(x.to(DEVICE), race.to(DEVICE), stats)
    assert valid.cpu().tolist() == [False, False, False, True]
    assert ((drawn >= 0) & (drawn < x.shape[1])).all(), "even a row with nothing to draw draws an id in range"
    assert drawn[3].item() == torch_quotients(x[3:], race[3:]).argmax().item()


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_draw_is_the_exponential_race_of_draw_categorical(vocab, seed):
    x = canvas_rows(vocab, seed=seed)
    race = torch.empty_like(x).exponential_(1.0, generator=torch.Generator().manual_seed(seed))
    stats = row_statistics(x.to(DEVICE))
    drawn, valid = draw_and_probs(x.to(DEVICE), race.to(DEVICE), stats)
    assert drawn.dtype == torch.int64 and valid.dtype == torch.bool and valid.all()
    quotients = torch_quotients(x, race)
    best = quotients.max(dim=-1).values
    picked = quotients.gather(-1, drawn.cpu()[:, None])[:, 0]
    torch.testing.assert_close(picked, best, rtol=1e-6, atol=0)  # the best quotient, whatever the rounding
    top2 = quotients.topk(2, dim=-1).values
    clear = top2[:, 1] < top2[:, 0] * (1 - 1e-5)  # rows where no rounding can reorder the top two
    assert clear.sum() >= 4
    assert torch.equal(drawn.cpu()[clear], quotients.argmax(dim=-1)[clear])


def test_equal_quotients_go_to_the_lowest_index():
    x = torch.zeros(2, 2 * BLOCK + 9)  # uniform: every probability the same number
    race = torch.ones_like(x)
    race[1, [2 * BLOCK + 4, BLOCK + 1, 6]] = 0.5
    drawn, _ = draw_and_probs(x.to(DEVICE), race.to(DEVICE), row_statistics(x.to(DEVICE)))
    assert drawn.cpu().tolist() == [0, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [5000, 300])
def test_the_probabilities_are_the_self_conditioning_softmax_in_the_requested_dtype(dtype, vocab):
    """The probabilities written are `self_conditioning_probs`: the softmax of the logits rounded to the model
    dtype, rounded to it again; the draw stays the one from the float32 logits."""
    x = canvas_rows(vocab, seed=3)
    race = torch.empty_like(x).exponential_(1.0, generator=torch.Generator().manual_seed(3))
    probs = torch.full(x.shape, float("nan"), dtype=dtype, device=DEVICE)
    stats = row_statistics(x.to(DEVICE), dtype)
    drawn, _ = draw_and_probs(x.to(DEVICE), race.to(DEVICE), stats, probs_out=probs)
    if dtype == torch.float32:
        # CUDA's softmax formula, with torch's accurate exp (its CPU softmax uses a cheaper one, 11 ulps off here)
        e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        assert ulps(probs, e / e.sum(dim=-1, keepdim=True)).max() <= PROBS_ULPS
    else:  # at most one ulp of the model dtype, almost all bit for bit
        assert_matches(probs, self_conditioning_probs(x, dtype))
        rounded = x.to(dtype).float()
        torch.testing.assert_close(stats.probs_max.cpu(), rounded.max(dim=-1).values, rtol=0, atol=0)
        want_sum = torch.exp(rounded - rounded.max(dim=-1, keepdim=True).values).sum(dim=-1)
        torch.testing.assert_close(stats.probs_sum.cpu(), want_sum, rtol=1e-6, atol=0)
    without, _ = draw_and_probs(x.to(DEVICE), race.to(DEVICE), row_statistics(x.to(DEVICE)))
    assert torch.equal(drawn, without), "writing the probabilities changes nothing about the draw"


def test_no_rows():
    x = torch.empty(0, 5000, device=DEVICE)
    stats = row_statistics(x)
    assert all(field.shape == (0,) for field in stats)
    probs = torch.empty(0, 5000, dtype=torch.bfloat16, device=DEVICE)
    drawn, valid = draw_and_probs(x, x.clone(), stats, probs_out=probs)
    assert drawn.shape == (0,) and valid.shape == (0,)


def test_bad_arguments_are_refused_by_name():
    x = torch.zeros(3, 100, device=DEVICE)
    stats = row_statistics(x)
    with pytest.raises(ValueError, match=r"scaled has dtype torch.float64; only torch.float32"):
        row_statistics(x.double())
    with pytest.raises(ValueError, match=r"scaled has shape \(300,\); it must be 2-D"):
        row_statistics(x.view(-1))
    with pytest.raises(ValueError, match=r"scaled with strides \(1, 100\) must be contiguous"):
        row_statistics(x.t())
    with pytest.raises(ValueError, match=r"race has shape \(3, 99\); it must be scaled's \(3, 100\)"):
        draw_and_probs(x, x[:, :99].contiguous(), stats)
    with pytest.raises(ValueError, match=r"race has dtype torch.bfloat16"):
        draw_and_probs(x, x.bfloat16(), stats)
    with pytest.raises(ValueError, match=r"stats.argmax has shape \(2,\)"):
        draw_and_probs(x, x, stats._replace(argmax=stats.argmax[:2]))
    with pytest.raises(ValueError, match=r"probs_out has dtype torch.int32; allowed: torch.bfloat16"):
        draw_and_probs(x, x, stats, probs_out=torch.empty(3, 100, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"probs_out has shape \(3, 50\)"):
        draw_and_probs(x, x, stats, probs_out=torch.empty(3, 50, device=DEVICE))
    with pytest.raises(ValueError, match=r"probs_dtype=torch.int8 is invalid: allowed torch.bfloat16"):
        row_statistics(x, torch.int8)


@pytest.mark.parametrize("probs_dtype", [None, torch.bfloat16, torch.float32])
def test_a_canvas_sampled_in_the_fused_passes_gets_the_torch_codes_draws(probs_dtype):
    """`fused_sample_canvas` (the canvas rule's GPU path) against `torch_sample_canvas`: the same draws, drawable
    flag and generator state after them (the re-noising numbers come next), the entropies within float32 rounding,
    the self-conditioning probabilities within one unit of their dtype (a few of float32)."""
    from diffulex.strategy.diffusion_gemma.canvas import fused_sample_canvas, torch_sample_canvas

    vocab, limit = 300, 280
    scaled = 3 * torch.randn(16, vocab, generator=torch.Generator().manual_seed(4)) / 0.7
    scaled[:, limit:] = NEG_INF
    fused_gen, torch_gen = (torch.Generator(device=DEVICE).manual_seed(8) for _ in range(2))
    fused = fused_sample_canvas(scaled.to(DEVICE), fused_gen, probs_dtype)
    want = torch_sample_canvas(scaled.to(DEVICE), torch_gen, probs_dtype)
    assert torch.equal(fused.drawn, want.drawn)
    assert bool(fused.drawable) and bool(want.drawable)
    after = [torch.randint(0, limit, (16,), generator=g, device=DEVICE) for g in (fused_gen, torch_gen)]
    assert torch.equal(*after)
    torch.testing.assert_close(fused.entropy, want.entropy, rtol=ENTROPY_RTOL, atol=ENTROPY_ATOL)
    if probs_dtype is None:
        assert fused.probs is None and want.probs is None
    else:
        assert fused.probs.dtype == probs_dtype
        units = PROBS_ULPS if probs_dtype == torch.float32 else 1  # float32: PyTorch's CPU exp is the cheaper one
        torch.testing.assert_close(fused.probs, want.probs, rtol=units * torch.finfo(probs_dtype).eps, atol=1e-7)


@pytest.mark.parametrize("length", [16, 48])
def test_canvases_sampled_together_get_the_numbers_each_gets_alone(length: int) -> None:
    """The fused path of `sample_canvases` over five sampled canvases with a greedy one between them (one product
    launch of 16-row canvases; three of 48-row ones, `canvases_per_product`): each canvas's entropies, draws,
    drawable flag, self-conditioning input and generator state after equal, bit for bit, those it gets sampled
    alone, and its draws those of the PyTorch code; a canvas at its last step gets no self-conditioning input."""
    from diffulex.strategy.diffusion_gemma.canvas import canvases_per_product, sample_canvases

    vocab, limit, hidden = 300, 280, 8
    logits = 3 * torch.randn(6, length, vocab, generator=torch.Generator().manual_seed(6))
    logits[:, :, limit:] = NEG_INF
    logits = logits.to(DEVICE)
    matrix = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    members, goes_on = [0, 1, 3, 4, 5], [True, True, False, True, True]  # canvas 2 is greedy, 3 at its last step

    def sample(canvases, flags, fused=True):
        generators = [torch.Generator(device=DEVICE).manual_seed(40 + b) for b in canvases]
        got = sample_canvases(logits, canvases, generators, flags, torch.float32, lambda p: p @ matrix, fused=fused)
        return got, [torch.randint(0, limit, (length,), generator=g, device=DEVICE) for g in generators]

    together, after = sample(members, goes_on)
    reference, reference_after = sample(members, goes_on, fused=False)
    assert len(members) > canvases_per_product(length) or length == 16
    for i, b in enumerate(members):
        (alone,), (alone_after,) = sample([b], [goes_on[i]])
        for field in ("entropy", "drawn", "drawable"):
            assert torch.equal(getattr(together[i], field), getattr(alone, field)), field
        assert torch.equal(after[i], alone_after)
        assert (together[i].soft_embeds is None) == (not goes_on[i])
        if goes_on[i]:
            assert torch.equal(together[i].soft_embeds, alone.soft_embeds)
            torch.testing.assert_close(together[i].soft_embeds, reference[i].soft_embeds, rtol=1e-5, atol=1e-6)
        assert torch.equal(together[i].drawn, reference[i].drawn)
        assert torch.equal(after[i], reference_after[i])
        torch.testing.assert_close(together[i].entropy, reference[i].entropy, rtol=ENTROPY_RTOL, atol=ENTROPY_ATOL)
