"""Metric definitions of `diffulex.outputs`: generated tokens, TPF, NFE, TPS on hand-made trajectories."""

from __future__ import annotations

import pytest

from diffulex.outputs import GenerationOutputs, Trajectory


def traj(n_tokens: int, reason: str | None, nfe: int, error: str | None = None, index: int = 0) -> Trajectory:
    return Trajectory(
        index=index,
        req_id=index,
        prompt_token_ids=[1, 2, 3],
        token_ids=list(range(100, 100 + n_tokens)),
        text="x" * n_tokens,
        completion_reason=reason,
        nfe=nfe,
        error=error,
    )


def test_a_trajectory_ending_on_eos_counts_the_stop_token():
    t = traj(10, "eos_token_generated", 4)
    assert t.ended_on_stop_token
    assert t.num_generated_tokens == 11
    assert t.tpf == pytest.approx(2.75)


@pytest.mark.parametrize(
    "reason", ["max_new_tokens_reached", "max_model_len_reached", "max_nfe_reached", "max_repetition_run_reached",
               "aborted", None],
)
def test_other_reasons_count_only_the_answer_tokens(reason):
    t = traj(10, reason, 4)
    assert not t.ended_on_stop_token
    assert t.num_generated_tokens == 10
    assert t.tpf == pytest.approx(2.5)


def test_prompt_tokens_never_count():
    assert traj(0, "max_nfe_reached", 3).num_generated_tokens == 0


def test_tpf_of_a_trajectory_without_forwards_is_zero():
    assert traj(0, "rejected", 0, error="bad").tpf == 0.0


def test_aggregate_tpf_is_a_ratio_of_sums_not_a_mean_of_ratios():
    out = GenerationOutputs([traj(10, "eos_token_generated", 4), traj(3, "max_new_tokens_reached", 1)], 2.0, 5)
    assert out.num_generated_tokens == 14
    assert out.total_nfe == 5
    assert out.tpf == pytest.approx(14 / 5)
    assert out.tpf != pytest.approx((2.75 + 3.0) / 2)


def test_mean_nfe_is_over_the_requests_that_ran():
    out = GenerationOutputs(
        [traj(10, "eos_token_generated", 4), traj(0, "rejected", 0, error="prompt too long", index=1),
         traj(3, "max_new_tokens_reached", 2, index=2)],
        1.0,
        4,
    )
    assert out.nfe == pytest.approx(3.0)
    assert out.tpf == pytest.approx(14 / 6)


def test_tps_is_generated_tokens_over_wall_time():
    out = GenerationOutputs([traj(10, "eos_token_generated", 4), traj(3, "max_new_tokens_reached", 1)], 2.0, 5)
    assert out.tps == pytest.approx(7.0)


def test_empty_or_instant_outputs_have_zero_metrics():
    empty = GenerationOutputs([], 0.0, 0)
    assert (empty.tpf, empty.tps, empty.nfe, empty.num_generated_tokens) == (0.0, 0.0, 0.0, 0)
    only_rejected = GenerationOutputs([traj(0, "rejected", 0, error="bad")], 0.5, 0)
    assert (only_rejected.tpf, only_rejected.nfe, only_rejected.tps) == (0.0, 0.0, 0.0)


def test_outputs_behave_like_a_sequence_of_trajectories():
    trajs = [traj(2, "max_new_tokens_reached", 2), traj(1, "eos_token_generated", 1, index=1)]
    out = GenerationOutputs(trajs, 1.0, 2)
    assert len(out) == 2 and out[1] is trajs[1] and list(out) == trajs
    assert out.texts == ["xx", "x"]


def test_summary_reports_the_metrics():
    out = GenerationOutputs([traj(10, "eos_token_generated", 4), traj(3, "max_new_tokens_reached", 1)], 2.0, 5)
    text = out.summary()
    assert "2 requests" in text and "14 tokens" in text and "TPF 2.80" in text and "mean NFE 2.5" in text


def test_summary_of_one_request_says_request():
    """The command line prints the summary after every demo, which most often has one prompt."""
    text = GenerationOutputs([traj(3, "eos_token_generated", 2)], 1.0, 2).summary()
    assert text.startswith("1 request, 4 tokens in ")
