"""Micro-batches (``micro_batches=2``): two halves of the running requests take turns, one in flight while the
host finishes the other. Every request must decode exactly as it does with one batch per step."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffulex import SamplingParams
from tests.engine.test_cuda_graph import with_static_decode
from tests.engine.test_engine_matches_reference import assert_matches_reference, make_engine, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LENGTHS = [3, 6, 9, 12, 14, 5, 7, 2]


def _answers(outputs) -> list[tuple[list[int], int, str | None]]:
    return [(t.token_ids, t.nfe, t.completion_reason) for t in outputs.trajectories]


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-buffers"])
def test_two_micro_batches_give_the_tokens_of_one_batch(peaky_sdar_dir: Path, static: bool) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(temperature=0.8, seed=5, max_tokens=30)]
    results = []
    for micro_batches in (1, 2):
        with make_engine(peaky_sdar_dir, buffer_size=2, accept_threshold=0.8, micro_batches=micro_batches) as llm:
            if static:
                with_static_decode(llm)
            prompts = random_prompts(llm, LENGTHS, seed=3)
            results.append(_answers(llm.generate(prompts, params * 4, use_tqdm=False)))
    assert results[0] == results[1]


def test_micro_batches_match_the_reference_decoder_under_preemption(peaky_sdar_dir: Path) -> None:
    # 10 pages of 8 tokens cannot hold eight requests of up to ~45 tokens: requests are preempted and rebuilt,
    # and a request whose step is in flight is never the one preempted
    fields = dict(buffer_size=2, accept_threshold=0.8, num_pages=10, max_model_len=64, micro_batches=2)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, LENGTHS, seed=8)
        trajectories = assert_matches_reference(llm, prompts, SamplingParams(temperature=0, max_tokens=30))
    assert sum(t.num_preemptions for t in trajectories) > 0


def test_consecutive_steps_serve_disjoint_halves_of_the_requests(sdar_dir: Path) -> None:
    with make_engine(sdar_dir, micro_batches=2, max_num_reqs=8) as llm:
        for prompt in random_prompts(llm, LENGTHS, seed=4):
            llm.add_request(prompt, GREEDY)
        served = [{u.req_id for u in llm.step()} for _ in range(12)]
        assert len(llm.scheduler.running) == 8, "no request finished yet"
    assert all(len(ids) == 4 for ids in served), served
    assert all(not (a & b) for a, b in zip(served, served[1:], strict=False)), "a request ran in two steps in a row"
    assert served[0] | served[1] == set(range(8))


def test_a_request_aborted_while_its_step_is_in_flight_is_dropped(sdar_dir: Path) -> None:
    with make_engine(sdar_dir, micro_batches=2, max_num_reqs=8) as llm:
        prompts = random_prompts(llm, LENGTHS, seed=5)
        ids = [llm.add_request(p, GREEDY) for p in prompts]
        llm.step()
        assert len(llm._in_flight) == 2, "a step returns with both micro-batches launched"
        in_flight = llm._in_flight[0]  # the one the next call completes
        victim = in_flight.batch[0].req_id
        assert llm.abort_request(victim)
        updates = llm.step()
        assert victim not in {u.req_id for u in updates}
        assert {u.req_id for u in updates} == {r.req_id for r in in_flight.batch} - {victim}
        finished = {}
        while not llm.is_finished():
            finished.update({u.req_id: u for u in llm.step() if u.finished})
    assert set(finished) == set(ids) - {victim}
    assert all(u.trajectory.completion_reason == "max_new_tokens_reached" for u in finished.values())


def test_one_request_runs_alone_with_two_micro_batches(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, micro_batches=2) as llm:
        assert_matches_reference(llm, random_prompts(llm, [9]), GREEDY)


@pytest.mark.parametrize("value", [0, 3, "2", 1.5])
def test_micro_batches_must_be_one_or_two(sdar_dir: Path, value) -> None:
    with pytest.raises(ValueError, match="micro_batches"):
        make_engine(sdar_dir, micro_batches=value)


def test_a_step_returns_with_the_next_step_already_launched_and_an_abort_still_drops_its_result(
    sdar_dir: Path,
) -> None:
    """With one batch the engine launches the next step before it builds the updates it returns, so the GPU
    computes while the host reports; a request aborted between calls is in that launched step."""
    with make_engine(sdar_dir, max_num_reqs=8) as llm:
        ids = [llm.add_request(p, GREEDY) for p in random_prompts(llm, LENGTHS, seed=6)]
        first = llm.step()
        assert {u.req_id for u in first} == set(ids)
        (in_flight,) = llm._in_flight
        assert {r.req_id for r in in_flight.batch} == set(ids), "the next step is launched before returning"
        victim = ids[3]
        assert llm.abort_request(victim)
        assert {u.req_id for u in llm.step()} == set(ids) - {victim}
        finished = {}
        while not llm.is_finished():
            finished.update({u.req_id: u for u in llm.step() if u.finished})
        assert not llm._in_flight, "nothing is launched once every request has finished"
    assert set(finished) == set(ids) - {victim}
