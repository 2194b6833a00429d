"""Token proposal (ban, greedy, top-k, top-p, seeded sampling) and the SDAR acceptance rule."""

from __future__ import annotations

import math

import pytest
import torch

from diffulex import Diffulex, SamplingParams
from diffulex.sampler.acceptance import accept_confident
from diffulex.sampler.rows import SamplerSettings
from diffulex.sampler.token_sampling import ban_tokens, filter_top_k_top_p, greedy, sample, step_generator
from diffulex.strategy.multi_bd.sampler import ConfidenceSampler
from diffulex.strategy.request import DecodeSettings, Request

VOCAB = 384  # config vocab_size of the tiny checkpoint
VOCAB_LIMIT = 380  # len(tokenizer): 380..383 are padding rows
MASK = 379


def finite_ids(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


# ----- ban --------------------------------------------------------------------------------------------------


def test_ban_excludes_padding_ids_and_the_mask_id():
    logits = torch.randn(3, VOCAB)
    banned = ban_tokens(logits.clone(), VOCAB_LIMIT, MASK)
    assert torch.isneginf(banned[:, VOCAB_LIMIT:]).all()
    assert torch.isneginf(banned[:, MASK]).all()
    assert torch.equal(banned[:, :MASK], logits[:, :MASK])


def test_banned_ids_are_never_proposed_even_when_they_are_the_best():
    logits = torch.zeros(2, VOCAB)
    logits[0, 382] = 50.0
    logits[1, MASK] = 50.0
    logits[:, 5] = 1.0
    tokens, conf = greedy(ban_tokens(logits, VOCAB_LIMIT, MASK))
    assert tokens.tolist() == [5, 5]
    for _ in range(20):
        drawn, _ = sample(ban_tokens(logits, VOCAB_LIMIT, MASK), 1.0, 0, 1.0, torch.Generator().manual_seed(_))
        assert all(t < MASK for t in drawn.tolist())


def test_ban_returns_float32_logits():
    assert ban_tokens(torch.zeros(1, VOCAB, dtype=torch.bfloat16), VOCAB_LIMIT, MASK).dtype == torch.float32


def test_ban_edits_float32_logits_in_place_and_converts_other_dtypes():
    logits = torch.zeros(2, VOCAB)
    assert ban_tokens(logits, VOCAB_LIMIT, MASK) is logits  # the sampler owns its logits: no copy
    assert torch.isneginf(logits[:, MASK]).all()
    half = torch.zeros(2, VOCAB, dtype=torch.bfloat16)
    ban_tokens(half, VOCAB_LIMIT, MASK)
    assert not torch.isinf(half).any()


# ----- greedy -----------------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_its_softmax_probability():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    tokens, conf = greedy(logits)
    assert tokens.tolist() == [1, 0]
    expected = torch.softmax(logits, dim=-1).max(dim=-1).values
    assert torch.allclose(conf, expected)
    assert conf[1].item() == pytest.approx(math.exp(3) / (math.exp(3) + 3))


def test_greedy_ties_go_to_the_lowest_id():
    tokens, conf = greedy(torch.tensor([[1.0, 3.0, 3.0, 0.0]]))
    assert tokens.tolist() == [1]


# ----- top-k / top-p ----------------------------------------------------------------------------------------


def test_top_k_keeps_the_k_best_tokens():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0, 0.0]])
    assert finite_ids(filter_top_k_top_p(logits, 3, 1.0)[0]) == {1, 3, 4}
    kept = filter_top_k_top_p(logits, 3, 1.0)[0]
    assert torch.equal(kept[[1, 3, 4]], logits[0, [1, 3, 4]])  # kept logits are unchanged


def test_top_k_zero_or_at_least_the_vocab_keeps_everything():
    logits = torch.randn(2, 8)
    assert torch.equal(filter_top_k_top_p(logits, 0, 1.0), logits)
    assert torch.equal(filter_top_k_top_p(logits, 8, 1.0), logits)
    assert torch.equal(filter_top_k_top_p(logits, 50, 1.0), logits)


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.45, {2}), (0.55, {2, 0}), (0.7, {2, 0}), (0.81, {2, 0, 3}), (0.99, {2, 0, 3, 1}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = torch.tensor([[0.3, 0.05, 0.5, 0.15]])  # order by probability: 2, 0, 3, 1
    assert finite_ids(filter_top_k_top_p(probs.log(), 0, top_p)[0]) == kept


def test_top_p_on_an_exact_boundary_keeps_the_tokens_that_reach_it():
    logits = torch.zeros(1, 4)  # four tokens of probability 0.25 each
    assert len(finite_ids(filter_top_k_top_p(logits, 0, 0.5)[0])) == 2


@pytest.mark.parametrize("top_p", [1e-30, 1e-300, 5e-324])
def test_a_top_p_below_float32_keeps_the_best_token_and_samples_it(top_p):
    """A ``top_p`` that rounds to 0 in float32 (accepted: it is in (0, 1]) keeps exactly the best token, so
    sampling is greedy instead of every token masked and the row's probabilities NaN."""
    probs = torch.tensor([[0.3, 0.05, 0.5, 0.15], [0.1, 0.6, 0.2, 0.1]])
    assert [finite_ids(row) for row in filter_top_k_top_p(probs.log(), 0, top_p)] == [{2}, {1}]
    tokens, conf = sample(probs.log(), 1.0, 0, top_p, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [2, 1] and conf.tolist() == [1.0, 1.0]


def test_top_k_is_applied_before_top_p():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # after top-k=2 the distribution is 4/7, 3/7: top_p=0.5 keeps only the best token
    assert finite_ids(filter_top_k_top_p(probs.log(), 2, 0.5)[0]) == {0}
    # without top-k, 0.4 < 0.5 and two tokens are needed
    assert finite_ids(filter_top_k_top_p(probs.log(), 0, 0.5)[0]) == {0, 1}


# ----- temperature sampling ---------------------------------------------------------------------------------


def test_sampled_tokens_come_from_the_filtered_set_with_their_filtered_probability():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 64))
    tokens, conf = sample(logits, 1.0, 2, 1.0, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= {0, 1}
    for t, c in zip(tokens.tolist(), conf.tolist(), strict=True):
        assert c == pytest.approx(4 / 7 if t == 0 else 3 / 7, rel=1e-5)


def test_top_k_one_sampling_is_greedy_with_confidence_one():
    logits = torch.randn(5, 16)
    tokens, conf = sample(logits, 0.7, 1, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.allclose(conf, torch.ones(5))


def test_temperature_sharpens_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.4]]))
    _, conf_cold = sample(logits, 0.1, 0, 1.0, torch.Generator().manual_seed(0))
    tokens, conf_hot = sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(0))
    assert conf_cold.item() > 0.98
    assert conf_hot.item() == pytest.approx(0.6 if tokens.item() == 0 else 0.4, rel=1e-5)


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 1.0, 100.0])
@pytest.mark.parametrize("scale", [1.0, 1e4, 1e30])
def test_every_accepted_temperature_draws_valid_tokens_from_any_finite_logits(temperature, scale):
    """The tempered logits are shifted so the best is 0 before dividing: nothing overflows or turns into NaN."""
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(1)) * scale
    banned = ban_tokens(logits.clone(), VOCAB_LIMIT, MASK)
    tokens, conf = sample(banned, temperature, 0, 1.0, torch.Generator().manual_seed(0))
    assert torch.isfinite(conf).all() and (conf > 0).all() and (conf <= 1).all()
    assert ((tokens >= 0) & (tokens < VOCAB_LIMIT) & (tokens != MASK)).all()


def test_the_smallest_drawing_temperature_picks_the_top_1():
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(2))
    tokens, conf = sample(logits, 1e-5, 0, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.allclose(conf, torch.ones(32))


def test_draws_follow_the_distribution():
    """The exponential race draws each token with its probability (within a 5-sigma band over 20k draws)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.log(probs).expand(20_000, 4).contiguous()
    tokens, _ = sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(5))
    freq = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    sigma = (probs.double() * (1 - probs.double()) / tokens.numel()).sqrt()
    assert ((freq - probs.double()).abs() < 5 * sigma).all()


def test_a_row_of_non_finite_logits_does_not_raise():
    """A model that produced NaN is answered with some token (the engine reports the model, not a crash)."""
    logits = torch.full((2, 8), float("nan"))
    tokens, _ = sample(logits, 1.0, 0, 1.0, torch.Generator().manual_seed(0))
    assert tokens.shape == (2,)


def test_step_generator_is_reproducible_from_seed_and_step():
    logits = torch.zeros(8, 64)
    a, _ = sample(logits, 1.0, 0, 1.0, step_generator(7, 3, torch.device("cpu")))
    b, _ = sample(logits, 1.0, 0, 1.0, step_generator(7, 3, torch.device("cpu")))
    c, _ = sample(logits, 1.0, 0, 1.0, step_generator(7, 4, torch.device("cpu")))
    d, _ = sample(logits, 1.0, 0, 1.0, step_generator(8, 3, torch.device("cpu")))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


# ----- the ConfidenceSampler on hand-made requests ----------------------------------------------------------


def _request(req_id: int, prompt_len: int, sp: SamplingParams) -> Request:
    settings = DecodeSettings(4, 2, MASK, 1000, frozenset({376, 378}), 0.9, 0.1, 0.9, 8, 1.0)
    req = Request(req_id, list(range(10, 10 + prompt_len)), sp, settings)
    req.maybe_activate_block()
    return req


def test_confidence_sampler_writes_only_accepted_positions():
    sampler = ConfidenceSampler(SamplerSettings(VOCAB_LIMIT, MASK, 0.9, 0))
    req = _request(0, 8, SamplingParams(temperature=0.0))
    work = [(req, req.sample_targets())]
    logits = torch.zeros(4, VOCAB)
    logits[1, 42] = 30.0  # confident at position 9
    logits[3, 381] = 30.0  # a padding id, banned: position 11 stays flat
    logits[3, MASK] = 30.0
    assert sampler(logits, work) == {0: [(9, 42)]}


def test_confidence_sampler_forces_the_best_position_when_none_is_confident():
    sampler = ConfidenceSampler(SamplerSettings(VOCAB_LIMIT, MASK, 0.9, 0))
    req = _request(0, 8, SamplingParams(temperature=0.0))
    logits = torch.zeros(4, VOCAB)
    logits[2, 11] = 2.0
    logits[3, 12] = 1.0
    assert sampler(logits, [(req, req.sample_targets())]) == {0: [(10, 11)]}


def test_confidence_sampler_draws_of_a_request_do_not_depend_on_its_batch():
    sampler = ConfidenceSampler(SamplerSettings(VOCAB_LIMIT, MASK, 0.0, 0))
    sp = SamplingParams(temperature=1.0, seed=5)
    torch.manual_seed(0)
    row = torch.randn(4, VOCAB)
    alone = _request(0, 8, sp)
    alone_writes = sampler(row.clone(), [(alone, alone.sample_targets())])[0]
    other = _request(1, 6, SamplingParams(temperature=1.0))
    target = _request(2, 8, sp)
    other_targets = other.sample_targets()
    n_other = sum(len(t.positions) for t in other_targets)
    batch_logits = torch.cat([torch.randn(n_other, VOCAB), row.clone()])
    batch_writes = sampler(batch_logits, [(other, other_targets), (target, target.sample_targets())])
    assert batch_writes[2] == alone_writes


# ----- accept_confident -------------------------------------------------------------------------------------


def test_accept_keeps_positions_strictly_above_the_threshold():
    assert accept_confident([0.95, 0.9, 0.91, 0.2], 0.9, True) == [0, 2]


def test_accept_at_exactly_the_threshold_is_not_confident():
    assert accept_confident([0.9, 0.9], 0.9, False) == []


def test_accept_forces_the_most_confident_position_when_allowed():
    assert accept_confident([0.1, 0.5, 0.3], 0.9, True) == [1]


def test_accept_does_not_force_when_not_allowed():
    assert accept_confident([0.1, 0.5, 0.3], 0.9, False) == []


def test_accept_forcing_ties_go_to_the_first_position():
    assert accept_confident([0.2, 0.5, 0.5, 0.1], 0.9, True) == [1]


def test_accept_forces_nothing_when_there_is_nothing_to_decode():
    assert accept_confident([], 0.9, True) == []


# ----- end to end through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(sdar_dir):
    with Diffulex(str(sdar_dir), block_size=4, buffer_size=2, page_size=8, max_model_len=128) as llm:
        yield llm


PROMPTS = ["The old lighthouse", "Read the problem twice", "A train leaves the station", "3 + 4 ="]


def test_seeded_sampling_does_not_depend_on_the_other_requests_in_the_batch(engine):
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    alone = engine.generate([PROMPTS[1]], sp, use_tqdm=False)[0]
    batch = engine.generate(PROMPTS, sp, use_tqdm=False)
    assert batch[1].token_ids == alone.token_ids
    assert len(alone.token_ids) == 12


def test_seeded_sampling_is_reproducible_and_the_seed_matters(engine):
    def run(seed):
        sp = SamplingParams(temperature=0.8, seed=seed, max_tokens=12, ignore_eos=True)
        return engine.generate(PROMPTS[:2], sp, use_tqdm=False)

    first, again, other = run(7), run(7), run(8)
    assert [t.token_ids for t in first] == [t.token_ids for t in again]
    assert [t.token_ids for t in first] != [t.token_ids for t in other]


def test_greedy_decoding_is_deterministic_across_runs(engine):
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    first = engine.generate(PROMPTS, sp, use_tqdm=False)
    second = engine.generate(PROMPTS, sp, use_tqdm=False)
    assert [t.token_ids for t in first] == [t.token_ids for t in second]
    assert [t.completion_reason for t in first] == [t.completion_reason for t in second]


def test_engine_never_emits_banned_ids(engine):
    sp = SamplingParams(temperature=1.5, seed=1, max_tokens=24, ignore_eos=True)
    for traj in engine.generate(PROMPTS, sp, use_tqdm=False):
        assert traj.token_ids and all(0 <= t < MASK for t in traj.token_ids)
