"""``diffulex bench canvas`` (DiffusionGemma ms per denoising step against its floor), end to end on the CPU on a
tiny geometry; its floor arithmetic by hand; its retry with fewer layers where the geometry does not fit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from diffulex.bench import canvas_steps
from diffulex.bench.canvas_steps import CanvasBenchSettings, canvas_cost_model, step_floor, write_folder
from diffulex.bench.cli import main
from diffulex.layers.parallel_state import (
    ExpertParallelGroup,
    TensorParallelGroup,
    using_expert_parallel_group,
    using_tensor_parallel_group,
)
from diffulex.models.diffusion_gemma import DiffusionGemmaForDiffusionLM
from diffulex.models.diffusion_gemma_config import DiffusionGemmaConfig


def test_the_tool_reports_each_batch_against_its_floor(tmp_path: Path) -> None:
    """Batch 1 and 2 of a 6-layer tiny geometry, 4 denoising steps per canvas: two timed steps each, positive
    step times and floors, the ratio is their quotient, and the report is the JSON written."""
    out = tmp_path / "canvas.json"
    code = main(["canvas", "--geometry", "tiny", "--batch-sizes", "1", "2", "--prompt-len", "12", "--steps", "4",
                 "--quick", "--out", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["num_layers"] == 6 and report["layers_note"] == "all 6 layers of the geometry"
    assert [r["batch"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["timed_steps"] == 2
        assert row["ms_per_step"] > 0 and row["floor_ms"] > 0 and row["decoder_ms_per_pass"] > 0
        assert row["decoder_ms_per_awaited_pass"] > 0
        assert row["floor_ratio"] == pytest.approx(row["ms_per_step"] / row["floor_ms"])
        assert row["floor_ms"] == pytest.approx(max(row["memory_floor_ms"], row["compute_floor_ms"]))
        assert 0 < row["experts_per_layer"] <= 4
        assert row["attention"] == "torch" and row["dtype"] == "float32"
        assert row["experts_impl"] == "loop"  # the CPU's own choice
    assert report["results"][1]["kv_read_GB"] == pytest.approx(2 * report["results"][0]["kv_read_GB"])


@pytest.mark.parametrize("scheduling", ["--async-scheduling", "--no-async-scheduling"])
def test_greedy_canvases_are_timed_with_or_without_their_steps_continued(tmp_path: Path, scheduling: str) -> None:
    """``--temperature 0`` times greedy canvases (the performance sweep's rule), which never end early here (the
    tool's confidence threshold of 0): every timed step is continued on the device, unless the engine flag turns
    continuations off; the report counts them."""
    out = tmp_path / "canvas.json"
    code = main(["canvas", "--geometry", "tiny", "--batch-sizes", "2", "--prompt-len", "12", "--steps", "5",
                 "--temperature", "0", scheduling, "--quick", "--out", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert report["temperature"] == 0.0 and row["timed_steps"] == 3
    assert row["continued_steps"] == (3 if scheduling == "--async-scheduling" else 0)
    assert row["dropped_continuations"] == 0


def test_profile_breaks_the_steps_and_the_decoder_pass_down_by_kernel(tmp_path: Path, monkeypatch) -> None:
    """``--profile`` runs one more batch's steps and the decoder pass under the profiler: each part reports its
    calls, its GPU time by kernel kind and its longest kernels (on the CPU no CUDA kernel runs, so none are
    listed and the kinds add up to nothing), and the timed rows are those of a run without it."""
    from diffulex.bench import gpu_profile

    calls: list[tuple[int, int]] = []
    step_calls: list[int] = []  # how often each profiled part's step ran
    profile_steps = gpu_profile.profile_steps

    def recording(step, steps, device, top=0, time_unprofiled=True):
        calls.append((steps, top))
        step_calls.append(0)

        def counted():
            step_calls[-1] += 1
            return step()

        return profile_steps(counted, steps, device, top, time_unprofiled)

    monkeypatch.setattr(gpu_profile, "profile_steps", recording)
    out = tmp_path / "canvas.json"
    code = main(["canvas", "--geometry", "tiny", "--batch-sizes", "1", "--prompt-len", "12", "--steps", "4",
                 "--quick", "--profile", "--out", str(out)])  # fmt: skip
    assert code == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["timed_steps"] == 2
    assert calls == [(2, canvas_steps.PROFILE_TOP_KERNELS), (3, canvas_steps.PROFILE_TOP_KERNELS)]
    assert step_calls[0] == 2, "the canvases' last two steps run under the profiler, none before it"
    for part, steps in (("steps", 2), ("decoder_pass", 3)):
        summary = row["profile"][part]
        assert summary["steps"] == steps and summary["wall_ms_per_step"] > 0
        assert set(summary["kernel_ms_per_step"]) >= {"moe", "attention", "gemm", "sampler", "other", "copy"}
        assert summary["top_kernels"] == [] and sum(summary["kernel_ms_per_step"].values()) == 0


def test_a_forced_expert_path_is_the_one_run_and_reported(tmp_path: Path, monkeypatch) -> None:
    """``--experts-impl dense`` sets every layer's experts to every-expert-over-every-row before the warm-up, and
    the row says so: the timed steps ran the dense path (and not the CPU's loop)."""
    from diffulex.models.diffusion_gemma import StackedExperts

    ran: set[str] = set()
    forward = StackedExperts.forward

    def recording(self, x, weights, experts):
        ran.add(self.impl_for(x))
        return forward(self, x, weights, experts)

    monkeypatch.setattr(StackedExperts, "forward", recording)
    out = tmp_path / "canvas.json"
    code = main(["canvas", "--geometry", "tiny", "--batch-sizes", "1", "--prompt-len", "12", "--steps", "3",
                 "--quick", "--experts-impl", "dense", "--out", str(out)])  # fmt: skip
    assert code == 0
    assert json.loads(out.read_text())["results"][0]["experts_impl"] == "dense"
    assert "dense" in ran and "loop" not in ran


def test_the_floor_counts_the_window_the_selected_experts_and_every_weight_once(tmp_path: Path) -> None:
    """On the tiny geometry (hidden 64, 4 experts of 3 x 64 x 32, top 2; sliding layers of 2 KV heads x 16 with a
    window of 8, global of 1 x 32): a context of 20 positions is read whole by global layers and for its last 7
    positions by sliding ones; one canvas of 16 rows selects ``4 * (1 - (1 - 2/4)^16)`` experts per layer."""
    folder, _ = write_folder(tmp_path / "m", "tiny", 6)
    config = DiffusionGemmaConfig.from_pretrained(folder)
    model = DiffusionGemmaForDiffusionLM(config)
    cost = canvas_cost_model(model, itemsize=4)
    assert cost.expert_params == 3 * 64 * 32 and cost.moe_layers == 6 and cost.lm_head_params == 384 * 64
    total = sum(p.numel() for p in model.parameters())
    assert cost.trunk_linear_params + cost.other_params + cost.lm_head_params + 6 * 4 * cost.expert_params == total
    floor = step_floor(model, cost, [20], bandwidth_bps=1e9, flops_per_s=1e12)
    sliding = sum(g.is_sliding for g in config.layers)
    kv = sliding * 2 * 2 * 16 * 7 + (6 - sliding) * 2 * 1 * 32 * 20
    assert floor["kv_read_GB"] == pytest.approx(kv * 4 / 1e9)
    assert floor["experts_per_layer"] == pytest.approx(4 * (1 - 0.5**16))
    expected_bytes = cost.weight_bytes + 6 * floor["experts_per_layer"] * cost.expert_params * 4 + 16 * 64 * 4 + kv * 4
    assert floor["step_GB"] == pytest.approx(expected_bytes / 1e9)
    assert floor["memory_floor_ms"] == pytest.approx(expected_bytes / 1e9 * 1e3)


@pytest.mark.parametrize(("tensor", "expert"), [(2, 1), (1, 2)])
def test_over_two_ranks_the_floor_is_rank_0s_step(tmp_path: Path, tensor: int, expert: int) -> None:
    """Rank 0 reads its shard of the trunk, half the experts' bytes (half of each expert's width under TP, half of
    the experts under EP) and its K/V heads, and the whole LM head, which it alone runs."""
    folder, _ = write_folder(tmp_path / "m", "tiny", 6)
    config = DiffusionGemmaConfig.from_pretrained(folder)
    whole_model = DiffusionGemmaForDiffusionLM(config)
    whole = step_floor(whole_model, canvas_cost_model(whole_model, 4), [20], 1e9, 1e12)
    with (
        using_tensor_parallel_group(TensorParallelGroup(0, tensor)),
        using_expert_parallel_group(ExpertParallelGroup(0, expert)),
    ):
        model = DiffusionGemmaForDiffusionLM(config)
    cost = canvas_cost_model(model, 4)
    floor = step_floor(model, cost, [20], 1e9, 1e12)
    assert cost.lm_head_params == 384 * 64
    assert floor["experts_GB"] == pytest.approx(whole["experts_GB"] / 2)
    if tensor == 2:  # 2 of 4 query heads; a sliding layer's 1 of 2 K/V heads, a global layer's 1 K/V head whole
        sliding = sum(g.is_sliding for g in config.layers)
        assert floor["kv_read_GB"] == pytest.approx((sliding * 2 * 16 * 7 + (6 - sliding) * 2 * 32 * 20) * 4 / 1e9)
        assert cost.trunk_linear_params < canvas_cost_model(whole_model, 4).trunk_linear_params
    else:  # attention and the trunk replicated
        assert floor["kv_read_GB"] == pytest.approx(whole["kv_read_GB"])
        assert cost.trunk_linear_params == canvas_cost_model(whole_model, 4).trunk_linear_params


def test_the_sweep_geometry_is_the_performance_sweeps_diffusion_gemma_layout(tmp_path: Path) -> None:
    """The layout whose step the sweep's strategies target times, so a profile of it explains that row; with fewer
    layers the 5 sliding : 1 global pattern is kept, ending on a global layer."""
    from diffulex.bench.sweep_models import DIFFUSION_GEMMA_LAYERS, MODELS

    folder, layers = write_folder(tmp_path / "bench", "sweep", None)
    swept = MODELS["diffusion-gemma"](tmp_path / "sweep", None)
    ours, theirs = (DiffusionGemmaConfig.from_pretrained(f) for f in (folder, swept))
    assert layers == DIFFUSION_GEMMA_LAYERS
    not_shape = ("image_token_id", "eos_token_ids", "pad_token_id", "bos_token_id", "torch_dtype")
    shape = [f.name for f in dataclasses.fields(DiffusionGemmaConfig) if f.name not in not_shape]
    assert {name: getattr(ours, name) for name in shape} == {name: getattr(theirs, name) for name in shape}
    short = DiffusionGemmaConfig.from_pretrained(write_folder(tmp_path / "short", "sweep", 12)[0])
    assert short.layer_types == ours.layer_types[:12]


def test_a_geometry_that_does_not_fit_is_measured_with_fewer_layers(tmp_path: Path, monkeypatch) -> None:
    """Out of memory at 12 layers: every batch size is measured again with 6, and the report says so."""
    layers_seen = []

    def measure(folder, settings, batch, peaks, log):
        layers = json.loads((folder / "config.json").read_text())["text_config"]["num_hidden_layers"]
        layers_seen.append((layers, batch))
        if layers > 6:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"batch": batch, "layers": layers}

    monkeypatch.setattr(canvas_steps, "measure", measure)
    settings = CanvasBenchSettings(geometry="tiny", num_layers=12, batch_sizes=[1, 8], quick=True)
    report = canvas_steps.run(settings, tmp_path / "r.json", log=lambda line: None)
    assert layers_seen == [(12, 1), (6, 1), (6, 8)]
    assert report["num_layers"] == 6
    assert report["layers_note"] == "6 of the geometry's 12 layers: 12 do not fit this device"
    assert json.loads((tmp_path / "r.json").read_text())["results"] == [{"batch": 1, "layers": 6},
                                                                        {"batch": 8, "layers": 6}]  # fmt: skip


@pytest.mark.parametrize(("changes", "message"), [
    ({"steps": 2}, "steps=2 must be >= 3"),
    ({"geometry": "70b"}, "geometry='70b' must be one of 26b-a4b, sweep, tiny"),
    ({"num_layers": 0}, "num_layers=0 must be >= 1"),
    ({"experts_impl": "loop"}, "experts_impl='loop' must be one of fused, grouped, dense"),
    ({"temperature": -0.5}, "temperature=-0.5 must be >= 0"),
])  # fmt: skip
def test_bad_settings_are_refused_by_name(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CanvasBenchSettings(**changes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the published geometry is refused only without CUDA")
def test_the_published_geometry_is_refused_without_cuda(capsys) -> None:
    assert main(["canvas", "--batch-sizes", "1"]) == 2
    assert "geometry='26b-a4b' needs a CUDA device" in capsys.readouterr().err


def test_flags_of_other_actions_are_refused() -> None:
    assert main(["canvas", "--geometry", "tiny", "--buffer-sizes", "2"]) == 2
    assert main(["throughput", "--steps", "3"]) == 2
