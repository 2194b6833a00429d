"""The metric definitions of docs/benchmarks.md, checked on constructed step records with hand-computed values."""

from __future__ import annotations

import pytest

from diffulex.bench.metrics import (
    Batch,
    compute_metrics,
    credited_tokens,
    decode_split,
    percentile,
    request_timings,
    step_clock,
)
from diffulex.outputs import Trajectory
from diffulex.strategy.request import StepRecord

STEP_TIMES = {0: 0.5, 1: 0.1, 2: 0.1, 3: 0.1}  # engine step -> wall time of the whole step


def traj(index, steps, new_tokens, answer_len, reason, prompt_len=10, error=None):
    records = [StepRecord(s, 4, n, (0,), (), STEP_TIMES[s]) for s, n in zip(steps, new_tokens, strict=True)]
    return Trajectory(
        index=index,
        req_id=index,
        prompt_token_ids=list(range(prompt_len)),
        token_ids=list(range(answer_len)),
        text="x" * answer_len,
        completion_reason=reason,
        nfe=len(steps),
        steps=records,
        error=error,
    )


def batch_of_three() -> Batch:
    """R1 prefills at step 0 and ends on EOS (5 answer tokens + the stop token = 6); R2 runs steps 0-1;
    R3 is admitted late (prefill at step 2) and fills 4 positions of which only 3 are its answer."""
    r1 = traj(0, [0, 1, 2, 3], [2, 0, 3, 1], 5, "eos_token_generated", prompt_len=100)
    r2 = traj(1, [0, 1], [1, 1], 2, "max_new_tokens_reached", prompt_len=50)
    r3 = traj(2, [2, 3], [0, 4], 3, "stop_string_matched", prompt_len=20)
    rejected = Trajectory(3, -1, [], [], "", "rejected", 0, error="prompt too long")
    return Batch([r1, r2, r3, rejected], wall_time=1.0)


def test_credited_tokens_clip_at_the_answer_and_sum_to_it():
    assert credited_tokens([2, 0, 3, 1], 6) == [2, 0, 3, 1]
    assert credited_tokens([0, 4], 3) == [0, 3]  # positions past the answer are not generated tokens
    assert credited_tokens([3, 3], 4) == [3, 1]
    assert credited_tokens([1], 3) == [3]  # a shortfall goes to the last step
    assert credited_tokens([], 0) == []


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile([4, 1, 3, 2], 100) == 4
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q="):
        percentile([1], 101)


def test_step_clock_orders_steps_and_accumulates_step_times():
    clock = step_clock(batch_of_three().trajectories[:3])
    assert list(clock) == [0, 1, 2, 3]
    expected = [(0.0, 0.5), (0.5, 0.6), (0.6, 0.7), (0.7, 0.8)]
    for step, (start, end) in enumerate(expected):
        assert clock[step] == (pytest.approx(start), pytest.approx(end))


def test_request_timings_latency_ttft_and_tps():
    t1, t2, t3 = request_timings(batch_of_three().trajectories)  # the rejected one is skipped
    assert (t1.generated_tokens, t1.nfe, t1.tpf) == (6, 4, 1.5)
    assert t1.latency_s == pytest.approx(0.8) and t1.ttft_s == pytest.approx(0.5)
    assert t1.tps == pytest.approx(6 / 0.8)
    assert t2.latency_s == pytest.approx(0.6) and t2.ttft_s == pytest.approx(0.5)
    # R3's first step filled nothing: its first token came at the end of step 3.
    assert t3.ttft_s == pytest.approx(0.8) and t3.latency_s == pytest.approx(0.8)
    assert t3.generated_tokens == 3 and t3.prefill_tokens == 0


def test_decode_split_excludes_every_step_that_was_some_request_s_prefill():
    tokens, seconds, n = decode_split(batch_of_three().trajectories)
    # Steps 0 (R1, R2) and 2 (R3) are prefill steps; decode steps 1 and 3 got R1 0+1, R2 1, R3 3 tokens.
    assert (tokens, n) == (5, 2)
    assert seconds == pytest.approx(0.2)


def test_run_metrics_of_a_known_trajectory():
    m = compute_metrics([batch_of_three()])
    assert m.num_requests == 3 and m.num_rejected == 1 and m.num_batches == 1
    assert m.generated_tokens == 6 + 2 + 3
    assert m.prompt_tokens == 170  # reported, never counted as generated
    assert m.total_nfe == 8
    assert m.tpf == pytest.approx(11 / 8)
    assert m.mean_nfe == pytest.approx(8 / 3)
    assert m.aggregate_tps == pytest.approx(11 / 1.0)
    assert m.mean_request_tps == pytest.approx((6 / 0.8 + 2 / 0.6 + 3 / 0.8) / 3)
    assert m.decode_tps == pytest.approx(5 / 0.2)
    assert (m.decode_tokens, m.num_decode_steps, m.num_engine_steps) == (5, 2, 4)
    assert m.step_time_s == pytest.approx(0.8)
    assert m.host_overhead_s == pytest.approx(0.2)
    assert m.ttft_mean_s == pytest.approx(0.6)
    assert m.ttft_p50_s == pytest.approx(0.5)
    assert m.ttft_p99_s == pytest.approx(0.5 + 0.3 * 0.98)
    assert m.latency_mean_s == pytest.approx(2.2 / 3)
    assert m.latency_p50_s == pytest.approx(0.8)
    assert m.latency_p99_s == pytest.approx(0.8)
    assert m.completion_reasons == {"eos_token_generated": 1, "max_new_tokens_reached": 1, "stop_string_matched": 1}


def test_tpf_of_a_single_trajectory_is_tokens_over_forwards():
    # 12 answer tokens in 3 forwards (4 per step), no stop token: TPF 4.
    r = traj(0, [0, 1, 2], [4, 4, 4], 12, "max_new_tokens_reached")
    m = compute_metrics([Batch([r], wall_time=0.7)])
    assert m.tpf == 4.0 and m.mean_nfe == 3.0 and m.generated_tokens == 12
    assert m.decode_tps == pytest.approx(8 / 0.2)  # steps 1-2 are decode steps
    assert m.aggregate_tps == pytest.approx(12 / 0.7)


def test_batches_have_their_own_clocks_and_add_up():
    a = Batch([traj(0, [0, 1], [1, 1], 2, "max_new_tokens_reached")], wall_time=0.7)
    b = Batch([traj(1, [2, 3], [2, 2], 4, "max_new_tokens_reached")], wall_time=0.3)
    m = compute_metrics([a, b])
    assert m.num_batches == 2 and m.generated_tokens == 6
    assert m.aggregate_tps == pytest.approx(6 / 1.0)
    # Batch b starts its own clock: its request's latency is 0.2 s, not 0.8 s.
    assert sorted([m.latency_p50_s, m.latency_mean_s]) == pytest.approx([0.4, 0.4])
    assert m.latency_p99_s == pytest.approx(0.2 + 0.4 * 0.99)


def test_no_requests_gives_empty_metrics_not_errors():
    m = compute_metrics([])
    assert m.num_requests == 0 and m.aggregate_tps is None and m.tpf is None and m.latency_p50_s is None
