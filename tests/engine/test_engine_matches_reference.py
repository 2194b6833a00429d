"""The engine (paged KV cache, batching, prefix caching, preemption) produces exactly the tokens of the naive
reference decoder, which recomputes the whole sequence every step with an explicit mask and no cache."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.models.family import FAMILIES, Family, register_family
from diffulex.testing.reference_decoder import reference_for_engine
from tests.models.family_harness import assert_well_posed


def random_prompts(llm, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    banned = set(llm.settings.stop_token_ids) | {llm.mask_token_id}
    allowed = [t for t in range(llm.vocab_limit) if t not in banned]
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def assert_matches_reference(llm, prompts: list[list[int]], params: SamplingParams) -> list:
    """Run the batch through the engine, then each prompt alone through the reference decoder."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, traj in zip(prompts, outputs.trajectories, strict=True):
        ref = reference_for_engine(llm, prompt, params)
        assert_well_posed(ref, f"prompt of length {len(prompt)}")
        assert traj.token_ids == ref.token_ids, f"prompt of length {len(prompt)}"
        assert traj.completion_reason == ref.completion_reason
        assert traj.nfe == ref.nfe
        assert [s.num_new_tokens for s in traj.steps] == ref.tokens_per_step
    return outputs.trajectories


def make_engine(model_dir: Path, **overrides):
    fields = dict(
        decoding_strategy="multi_bd", block_size=4, page_size=8, buffer_size=1, max_model_len=160,
        max_num_batched_tokens=512, max_num_reqs=16, accept_threshold=0.9,
    )
    fields.update(overrides)
    return Diffulex(str(model_dir), **fields)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def shifted_sdar_family() -> Family:
    """SDAR's network read Dream-style (the hidden state at p - 1 predicts p), registered once under its own name."""
    name = "sdar_read_shifted"
    if name not in FAMILIES:
        register_family(dataclasses.replace(FAMILIES.get("sdar").renamed(name), logits_shift=True))
    return FAMILIES.get(name)


def test_one_request_matches_reference(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir) as llm:
        assert_matches_reference(llm, random_prompts(llm, [9]), GREEDY)


@pytest.mark.parametrize("buffer_size", [1, 2, 3])
def test_mixed_batch_matches_reference_for_every_buffer_size(peaky_sdar_dir: Path, buffer_size: int) -> None:
    with make_engine(peaky_sdar_dir, buffer_size=buffer_size, accept_threshold=0.7) as llm:
        prompts = random_prompts(llm, [1, 3, 4, 5, 8, 11, 16, 21], seed=buffer_size)
        trajectories = assert_matches_reference(llm, prompts, GREEDY)
    steps = [s for t in trajectories for s in t.steps]
    assert max(s.num_new_tokens for s in steps) >= 2, "the threshold should accept several tokens in some step"


def test_threshold_above_one_accepts_exactly_one_token_per_decoding_step(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, buffer_size=2, accept_threshold=1.0) as llm:
        trajectories = assert_matches_reference(llm, random_prompts(llm, [5, 12], seed=3), GREEDY)
    assert {s.num_new_tokens for t in trajectories for s in t.steps} <= {0, 1}


def test_d2f_matches_reference(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, decoding_strategy="d2f", buffer_size=2, accept_threshold=0.7) as llm:
        assert llm.config.enable_prefix_caching is False
        assert_matches_reference(llm, random_prompts(llm, [3, 10, 17], seed=4), GREEDY)


def test_larger_blocks_and_pages_match_reference(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, block_size=8, page_size=16, buffer_size=2, accept_threshold=0.6) as llm:
        prompts = random_prompts(llm, [7, 19], seed=5)
        assert_matches_reference(llm, prompts, SamplingParams(temperature=0, max_tokens=30))


def test_second_request_reuses_the_cached_prefix_and_matches_reference(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, buffer_size=2, accept_threshold=0.7) as llm:
        assert llm.config.enable_prefix_caching is True
        (first,) = random_prompts(llm, [26], seed=6)
        assert_matches_reference(llm, [first], GREEDY)
        second = first[:24] + first[:5]
        (traj,) = assert_matches_reference(llm, [second], GREEDY)
    # 24 shared tokens = 3 full pages of 8: the first forward only computes what follows them.
    assert traj.steps[0].query_len == len(second) - 24 + 4 - len(second) % 4 + 4


def test_generated_pages_are_reused_by_a_follow_up_prompt(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, buffer_size=1, accept_threshold=0.7) as llm:
        (prompt,) = random_prompts(llm, [16], seed=7)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        (traj,) = assert_matches_reference(llm, [prompt], params)
        follow_up = prompt + traj.token_ids[:8] + prompt[:3]
        (again,) = assert_matches_reference(llm, [follow_up], GREEDY)
    assert again.steps[0].query_len < len(follow_up) - 16


def test_preempted_requests_are_rebuilt_and_match_reference(peaky_sdar_dir: Path) -> None:
    # 10 pages of 8 tokens cannot hold eight requests of up to ~45 tokens: requests are preempted and rebuilt.
    with make_engine(peaky_sdar_dir, buffer_size=2, accept_threshold=0.8, num_pages=10, max_model_len=64) as llm:
        prompts = random_prompts(llm, [3, 6, 9, 12, 14, 5, 7, 2], seed=8)
        trajectories = assert_matches_reference(llm, prompts, SamplingParams(temperature=0, max_tokens=30))
    assert sum(t.num_preemptions for t in trajectories) > 0


def test_stop_tokens_and_limits_match_reference(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, buffer_size=2, accept_threshold=0.7, max_model_len=40) as llm:
        prompts = random_prompts(llm, [6, 13, 30], seed=9)
        assert_matches_reference(llm, prompts, SamplingParams(temperature=0, max_tokens=20, max_nfe=9))
        assert_matches_reference(llm, prompts, SamplingParams(temperature=0, max_tokens=20, max_repetition_run=2))
        assert_matches_reference(llm, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))


def test_shifted_logits_read_the_previous_position_and_match_reference(peaky_sdar_dir: Path) -> None:
    """Dream-style families predict position p from the hidden state at p - 1, across the cache boundary."""
    family = shifted_sdar_family()
    with make_engine(
        peaky_sdar_dir, model_name=family.name, buffer_size=2, accept_threshold=0.7, num_pages=12, max_model_len=72
    ) as llm:
        assert llm.settings.logits_shift
        prompts = random_prompts(llm, [4, 7, 13, 9, 2, 16], seed=10)
        trajectories = assert_matches_reference(llm, prompts, SamplingParams(temperature=0, max_tokens=30))
        assert sum(t.num_preemptions for t in trajectories) > 0
        (first,) = random_prompts(llm, [26], seed=11)
        assert_matches_reference(llm, [first], GREEDY)
        (again,) = assert_matches_reference(llm, [first[:24] + first[:3]], GREEDY)
    assert again.steps[0].query_len < 24, "the prefix cache was used"


def test_cold_prompts_of_fifty_pages_match_reference(peaky_sdar_dir: Path) -> None:
    # one step stores each prompt's 400 positions (one run over 50 pages) while the short one decodes beside them
    with make_engine(peaky_sdar_dir, max_model_len=640, max_num_batched_tokens=1024) as llm:
        assert_matches_reference(llm, random_prompts(llm, [400, 9, 397], seed=12), GREEDY)
