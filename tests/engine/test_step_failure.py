"""A failure inside a step finishes only the requests it is traced to; the engine goes on serving.

Faults are injected by replacing one function for the duration of a test: the engine code under test is the real
one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import diffulex.sampler.rows as confidence
from diffulex import Diffulex, SamplingParams
from diffulex.errors import EngineClosedError, EngineDeadError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37]]


def engine(model_dir: Path, **fields):
    base = dict(block_size=4, page_size=8, buffer_size=2, max_model_len=64, max_num_batched_tokens=256, num_pages=64)
    base.update(fields)
    return Diffulex(str(model_dir), **base)


@pytest.fixture(scope="module")
def idle_answers(sdar_dir: Path) -> list[list[int]]:
    with engine(sdar_dir) as llm:
        return [t.token_ids for t in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_sampling_failure_fails_only_its_request(sdar_dir: Path, idle_answers, monkeypatch) -> None:
    real_sample = confidence.sample

    def sample_failing_for_seed_13(logits, temperature, top_k, top_p, generator):
        if generator.initial_seed() // 1_000_003 == 13:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_sample(logits, temperature, top_k, top_p, generator)

    monkeypatch.setattr(confidence, "sample", sample_failing_for_seed_13)
    with engine(sdar_dir) as llm:
        params = [GREEDY, SamplingParams(temperature=0.7, seed=13, max_tokens=12), GREEDY]
        out = llm.generate(PROMPTS[:1] + [[41, 42, 43]] + PROMPTS[2:], params, use_tqdm=False)
        assert out[1].completion_reason == "error"
        assert "sampling failed for request" in out[1].error and "inf, nan" in out[1].error
        assert [out[0].token_ids, out[2].token_ids] == [idle_answers[0], idle_answers[2]]
        assert out[0].error is None and out[2].error is None
        assert llm.scheduler.kv_cache.num_used_pages == 0


def test_an_untraced_failure_fails_the_step_and_the_engine_serves_the_next_call(
    sdar_dir: Path, idle_answers, monkeypatch
) -> None:
    with engine(sdar_dir) as llm:
        real_launch = llm.runner.launch
        calls = {"n": 0}

        def launch_failing_on_the_third_step(batch, micro_batch=0):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected kernel failure")
            return real_launch(batch, micro_batch)

        monkeypatch.setattr(llm.runner, "launch", launch_failing_on_the_third_step)
        failed = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert {t.completion_reason for t in failed} == {"error"}
        assert all("injected kernel failure" in t.error for t in failed)
        assert llm.scheduler.kv_cache.num_used_pages == 0 and not llm.scheduler.running
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [t.token_ids for t in again] == idle_answers


def test_a_failure_while_applying_a_result_does_not_lose_the_requests_outside_the_step(
    sdar_dir: Path, idle_answers, monkeypatch
) -> None:
    """micro_batches=2: the two halves take turns; one half's failure leaves the other half's answers intact."""
    with engine(sdar_dir, micro_batches=2) as llm:
        real_finish = llm.scheduler.finish_step
        doomed = {}

        def finish_step_failing_for_the_first_request(req, writes):
            if req.req_id == min(doomed.values()) and req.nfe == 2:
                raise RuntimeError("injected bookkeeping failure")
            return real_finish(req, writes)

        ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
        doomed.update(enumerate(ids))
        monkeypatch.setattr(llm.scheduler, "finish_step", finish_step_failing_for_the_first_request)
        finished = {}
        while not llm.is_finished():
            for update in llm.step():
                if update.finished:
                    assert update.req_id not in finished, "a request was reported finished twice"
                    finished[update.req_id] = update.trajectory
        assert set(finished) == set(ids)  # nothing accepted is lost
        assert finished[ids[0]].completion_reason == "error"
        survivors = [finished[i] for i in ids[1:] if finished[i].completion_reason != "error"]
        assert survivors, "the other micro-batch's requests must go on"
        for traj in survivors:
            assert traj.token_ids == idle_answers[ids.index(traj.req_id)]


def test_a_failed_device_stops_the_engine_for_good(sdar_dir: Path, monkeypatch) -> None:
    with engine(sdar_dir) as llm:
        def launch_on_a_lost_device(batch, micro_batch=0):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(llm.runner, "launch", launch_on_a_lost_device)
        monkeypatch.setattr(llm, "_device_works", lambda: False)
        llm.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            llm.step()
        with pytest.raises(EngineDeadError):
            llm.add_request(PROMPTS[1], GREEDY)


@pytest.mark.parametrize("temperature", [1e-40, 1e-320, 100.0])
def test_extreme_accepted_temperatures_run_and_leave_the_engine_healthy(
    sdar_dir: Path, idle_answers, temperature
) -> None:
    with engine(sdar_dir) as llm:
        odd = llm.generate(PROMPTS[0], SamplingParams(temperature=temperature, max_tokens=12, seed=1), use_tqdm=False)
        assert odd[0].error is None and odd[0].completion_reason != "error"
        if temperature < 1e-5:  # too small to draw with: greedy
            assert odd[0].token_ids == idle_answers[0]
        assert [t.token_ids for t in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == idle_answers


def test_a_closed_engine_says_so(sdar_dir: Path) -> None:
    llm = engine(sdar_dir)
    llm.exit()
    with pytest.raises(EngineClosedError, match=r"exit\(\) was called"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    with pytest.raises(EngineClosedError):
        llm.add_request(PROMPTS[0], GREEDY)
