"""``diffulex bench sweep --quick``: every target end to end on tiny checkpoints on the CPU, what each row says
about its floor, the budget guard, the tables file and the command line's refusals."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from diffulex.bench import sweep, sweep_common, sweep_serving
from diffulex.bench.sweep_decode import BASELINE, strategy_configs
from diffulex.cli import main
from diffulex.engine.prefill_cost import PrefillCostModel


@pytest.fixture(scope="module")
def quick_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One quick sweep of every target, written to a directory the tests read."""
    out = tmp_path_factory.mktemp("sweep")
    assert main(["bench", "sweep", "--quick", "--out", str(out)]) == 0
    return out


def report(out: Path, target: str) -> dict:
    data = json.loads((out / f"{target}.json").read_text())
    assert data["target"] == target and data["tool"] == "diffulex bench sweep"
    assert data["error"] is None
    assert data["hardware"]["copy_bandwidth_GBps"] > 0
    assert all(not r.get("error") and not r.get("skipped") for r in data["rows"]), data["rows"]
    return data


@pytest.mark.parametrize("target", sweep_common.DEFAULT_TARGETS)
def test_every_target_writes_its_json_plot_and_table(quick_sweep: Path, target: str) -> None:
    data = report(quick_sweep, target)
    assert data["rows"]
    assert data["table"].startswith(f"### {data['title']}") and "| model |" in data["table"]
    assert data["table"] in (quick_sweep / "tables.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (quick_sweep / f"{target}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch_rows_carry_the_floor_and_its_parts(quick_sweep: Path) -> None:
    data = report(quick_sweep, "batch")
    bandwidth = data["hardware"]["copy_bandwidth_GBps"] * 1e9
    assert sorted((r["buffer_size"], r["batch"]) for r in data["rows"]) == [(1, 2), (1, 4), (2, 2), (2, 4)]
    for r in data["rows"]:
        assert r["lm_head_bytes"] < r["weight_bytes"]
        assert r["kv_bytes_per_step"] > 0  # every decoder reads its cached prompt
        # the parts add up to the bytes the memory floor divides by the copy bandwidth
        parts = r["weight_bytes"] + r["kv_bytes_per_step"] + r["expert_bytes_per_step"] + r["embedding_bytes_per_step"]
        assert parts == pytest.approx(r["bytes_per_step"])
        # K/V: every request's cached prompt (8 tokens at least) x 2 layers x K and V x 2 heads x 16 x 4 bytes
        assert r["kv_bytes_per_step"] >= r["batch"] * 8 * 2 * 2 * 2 * 16 * 4
        assert r["memory_floor_ms"] == pytest.approx(1e3 * r["bytes_per_step"] / bandwidth, rel=0.05)
        assert r["floor_ms"] >= max(r["memory_floor_ms"], r["compute_floor_ms"]) * 0.99
        assert r["x_target"] == pytest.approx(r["floor_ratio"] / 1.3)
        assert r["met"] == (r["floor_ratio"] <= 1.3)
        # no CUDA: the engine's runner reports that none of the timed steps replayed a graph
        assert r["graphed_share"] == 0.0 and r["graphed"] is False


def test_prefill_floors_include_attention_and_a_prefix_hit_computes_only_the_tail(quick_sweep: Path) -> None:
    rows = report(quick_sweep, "prefill")["rows"]
    cold = [r for r in rows if r["case"] == "cold"]
    assert [r["prompt_len"] for r in cold] == [32, 64, 128]
    for r in cold:
        # the prompt and its first block, in one forward, whose step accepts the first token: the timed span is
        # the one step whose floor is counted
        assert r["steps"] == 1 and r["query_tokens"] == r["prompt_len"] + 4
        assert r["attn_pairs"] > r["prompt_len"] ** 2 / 2  # block-causal pairs over the whole prompt
        assert r["ttft_ms"] > 0 and r["x_compute_floor"] == pytest.approx(r["ttft_ms"] / r["compute_floor_ms"])
        assert len(r["ttft_runs_ms"]) == 2 and r["ttft_ms"] == min(r["ttft_runs_ms"]), "the lower middle of two"
    assert cold[0]["compute_floor_ms"] < cold[1]["compute_floor_ms"] < cold[2]["compute_floor_ms"]
    (hit,) = [r for r in rows if r["case"] == "prefix hit"]
    assert hit["hit"] and hit["query_tokens"] == 8 + 4  # the uncached tail and the first block
    assert len(hit["ttft_runs_ms"]) == 2, "each timed hit a tail of its own after the same cached prompt"
    assert hit["met"] == (hit["x_tail_floor"] <= 1.3)  # the tail's cost: its floor with a cold prompt's allowance
    # the tail attends to the whole cached prompt: its pairs count keys beyond its own rows
    assert hit["attn_pairs"] >= 12 * 128
    fixed, by_cost = [r for r in rows if r["case"] == "beside chunked prefill"]
    assert (fixed["chunk_tokens"], fixed["chunk_cost"]) == (32, 0)
    assert (by_cost["chunk_tokens"], by_cost["chunk_cost"]) == (64, 24)
    for beside in (fixed, by_cost):
        assert beside["decoders"] == 3 and beside["beside_steps"] >= 128 // 32
        assert beside["alone_p50_ms"] > 0 and beside["alone_after_p50_ms"] > 0 and beside["p99_vs_alone"] > 0
        assert beside["met"] == (beside["p99_vs_alone"] <= 2.0)
        # on the CPU no step replays a graph: the share is measured, not assumed
        assert beside["alone_graphed_share"] == beside["beside_graphed_share"] == 0.0
        assert sum(rows for _, rows in beside["chunks"]) == 128, "the whole prompt, chunk after chunk"
        contexts = [context for context, _ in beside["chunks"]]
        assert contexts == [sum(rows for _, rows in beside["chunks"][:k]) for k in range(len(contexts))]
        assert beside["chunk_cost_fit"]["points"] == len(beside["chunks"])
    assert max(rows for _, rows in fixed["chunks"]) <= 32 - 3 * 4, "the rows the three decoders leave"
    cost_model = PrefillCostModel(by_cost["parity_context"])
    assert all(cost_model.rows_cost(rows, context) <= 24 for context, rows in by_cost["chunks"]), by_cost["chunks"]
    by_cost_rows = [rows for _, rows in by_cost["chunks"]]
    assert by_cost_rows == sorted(by_cost_rows, reverse=True) and by_cost_rows[0] > by_cost_rows[-2]


def test_every_strategy_is_measured_against_its_familys_multi_bd(quick_sweep: Path) -> None:
    rows = report(quick_sweep, "strategies")["rows"]
    measured = {(r["model"], r["label"]) for r in rows}
    assert measured == {(c.model, c.label) for c in strategy_configs(quick=True)}
    for r in rows:
        assert r["floor_ms"] > 0 and r["floor_ratio"] > 0
        if r["label"] == BASELINE:
            assert r["vs_multi_bd"] == 1.0
        elif r["model"] == "tiny-diffusion-gemma":  # its family runs nothing else
            assert r["vs_multi_bd"] is None
        else:
            assert r["vs_multi_bd"] > 0
    gemma = [r for r in rows if r["label"] == "diffusion_gemma"]
    # its runner counts its own decoder graphs' replays: none are captured on the CPU
    assert gemma and all(r["graphed_share"] == 0.0 for r in gemma)


def test_moe_rows_read_only_the_selected_experts(quick_sweep: Path) -> None:
    data = report(quick_sweep, "moe")
    rows = data["rows"]
    assert {r["model"] for r in rows} == {"tiny-sdar-moe", "tiny-llada2"}
    for r in rows:
        # counted on the eager re-run, which on the CPU computes the timed steps exactly
        assert r["experts_counted"] and r["expert_rerun_rows_agree"] and r["expert_rerun_tokens_agree"]
        assert 0 < r["experts_per_moe_layer"] <= r["experts_per_layer_max"]
        assert r["experts_per_moe_layer"] == pytest.approx(r["experts_per_layer"])
        assert r["uniform_experts_per_moe_layer"] > 0 and r["expert_bytes_per_step"] > 0
        assert r["met"] == (r["floor_ratio"] <= 1.25)
        assert r["floor_ratio"] == pytest.approx(r["ms_per_step_mean"] / r["floor_ms"])
        assert r["uniform_floor_ratio"] == pytest.approx(r["ms_per_step_mean"] / r["uniform_floor_ms"])
    for model in ("tiny-sdar-moe", "tiny-llada2"):
        by_batch = {r["batch"]: r for r in rows if r["model"] == model}
        assert by_batch[1]["uniform_experts_per_moe_layer"] <= by_batch[2]["uniform_experts_per_moe_layer"]
        assert "profile" not in by_batch[1] and by_batch[2]["profile"]["steps"] == 8  # the largest batch only
    assert "experts read per layer (counted / uniform)" in data["table"]
    assert "Where the profiled steps' GPU time went" in data["table"]


def test_start_is_measured_in_fresh_processes_cold_then_warm(quick_sweep: Path) -> None:
    rows = report(quick_sweep, "start")["rows"]
    assert [r["case"] for r in rows] == ["cold", "warm"]
    for r in rows:
        assert 0 < r["imports_s"] < r["ready_s"]
        # the engine's phases cover the whole Diffulex(...) call: nothing of the build is left outside them
        assert sum(r["build_phases_s"].values()) == pytest.approx(r["build_s"], abs=0.1)
        assert {"engine imports", "config", "device init", "weights", "tokenizer"} <= set(r["build_phases_s"])
        assert "tokenizer import" in r["build_phases_s"] and r["first_request_s"] > 0
        # on the CPU nothing is compiled: the build's log line kept is the phases' own
        assert len(r["build_log"]) == 1 and r["build_log"][0].startswith("engine ready in")


def test_serving_streams_every_offline_token_online(quick_sweep: Path) -> None:
    rows = report(quick_sweep, "serving")["rows"]
    assert [r["concurrency"] for r in rows] == [2, 4]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == sweep_serving.REQUESTS_PER_SLOT * r["concurrency"]
        # ignore_eos: the same requests give the same tokens online and offline
        assert r["completion_tokens"] == r["offline_tokens"] > 0
        assert r["online_vs_offline"] == pytest.approx(r["online_tokens_per_s"] / r["offline_tokens_per_s"])
        # offline every slot is taken at once and the other requests wait: the batch is held for a while
        assert r["offline_saturated_seconds"] > 0 and r["offline_saturated_tokens_per_s"] > 0
        assert 0 < r["offline_saturated_mean_running"] <= r["concurrency"]
        assert r["met"] == (r["saturated_online_vs_offline"] is not None
                            and r["saturated_online_vs_offline"] >= sweep_serving.ONLINE_VS_OFFLINE_TARGET)
        assert r["online_steps"] > 0 and r["offline_steps"] > 0
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["chunk_gap_p50_ms"] <= r["chunk_gap_p99_ms"]
        assert r["offline_graphed_share"] == 0.0, "the CPU runs every step eagerly"
        # online, the engine runs where the server puts it: a process of its own, whose step paths stay there
        assert r["engine_placement"] == "process" and r["online_graphed_share"] is None


def test_a_spent_budget_skips_configurations_instead_of_running_them(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--quick", "--targets", "batch", "--max-seconds", "1e-9", "--out", str(out)]) == 0
    rows = json.loads((out / "batch.json").read_text())["rows"]
    assert rows and all(r["skipped"] and "ms_per_step_mean" not in r for r in rows)
    assert "skipped: budget" in (out / "tables.md").read_text()


def test_tables_of_separate_runs_into_one_directory_add_up(quick_sweep: Path, tmp_path: Path) -> None:
    for target in ("start", "moe"):
        (tmp_path / f"{target}.json").write_text((quick_sweep / f"{target}.json").read_text())
    text = sweep.write_tables(tmp_path).read_text()
    assert text.index("MoE") < text.index("Engine start")  # target order, whatever order they were run in


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--targets", "warp"], "invalid choice: 'warp'"),
        (["--out", "x", "--batch-sizes", "2"], "--batch-sizes: only for 'diffulex bench throughput'"),
        (["--out", "x", "--max-num-reqs", "4"], "--max-num-reqs: the sweep sets it per configuration"),
        ([], "needs --out DIR"),
    ],
)
def test_the_command_line_refuses_what_the_sweep_does_not_take(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) if "invalid choice" in message else contextlib.nullcontext():
        assert main(["bench", "sweep", "--quick", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_full_sweep_refuses_to_start_without_cuda(tmp_path: Path, capsys) -> None:
    assert main(["bench", "sweep", "--targets", "batch", "--out", str(tmp_path / "sweep")]) == 2
    err = capsys.readouterr().err
    assert "need a CUDA device" in err and "--quick" in err
    assert not (tmp_path / "sweep").exists()  # nothing measured, nothing written


def test_settings_name_the_bad_target() -> None:
    with pytest.raises(ValueError, match="targets: 'warp' is invalid: must be one of batch, prefill"):
        sweep_common.SweepSettings(targets=["warp"])


def test_a_total_budget_is_shared_among_the_targets_left() -> None:
    settings = sweep_common.SweepSettings(max_seconds=1000.0, total_seconds=270.0)
    weights = sweep_common.TARGET_WEIGHTS
    everything = list(sweep_common.TARGETS)
    assert settings.target_seconds(0.0, everything) == pytest.approx(270.0 * weights["batch"] / sum(weights.values()))
    # the first targets used less than their share: the rest share what is left, by weight
    share = weights["moe"] / (weights["moe"] + weights["start"])
    assert settings.target_seconds(170.0, ["moe", "start"]) == pytest.approx(100.0 * share)
    assert settings.target_seconds(170.0, ["serving"]) == pytest.approx(100.0)
    assert settings.target_seconds(400.0, ["serving"]) == 0.0  # overrun: the rest start nothing
    assert sweep_common.SweepSettings(max_seconds=30.0, total_seconds=1e6).target_seconds(0.0, ["start"]) == 30.0
    assert sweep_common.SweepSettings(max_seconds=7.0).target_seconds(1e6, ["start"]) == 7.0


def test_a_failing_configuration_is_recorded_and_the_next_one_starts_fresh(tmp_path: Path, monkeypatch) -> None:
    from diffulex.bench import throughput

    original = throughput.measure_decode

    def out_of_memory_at_buffer_1_batch_2(engine, batch, settings, *args):
        if batch == 2 and engine.config.buffer_size == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(engine, batch, settings, *args)

    monkeypatch.setattr(throughput, "measure_decode", out_of_memory_at_buffer_1_batch_2)
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--quick", "--targets", "batch", "--out", str(out)]) == 0
    rows = {(r["buffer_size"], r["batch"]): r for r in json.loads((out / "batch.json").read_text())["rows"]}
    assert rows[1, 2]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert rows[1, 4]["error"] == "not run: the engine failed at batch 2"
    assert rows[2, 2]["error"] is None and rows[2, 4]["floor_ratio"] > 0  # buffer 2: a fresh engine
    assert "error: OutOfMemoryError" in (out / "tables.md").read_text()
