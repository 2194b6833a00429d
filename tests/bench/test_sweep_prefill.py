"""The prefill sweep's arithmetic on decoders beside a chunked prompt: each step against the alone time at its point,
and the chunk steps' extra time fitted to the cost model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffulex.bench import sweep_prefill
from diffulex.bench.sweep_common import SweepSettings
from diffulex.bench.sweep_prefill import beside_summary, fit_chunk_cost, median_time_to_first_token
from diffulex.cli import main
from diffulex.engine.prefill_cost import PrefillCostModel


def chunk_steps(parity: float, fixed_s: float, per_row_s: float) -> list[tuple[int, int, float]]:
    """(context, rows, extra seconds) of a prompt cut into shrinking chunks, timed exactly as the cost model says."""
    points, context = [], 0
    for rows in [256] * 8 + [128] * 16 + [64] * 32:
        extra = fixed_s + per_row_s * rows * (1 + (context + rows / 2) / parity)
        points.append((context, rows, extra))
        context += rows
    return points


def test_the_fit_recovers_the_fixed_cost_and_the_parity_the_steps_were_timed_with():
    points = chunk_steps(parity=3000, fixed_s=1e-3, per_row_s=4e-6)
    fit = fit_chunk_cost(points, PrefillCostModel(3000))
    assert fit["points"] == len(points)
    assert fit["fixed_ms"] == pytest.approx(1.0, rel=1e-6)
    assert fit["per_row_us"] == pytest.approx(4.0, rel=1e-6)
    assert fit["parity_context"] == pytest.approx(3000, rel=1e-6)


def test_per_row_equivalent_the_late_chunks_cost_more_when_the_model_underprices_attention():
    points = chunk_steps(parity=3000, fixed_s=0.0, per_row_s=4e-6)
    right = fit_chunk_cost(points, PrefillCostModel(3000))
    assert right["early_us_per_row_equivalent"] == pytest.approx(right["late_us_per_row_equivalent"], rel=1e-9)
    wrong = fit_chunk_cost(points, PrefillCostModel(30000))  # attention priced ten times too cheap
    assert wrong["late_us_per_row_equivalent"] > 1.5 * wrong["early_us_per_row_equivalent"]


def test_too_few_chunk_steps_are_not_fitted():
    assert fit_chunk_cost([(0, 16, 1e-3)] * 3, None) == {"points": 3}


def test_each_step_beside_the_prompt_is_compared_with_the_alone_time_at_its_point():
    """The decoders alone took 1 ms before and 2 ms after; steps beside that take 1.5x the interpolated alone time
    read as 1.5x, though the raw p99 beside is 1.5x the later alone time (3x the earlier one)."""
    n = 100
    beside = [1.5 * (1e-3 + 1e-3 * (i + 0.5) / n) for i in range(n)]
    chunks = [(64 * i, 64) for i in range(n)]
    summary = beside_summary([1e-3] * 8, beside, [2e-3] * 8, chunks, PrefillCostModel(1000))
    assert summary["p99_vs_alone"] == pytest.approx(1.5)
    assert summary["alone_p50_ms"] == pytest.approx(1.0) and summary["alone_after_p50_ms"] == pytest.approx(2.0)
    assert summary["beside_steps"] == n and summary["prompt_ttft_ms"] == pytest.approx(1e3 * sum(beside))
    assert summary["chunks"] == [list(c) for c in chunks] and summary["first_chunk_rows"] == 64


def test_the_steps_joined_by_the_prompts_decoding_are_compared_with_the_decoders_alone_after():
    summary = beside_summary([1e-3] * 4, [2e-3] * 4, [2e-3] * 4, [(0, 32)] * 4, None, joined=[3e-3, 5e-3, 4e-3])
    assert summary["joined_steps"] == 3
    assert summary["joined_p50_ms"] == pytest.approx(4.0) and summary["joined_vs_alone"] == pytest.approx(2.0)
    alone = beside_summary([1e-3] * 4, [2e-3] * 4, [2e-3] * 4, [(0, 32)] * 4, None)
    assert alone["joined_steps"] == 0 and alone["joined_p50_ms"] is None


def test_steps_that_compute_no_prompt_rows_are_left_out_of_the_chunks():
    chunks = [(0, 32), (32, 16), (48, 0), (48, 0)]  # the prompt's last chunk, then its first decoding steps
    summary = beside_summary([1e-3] * 4, [2e-3] * 4, [1e-3] * 4, chunks, None)
    assert summary["chunks"] == [[0, 32], [32, 16]]
    assert (summary["first_chunk_rows"], summary["last_chunk_rows"]) == (32, 16)
    assert summary["chunk_cost_fit"] == {"points": 2}


def test_the_prefill_target_runs_only_the_parts_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    args = ["bench", "sweep", "--quick", "--targets", "prefill", "--prefill-parts", "beside", "--out", str(out)]
    assert main(args) == 0
    rows = json.loads((out / "prefill.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["beside chunked prefill"] * 2
    assert all(not r["error"] and not r.get("skipped") for r in rows)
    assert all(r["joined_steps"] > 0 for r in rows), "the prompt decoded among the decoders before it was aborted"


def test_an_unknown_prefill_part_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"prefill_parts=\['warm'\] is invalid: must name one or more of ttft, beside"):
        SweepSettings(prefill_parts=["warm"])


def test_the_time_to_first_token_of_several_prompts_is_the_median_one(monkeypatch) -> None:
    times = {1: 0.027, 2: 0.083, 3: 0.029, 4: 0.024, 5: 0.024}  # an H100's 2,048-token prompts after a warm-up

    def timed(engine, prompt, max_tokens, max_steps):
        return {"ttft_s": times[prompt[0]], "prompt": prompt}

    monkeypatch.setattr(sweep_prefill, "time_to_first_token", timed)
    median, every = median_time_to_first_token(None, [[k] for k in times], 4, 64)
    assert median["prompt"] == [1] and every == list(times.values())
    median, every = median_time_to_first_token(None, [[2], [4]], 4, 64)
    assert median["prompt"] == [4], "of an even count, the lower middle one"
