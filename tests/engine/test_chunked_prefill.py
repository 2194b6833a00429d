"""Chunked prefill: a prompt longer than the step's token budget is computed a few whole blocks per step, beside
the decoding requests, and the tokens are still those of the reference decoder."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from diffulex import SamplingParams
from diffulex.testing.reference_decoder import reference_for_engine
from tests.engine.test_engine_matches_reference import make_engine, random_prompts, shifted_sdar_family
from tests.models.family_harness import assert_well_posed

BUDGET = 16  # rows per step: four blocks of 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def chunked_engine(model_dir: Path, **overrides):
    return make_engine(model_dir, enable_chunked_prefill=True, max_num_batched_tokens=BUDGET, **overrides)


def assert_chunked_matches_reference(llm, prompts: list[list[int]], params: SamplingParams) -> list:
    """Each request's decoding steps equal the reference decoder's; the steps before them are prefill chunks, which
    sample nothing and are not counted as function evaluations."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, traj in zip(prompts, outputs.trajectories, strict=True):
        ref = reference_for_engine(llm, prompt, params)
        assert_well_posed(ref, f"prompt of length {len(prompt)}")
        assert traj.token_ids == ref.token_ids, f"prompt of length {len(prompt)}"
        assert traj.completion_reason == ref.completion_reason
        assert traj.nfe == ref.nfe
        chunks = len(traj.steps) - len(ref.tokens_per_step)
        assert [s.num_new_tokens for s in traj.steps[chunks:]] == ref.tokens_per_step
        assert all(s.num_new_tokens == 0 and not s.running_block_ids for s in traj.steps[:chunks])
    return outputs.trajectories


def rows_per_step(trajectories: list) -> dict[int, int]:
    rows: dict[int, int] = defaultdict(int)
    for traj in trajectories:
        for step in traj.steps:
            rows[step.step] += step.query_len
    return rows


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_and_matches_reference(peaky_sdar_dir: Path) -> None:
    with chunked_engine(peaky_sdar_dir, buffer_size=2, accept_threshold=0.7) as llm:
        prompts = random_prompts(llm, [50, 48], seed=21)  # one ends mid-block, one on a block boundary
        for prompt in prompts:
            (traj,) = assert_chunked_matches_reference(llm, [prompt], GREEDY)
            assert len(prompt) // BUDGET <= len(traj.steps) - traj.nfe, "the prompt took several chunk steps"
            assert max(s.query_len for s in traj.steps) <= BUDGET


def test_prompt_rows_per_step_never_exceed_the_budget(peaky_sdar_dir: Path) -> None:
    with chunked_engine(peaky_sdar_dir, accept_threshold=0.7, max_num_reqs=4) as llm:
        prompts = random_prompts(llm, [5, 70, 3, 41], seed=22)
        trajectories = assert_chunked_matches_reference(llm, prompts, GREEDY)
    rows = rows_per_step(trajectories)
    assert max(rows.values()) <= BUDGET
    assert sum(len(t.steps) - t.nfe for t in trajectories) >= 70 // BUDGET


def test_decoding_requests_take_every_step_beside_a_chunked_prefill(peaky_sdar_dir: Path) -> None:
    """The decoders run in every engine step until they finish (with the reference decoder's tokens in each),
    while the long prompt is computed from the rows they leave."""
    with chunked_engine(peaky_sdar_dir, accept_threshold=0.7, max_num_reqs=4) as llm:
        prompts = random_prompts(llm, [6, 2, 90], seed=23)
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        *decoders, long = assert_chunked_matches_reference(llm, prompts, params)
    chunk_steps = [s.step for s in long.steps[: len(long.steps) - long.nfe]]
    assert len(chunk_steps) >= 90 // BUDGET
    for traj in decoders:
        steps = [s.step for s in traj.steps]
        assert steps == list(range(steps[0], steps[-1] + 1)), "a decoder skipped a step"
        assert set(chunk_steps) & set(steps), "the decoder ran while the long prompt was prefilled"
    assert max(rows_per_step([*decoders, long]).values()) <= BUDGET


def test_chunked_prefill_of_a_shifted_family_with_preemption_and_prefix_hits_matches_reference(
    peaky_sdar_dir: Path,
) -> None:
    """A shifted family recomputes the last cached row in every chunk; a preempted request's prompt is chunked
    again; a prefix-cache hit leaves only the uncached tail to chunk."""
    family = shifted_sdar_family()
    with chunked_engine(
        peaky_sdar_dir, model_name=family.name, buffer_size=2, accept_threshold=0.7, num_pages=12, max_model_len=72
    ) as llm:
        assert llm.settings.logits_shift
        prompts = random_prompts(llm, [30, 7, 40, 13], seed=24)
        trajectories = assert_chunked_matches_reference(llm, prompts, SamplingParams(temperature=0, max_tokens=30))
        assert sum(t.num_preemptions for t in trajectories) > 0
        assert all(len(t.steps) > t.nfe for t in trajectories if len(t.prompt_token_ids) > BUDGET), "chunked"
        (first,) = random_prompts(llm, [44], seed=25)
        assert_chunked_matches_reference(llm, [first], GREEDY)
        (again,) = assert_chunked_matches_reference(llm, [first[:40] + first[:3]], GREEDY)
    assert again.steps[0].query_len < 40, "the prefix cache was used"


def test_a_prompt_chunked_by_cost_beside_decoders_matches_reference_and_its_chunks_shrink(
    peaky_sdar_dir: Path,
) -> None:
    """With ``max_prefill_chunk_cost`` a prompt arriving while others decode gets the rows whose cost fits each step:
    fewer as its context grows, however many the token budget would give, and the tokens do not change."""
    max_cost = 18
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with make_engine(peaky_sdar_dir, enable_chunked_prefill=True, accept_threshold=0.7, max_num_reqs=4,
                     max_num_batched_tokens=160, max_prefill_chunk_cost=max_cost) as llm:
        prompts = random_prompts(llm, [6, 2, 120], seed=26)
        cost_model = llm.scheduler.limits.prefill_cost_model
        finished = {}
        ids = [llm.add_request(p, params) for p in prompts[:2]]
        for _ in range(2):  # the decoders are decoding before the long prompt arrives
            llm.step()
        ids.append(llm.add_request(prompts[2], params))
        while len(finished) < len(ids):
            finished |= {u.req_id: u.trajectory for u in llm.step() if u.finished}
        trajectories = [finished[i] for i in ids]
        for prompt, traj in zip(prompts, trajectories, strict=True):
            assert traj.token_ids == reference_for_engine(llm, prompt, params).token_ids, f"prompt of {len(prompt)}"
    with make_engine(peaky_sdar_dir, accept_threshold=0.7, max_num_reqs=4) as unchunked:
        plain = unchunked.generate(prompts, params, use_tqdm=False).trajectories
    assert [t.token_ids for t in trajectories] == [t.token_ids for t in plain], "the same tokens as unchunked"
    assert max(len(t.steps) - t.nfe for t in plain) == 0, "the unchunked run computed every prompt in one step"
    long = trajectories[2]
    chunk_steps = long.steps[: len(long.steps) - long.nfe]
    rows = [s.query_len for s in chunk_steps]
    contexts = [sum(rows[:k]) for k in range(len(rows))]
    assert all(cost_model.rows_cost(r, c) <= max_cost for r, c in zip(rows, contexts, strict=True)), (rows, contexts)
    assert rows == sorted(rows, reverse=True) and rows[0] > rows[-1], f"chunks shrink as the context grows: {rows}"
    decoder_steps = {s.step for traj in trajectories[:2] for s in traj.steps}
    assert {s.step for s in chunk_steps} <= decoder_steps, "every chunk ran beside the decoders"
