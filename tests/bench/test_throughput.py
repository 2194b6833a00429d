"""``diffulex bench throughput``: the floor arithmetic (checked by hand), the SDAR geometry folders, the GPU
activity summary, and an end-to-end CPU run on a tiny checkpoint that writes the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffulex.bench import throughput
from diffulex.bench.gpu_profile import (
    KernelInterval,
    category,
    kernel_intervals,
    longest_kernels,
    named_by_predecessor,
    summarize_activity,
    union_length,
)
from diffulex.bench.roofline import (
    Floors,
    ModelGeometry,
    StepWork,
    block_causal_pairs,
    cost_model_from_module,
    linear_roofline,
    step_bytes,
    step_experts,
    step_floors,
    step_flops,
    summarize_floors,
)
from diffulex.cli import main
from diffulex.models.loader import build_model
from diffulex.testing import write_tiny_checkpoint

# hidden 8, 2 layers, 2 query heads and 1 KV head of dim 4, MLP 16, vocabulary 32, untied, 2-byte weights.
TINY = ModelGeometry(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                     vocab_size=32, tied=False)


# ----- floor arithmetic -------------------------------------------------------------------------------------


def test_the_cost_model_counts_each_weight_once_by_hand():
    cost = TINY.cost_model(itemsize=2)
    # per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate/up/down 3 x 8x16 = 64 + 32 + 32 + 64 + 384 = 576
    assert cost.trunk_linear_params == 2 * 576
    assert cost.lm_head_params == 32 * 8
    assert cost.other_params == 2 * (2 * 8 + 2 * 4) + 8  # two norms and q/k norms per layer, the final norm
    assert cost.kv_per_token == 2 * 2 * 1 * 4  # K and V, 2 layers, 1 KV head of dim 4
    assert cost.attn_flops_per_pair == 4 * 2 * 2 * 4  # QK^T and PV, 2 layers, 2 heads of dim 4
    assert cost.weight_bytes == (1152 + 256 + 56) * 2


def test_block_causal_pairs_see_up_to_the_end_of_their_own_block():
    # positions 20..23 see keys 0..23, positions 24..27 see 0..27
    assert block_causal_pairs(20, 28, 4) == 4 * 24 + 4 * 28
    # a query that starts mid-block (a shifted family recomputes one cached position) and ends mid-block
    assert block_causal_pairs(19, 22, 4) == 1 * 20 + 2 * 22
    assert block_causal_pairs(5, 5, 4) == 0


def test_bytes_flops_and_floors_of_a_step_by_hand():
    cost = TINY.cost_model(itemsize=2)
    work = StepWork(query_tokens=8, logit_rows=3, context_tokens=20, written_tokens=4,
                    attn_pairs=block_causal_pairs(20, 28, 4))
    # weights once + 8 gathered embedding rows of 8 + K/V of 20 read and 4 written tokens, 16 elements each
    assert step_bytes(cost, work) == 1464 * 2 + (8 * 8 + 16 * 24) * 2 == 3824
    # 2 x 1152 x 8 query tokens + 2 x 256 x 3 logit rows + 64 x 208 pairs
    assert step_flops(cost, work) == 18432 + 1536 + 13312 == 33280
    floors = step_floors(cost, work, bandwidth_bps=1000.0, flops_per_s=10000.0)
    assert floors.memory_s == pytest.approx(3.824)
    assert floors.compute_s == pytest.approx(3.328)
    summary = summarize_floors(7.648, [floors])
    assert summary["bound"] == "memory"
    assert summary["floor_ms"] == pytest.approx(3824.0)
    assert summary["floor_ratio"] == pytest.approx(2.0)
    assert summary["memory_floor_ratio"] == pytest.approx(2.0)
    assert summary["compute_floor_ratio"] == pytest.approx(7.648 / 3.328)


def test_the_graphed_share_of_a_phase_is_its_launches_that_were_not_eager():
    class Runner:
        launched_steps, eager_steps = 10, 4

    engine = type("Engine", (), {"runner": Runner()})()
    before = throughput.step_paths(engine)
    Runner.launched_steps, Runner.eager_steps = 18, 6
    assert throughput.graphed_share(before, throughput.step_paths(engine)) == pytest.approx(1 - 2 / 8)
    assert throughput.graphed_share(before, before) is None, "no step ran"
    assert throughput.step_paths(type("Engine", (), {"runner": object()})()) is None


def test_the_floor_of_a_run_is_the_mean_of_each_steps_larger_floor():
    summary = summarize_floors(3.0, [Floors(2.0, 1.0), Floors(1.0, 2.0)])
    assert summary["floor_ms"] == pytest.approx(2000.0)  # not max(mean memory, mean compute) = 1.5 s
    assert summary["floor_ratio"] == pytest.approx(1.5)


def test_the_cost_model_of_a_built_model_matches_its_config(tmp_path):
    for tied in (False, True):
        ckpt = write_tiny_checkpoint(tmp_path / str(tied), tie_word_embeddings=tied)
        config = json.loads((ckpt / "config.json").read_text())
        model = build_model("sdar", ckpt, torch.float32, "cpu")
        assert cost_model_from_module(model, 4) == ModelGeometry.from_config(config).cost_model(4)


def test_an_moe_model_reads_the_experts_its_rows_choose(tmp_path):
    """SDAR-MoE tiny (2 MoE layers of 4 experts, top 2, experts of 3 x 32 x 64): the routed experts leave the
    always-read weights, and a step reads the expected distinct ones, multiplying through 2 per row."""
    ckpt = write_tiny_checkpoint(tmp_path / "moe", family="sdar_moe")
    model = build_model("sdar_moe", ckpt, torch.float32, "cpu")
    cost = cost_model_from_module(model, 2)
    assert (cost.moe_layers, cost.num_experts, cost.experts_per_token, cost.expert_params) == (2, 4, 2, 3 * 32 * 64)
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v (2 KV heads of 16), o
    assert cost.trunk_linear_params == 2 * (attention + 4 * 64)  # plus each layer's router, no expert
    assert cost.expected_experts(1) == pytest.approx(2.0)
    assert cost.expected_experts(3) == pytest.approx(4 * (1 - 0.5**3))
    work = StepWork(query_tokens=3, logit_rows=3, context_tokens=0, written_tokens=0, attn_pairs=9)
    dense = StepWork(0, 0, 0, 0, 0)
    assert step_bytes(cost, work) - step_bytes(cost, dense) == round(2 * 3.5 * 6144 * 2) + 3 * 64 * 2
    assert step_flops(cost, work) == (
        2 * cost.trunk_linear_params * 3 + 2 * 2 * 2 * 6144 * 3 + 2 * cost.lm_head_params * 3
        + cost.attn_flops_per_pair * 9
    )


def test_counted_experts_replace_the_uniform_estimate_in_the_bytes_only(tmp_path):
    """Tiny SDAR-MoE (experts of 6144 elements): a step whose layers selected 5 experts in all reads 5 experts'
    weights, whatever its rows; its flops (every row through its top 2) do not depend on the count."""
    ckpt = write_tiny_checkpoint(tmp_path / "moe", family="sdar_moe")
    cost = cost_model_from_module(build_model("sdar_moe", ckpt, torch.float32, "cpu"), 2)
    work = StepWork(query_tokens=8, logit_rows=3, context_tokens=16, written_tokens=4, attn_pairs=100)
    none = StepWork(0, 0, 16, 4, 0)
    assert step_bytes(cost, work, 5) - step_bytes(cost, none, 0) == 5 * 6144 * 2 + 8 * 64 * 2
    assert step_bytes(cost, work) == step_bytes(cost, work, step_experts(cost, work))
    assert step_experts(cost, work) == pytest.approx(2 * 4 * (1 - 0.5**8))
    counted = step_floors(cost, work, bandwidth_bps=1e6, flops_per_s=1e15, experts_read=5)
    assert counted.memory_s == pytest.approx(step_bytes(cost, work, 5) / 1e6)
    assert counted.compute_s == step_floors(cost, work, bandwidth_bps=1e6, flops_per_s=1e15).compute_s


def forced_route(choices: list[tuple[int, int]]):
    """Row ``r`` routed to the experts ``choices[r % len(choices)]``, each weighted 0.5."""

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        experts = torch.tensor([choices[r % len(choices)] for r in range(x.shape[0])], dtype=torch.int64)
        return torch.full((x.shape[0], 2), 0.5), experts

    return route


def test_the_moe_floor_is_taken_on_the_experts_a_forced_router_selects(tmp_path):
    """Tiny SDAR-MoE with its routers forced: layer 0 sends every row to experts 1 and 3, layer 1 alternates
    (0, 1) and (0, 2). Every decode step of 2 requests x 4 rows then reads 2 + 3 experts: the counted floor is
    taken on exactly that, while the uniform columns are what a run without counting reports."""
    from diffulex import Diffulex
    from diffulex.bench.hardware import HardwarePeaks
    from diffulex.layers.moe import SparseMoE

    ckpt = write_tiny_checkpoint(tmp_path / "moe", family="sdar_moe")
    settings = throughput.ThroughputSettings(batch_sizes=[2], buffer_sizes=[1], prompt_len=8, max_tokens=24,
                                             block_size=4, max_steps=5, warmup_tokens=4)
    peaks = HardwarePeaks("cpu", 1, copy_bandwidth_bps=1e9, matmul_size=1)
    entry = throughput.ModelEntry("tiny", str(ckpt), "safetensors")
    with Diffulex(str(ckpt), **settings.engine_fields(entry, 1)) as engine:
        first, second = [m for m in engine.model.modules() if isinstance(m, SparseMoE)]
        first.gate.route = forced_route([(1, 3)])
        second.gate.route = forced_route([(0, 1), (0, 2)])
        cost = cost_model_from_module(engine.model, 4)
        plain = throughput.measure_decode(engine, 2, settings, cost, peaks, 1e15)
        row = throughput.measure_decode(engine, 2, settings, cost, peaks, 1e15, count_experts=True)
        assert not first._forward_pre_hooks and not second._forward_pre_hooks  # the recorder closed
    assert plain["experts_counted"] is False and "uniform_floor_ms" not in plain
    assert row["experts_counted"] is True and row["expert_count_steps"] == row["steps"] == 5
    assert row["expert_rerun_rows_agree"] and row["expert_rerun_tokens_agree"]
    assert (row["experts_per_layer"], row["experts_per_layer_min"], row["experts_per_layer_max"]) == (2.5, 2, 3)
    assert row["experts_read_per_step"] == 5
    assert row["query_tokens_per_step"] == 8
    uniform = 2 * 4 * (1 - 0.5**8)
    assert row["uniform_experts_read_per_step"] == pytest.approx(uniform)
    assert row["bytes_per_step"] - row["uniform_bytes_per_step"] == pytest.approx((5 - uniform) * 6144 * 4, abs=1)
    # every step memory-bound (a copy rate of 1 GB/s): the floor is the mean bytes over the copy rate
    assert row["floor_ms"] == pytest.approx(1e3 * row["bytes_per_step"] / 1e9)
    assert row["floor_ratio"] == pytest.approx(row["ms_per_step_mean"] / row["floor_ms"])
    # the uniform columns of the counted run are the floors of the same steps without counting
    assert row["uniform_bytes_per_step"] == plain["bytes_per_step"]
    assert row["uniform_floor_ms"] == pytest.approx(plain["floor_ms"])
    assert row["uniform_experts_read_per_step"] == plain["experts_read_per_step"]


def test_counting_pairs_the_rerun_with_steps_timed_on_the_static_graph_path(tmp_path):
    """Timed on the graphs' static path (uncaptured on the CPU), whose steps are continued on the device: the
    count's eager re-run still computes the timed steps' rows and tokens step by step, and the runner gets its
    graphs back."""
    from diffulex import Diffulex
    from diffulex.bench.hardware import HardwarePeaks

    ckpt = write_tiny_checkpoint(tmp_path / "moe", family="sdar_moe")
    settings = throughput.ThroughputSettings(batch_sizes=[2], buffer_sizes=[1], prompt_len=8, max_tokens=24,
                                             block_size=4, max_steps=6, warmup_tokens=4)
    entry = throughput.ModelEntry("tiny", str(ckpt), "safetensors")
    with Diffulex(str(ckpt), **settings.engine_fields(entry, 1)) as engine:
        engine.enable_static_decode(capture=False)
        graphs = engine.runner.graphs
        cost = cost_model_from_module(engine.model, 4)
        row = throughput.measure_decode(engine, 2, settings, cost, HardwarePeaks("cpu", 1, 1e9, 1), 1e15, True)
        assert engine.runner.graphs is graphs
    assert row["continued_steps"] > 0  # the timed steps ran ahead on the device; the re-run's did not
    assert row["experts_counted"] and row["expert_count_steps"] == 6
    assert row["expert_rerun_rows_agree"] and row["expert_rerun_tokens_agree"]
    assert 1 <= row["experts_per_layer_min"] <= row["experts_per_layer"] <= row["experts_per_layer_max"] <= 4


def test_with_micro_batches_the_experts_are_not_counted_and_the_row_says_why(tmp_path):
    from diffulex import Diffulex
    from diffulex.bench.hardware import HardwarePeaks

    ckpt = write_tiny_checkpoint(tmp_path / "moe", family="sdar_moe")
    settings = throughput.ThroughputSettings(batch_sizes=[2], buffer_sizes=[1], prompt_len=8, max_tokens=24,
                                             block_size=4, max_steps=4, warmup_tokens=4)
    entry = throughput.ModelEntry("tiny", str(ckpt), "safetensors")
    with Diffulex(str(ckpt), **settings.engine_fields(entry, 1), micro_batches=2) as engine:
        cost = cost_model_from_module(engine.model, 4)
        row = throughput.measure_decode(engine, 2, settings, cost, HardwarePeaks("cpu", 1, 1e9, 1), 1e15, True)
    assert row["experts_counted"] is False and "micro_batches=1" in row["expert_count_error"]
    assert row["experts_read_per_step"] == row["uniform_experts_read_per_step"]  # the floor stays uniform
    assert "per_step" not in row and "uniform_floor_ms" not in row


def test_a_linear_on_the_roofline_by_hand():
    # 2 x 4 x 8 x 16 = 1024 flops; (4x16 + 8x16 + 4x8) x 2 bytes = 448 bytes
    row = linear_roofline(m=4, n=8, k=16, itemsize=2, seconds=2.0, bandwidth_bps=448.0, flops_per_s=1024.0)
    assert row["tflops"] == pytest.approx(512 / 1e12)
    assert row["pct_of_matmul_peak"] == pytest.approx(50.0)
    assert row["roofline_ms"] == pytest.approx(1000.0)
    assert row["pct_of_roofline"] == pytest.approx(50.0)


# ----- GPU activity ------------------------------------------------------------------------------------------


def test_busy_time_is_the_union_of_kernel_intervals():
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.8)]) == 4
    assert union_length([]) == 0


def test_kernels_are_grouped_by_name():
    assert category("_paged_attention_kernel") == "attention"
    assert category("_store_kv_kernel") == "attention"
    assert category("_gate_up_kernel") == "moe" and category("_combine_kernel") == "moe"  # the fused MoE kernels
    grouped = "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<"
    assert category(grouped) == "moe"  # torch's grouped GEMM: the experts, not a dense linear
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert category("nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert category("_top1_kernel") == "sampler"
    assert category("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>") == "sampler"
    assert category("Memcpy HtoD (Pageable -> Device)") == "copy"
    assert category("void at::native::vectorized_elementwise_kernel<4, silu>") == "other"


def test_activity_summary_counts_copies_as_idle():
    kernels = [KernelInterval("gemm", 0, 400), KernelInterval("_paged_attention_kernel", 300, 500),
               KernelInterval("Memcpy HtoD", 600, 900)]
    summary = summarize_activity(kernels, wall_s=1e-3, steps=2)
    assert summary["gpu_busy_share"] == pytest.approx(0.5)
    assert summary["gpu_idle_share"] == pytest.approx(0.5)
    assert summary["kernels_per_step"] == 1.0
    assert summary["kernel_ms_per_step"]["gemm"] == pytest.approx(0.2)
    assert summary["kernel_ms_per_step"]["copy"] == pytest.approx(0.15)
    assert summary["kernel_ms_per_step"]["moe"] == 0.0
    assert "top_kernels" not in summary


def test_activity_summary_names_the_longest_kernels_per_step():
    kernels = [KernelInterval("gemm", 0, 400), KernelInterval("_rms_norm_kernel", 400, 450),
               KernelInterval("gemm", 500, 700), KernelInterval("_paged_attention_kernel", 700, 1000)]  # fmt: skip
    top = summarize_activity(kernels, wall_s=1e-3, steps=2, top=2)["top_kernels"]
    assert [k["kernel"] for k in top] == ["gemm", "_paged_attention_kernel"]
    assert top[0] == {"kernel": "gemm", "category": "gemm", "calls_per_step": 1.0, "ms_per_step": pytest.approx(0.3)}
    assert top[1]["ms_per_step"] == pytest.approx(0.15) and top[1]["category"] == "attention"


def test_only_the_devices_activity_is_read_from_a_profile():
    """Kernels and copies count; host events and the profiler's annotations on the device do not."""
    from types import SimpleNamespace

    def event(name, device, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=1.0, end=3.0))  # fmt: skip

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    profiler = SimpleNamespace(events=lambda: [event("gemm", cuda), event("aten::mm", cpu), event("step", cuda, True),
                                               event("Memcpy HtoD", cuda)])  # fmt: skip
    assert kernel_intervals(profiler) == [KernelInterval("gemm", 1.0, 3.0), KernelInterval("Memcpy HtoD", 1.0, 3.0)]


def test_one_library_kernel_splits_by_the_kernel_before_it():
    """A GEMM kernel that runs two projections (o_proj after attention, down after gate_up) becomes two rows, whatever
    order the profiler reported the launches in."""
    layer = ["_rms_norm_kernel", "nvjet_96x64", "_paged_attention_kernel", "nvjet_64x64", "_rms_norm_kernel",
             "_skinny_kernel", "nvjet_64x64"]  # fmt: skip
    kernels = [KernelInterval(name, 10 * i, 10 * i + 5 + i) for i, name in enumerate(layer * 2)]
    named = named_by_predecessor(list(reversed(kernels)))
    assert named[0].name == "_rms_norm_kernel (after nothing)"
    assert named[len(layer)].name == "_rms_norm_kernel (after nvjet_64x64)"
    rows = {name: (calls, total) for name, calls, total in longest_kernels(((k.name, 1.0) for k in named), 100)}
    assert rows["nvjet_64x64 (after _paged_attention_kernel)"] == (2, 2.0)
    assert rows["nvjet_64x64 (after _skinny_kernel)"] == (2, 2.0)
    assert rows["_rms_norm_kernel (after nvjet_64x64)"] == (3, 3.0)
    assert sum(calls for calls, _ in rows.values()) == len(kernels)
    assert named_by_predecessor([KernelInterval("x" * 80, 0, 1)], width=10)[0].name == "xxxxxxxxxx (after nothing)"


# ----- SDAR geometry folders ---------------------------------------------------------------------------------

EXPECTED = {  # hidden, layers, heads, kv heads, head_dim, MLP, tied, total parameters (billions)
    "1.7b": (2048, 28, 16, 8, 128, 6144, True, 1.72),
    "4b": (2560, 36, 32, 8, 128, 9728, False, 4.41),
    "8b": (4096, 36, 32, 8, 128, 12288, False, 8.19),
}


@pytest.mark.parametrize("size", list(EXPECTED))
def test_sdar_folders_carry_the_real_geometry_and_tokenizer(tmp_path, size):
    from diffulex.config import Config
    from diffulex.testing.checkpoints import sdar_reference_dir
    from diffulex.tokenizer import load_tokenizer

    folder = throughput.write_sdar_checkpoint(tmp_path / size, size)
    config = json.loads((folder / "config.json").read_text())
    g = ModelGeometry.from_config(config)
    hidden, layers, heads, kv, head_dim, inter, tied, billions = EXPECTED[size]
    assert (g.hidden_size, g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.intermediate_size, g.tied) == (
        hidden, layers, heads, kv, head_dim, inter, tied)
    assert g.vocab_size == 151936
    cost = g.cost_model(itemsize=2)
    params = cost.trunk_linear_params + cost.lm_head_params * (1 if tied else 2) + cost.other_params
    assert params / 1e9 == pytest.approx(billions, abs=0.01)
    if size == "4b":
        assert config == json.loads((sdar_reference_dir() / "config.json").read_text())
    assert not list(folder.glob("*.safetensors"))
    assert len(load_tokenizer(str(folder))) == 151670
    assert Config(str(folder), load_format="dummy").model_name == "sdar"


def test_the_moe_folder_is_sdar_30b_a3b(tmp_path):
    """30.5B parameters (Qwen3-30B-A3B), detected as SDAR-MoE; a batch-1 step of 4 rows reads about 29 of the 128
    experts of each layer, 15.7 GB in all."""
    from diffulex.models.family import load_hf_config, model_type_to_model_name
    from diffulex.models.sdar_moe import SDARMoeForDiffusionLM

    folder = throughput.write_sdar_checkpoint(tmp_path / "moe", "30b-a3b")
    config = json.loads((folder / "config.json").read_text())
    assert model_type_to_model_name(config["model_type"], config["architectures"]) == "sdar_moe"
    with torch.device("meta"):
        model = SDARMoeForDiffusionLM(load_hf_config(folder, "sdar_moe"))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(30.53, abs=0.01)
    cost = cost_model_from_module(model, 2)
    assert cost.expected_experts(4) == pytest.approx(29.12, abs=0.01)
    work = StepWork(query_tokens=4, logit_rows=4, context_tokens=0, written_tokens=0, attn_pairs=16)
    assert step_bytes(cost, work) / 1e9 == pytest.approx(15.65, abs=0.01)


def test_an_expert_parallel_rank_is_held_to_the_floor_of_its_own_experts(tmp_path):
    """SDAR-30B-A3B on rank 1 of two expert ranks (experts 64..127, no expert 0): its step reads half the expected
    distinct experts and multiplies each row through half of its 8 on average; the rest of the model is whole."""
    from diffulex.layers.parallel_state import ExpertParallelGroup, using_expert_parallel_group
    from diffulex.models.family import load_hf_config
    from diffulex.models.sdar_moe import SDARMoeForDiffusionLM

    folder = throughput.write_sdar_checkpoint(tmp_path / "moe", "30b-a3b")
    hf_config = load_hf_config(folder, "sdar_moe")
    with torch.device("meta"):
        whole = cost_model_from_module(SDARMoeForDiffusionLM(hf_config), 2)
        with using_expert_parallel_group(ExpertParallelGroup(rank=1, size=2)):
            rank = cost_model_from_module(SDARMoeForDiffusionLM(hf_config), 2)
    assert (rank.held_experts, rank.num_experts, rank.expert_params) == (64, 128, whole.expert_params)
    assert rank.weight_bytes == whole.weight_bytes
    assert rank.expected_experts(4) == pytest.approx(whole.expected_experts(4) / 2)
    work = StepWork(query_tokens=4, logit_rows=4, context_tokens=0, written_tokens=0, attn_pairs=16)
    routed = 2 * whole.moe_layers * whole.experts_per_token * whole.expert_params * 4
    assert step_flops(whole, work) - step_flops(rank, work) == routed // 2
    experts_bytes = whole.moe_layers * whole.expected_experts(4) * whole.expert_params * 2
    assert step_bytes(whole, work) - step_bytes(rank, work) == pytest.approx(experts_bytes / 2, abs=2)


def test_a_missing_tokenizer_source_names_the_way_to_provide_it(tmp_path):
    with pytest.raises(ValueError, match="--data-dir"):
        throughput.write_sdar_checkpoint(tmp_path / "x", "1.7b", data_dir=tmp_path / "nowhere")


# ----- end to end on a tiny checkpoint (CPU) -----------------------------------------------------------------

RESULT_FIELDS = ("ms_per_step_mean", "ms_per_step_p50", "tokens_per_s", "tpf", "steps", "bytes_per_step",
                 "flops_per_step", "memory_floor_ms", "compute_floor_ms", "floor_ratio", "memory_floor_ratio",
                 "compute_floor_ratio")


def run_throughput(model_dir, out, *extra: str) -> int:
    return main(["bench", "throughput", "--model", str(model_dir), "--batch-sizes", "1", "3", "--buffer-sizes", "1",
                 "--prompt-len", "6", "--max-tokens", "16", "--quick", "--out", str(out), *extra])


def test_a_tiny_checkpoint_runs_end_to_end_and_reports_positive_floor_ratios(sdar_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert run_throughput(sdar_dir, out, "--linear-roofline", "--roofline-batches", "2") == 0
    report = json.loads(out.read_text())
    assert report["tool"] == "diffulex bench throughput"
    assert report["device"]["torch"] == torch.__version__
    assert report["hardware"]["copy_bandwidth_GBps"] > 0
    assert report["hardware"]["matmul_TFLOPs"]["float32"] > 0
    assert report["settings"]["strategy"] == "multi_bd" and report["settings"]["block_size"] == 4
    assert [(r["batch"], r["buffer_size"]) for r in report["results"]] == [(1, 1), (3, 1)]
    for row in report["results"]:
        assert row["error"] is None
        assert row["prefill_steps"] >= 1
        assert 1 <= row["steps"] <= 8  # --quick: at most 8 timed steps
        assert row["partial_steps"] == 0  # every timed step carried the whole batch
        for name in RESULT_FIELDS:
            assert row[name] > 0, name
        assert row["query_tokens_per_step"] >= 4 * row["batch"]  # one block of 4 per request at least
    assert {r["shape"] for r in report["linear_roofline"]} >= {"qkv (fused)", "o", "down", "lm_head"}
    assert all(r["m"] == 8 and r["pct_of_roofline"] > 0 for r in report["linear_roofline"])
    printed = capsys.readouterr().out
    assert "x floor" in printed and "results:" in printed


def test_dummy_weights_run_without_a_weight_file_and_append_merges_rows(sdar_dir, tmp_path):
    import shutil

    weightless = tmp_path / "weightless"
    shutil.copytree(sdar_dir, weightless)
    (weightless / "model.safetensors").unlink()
    out = tmp_path / "throughput.json"
    assert run_throughput(weightless, out, "--load-format", "dummy") == 0
    assert main(["bench", "throughput", "--model", str(weightless), "--load-format", "dummy", "--batch-sizes", "2",
                 "--buffer-sizes", "1", "--prompt-len", "6", "--max-tokens", "16", "--quick", "--out", str(out),
                 "--append"]) == 0
    report = json.loads(out.read_text())
    assert sorted(r["batch"] for r in report["results"]) == [1, 2, 3]
    assert {r["load_format"] for r in report["results"]} == {"dummy"}
    assert len(report["commands"]) == 2


def test_a_failing_configuration_is_recorded_and_the_sweep_goes_on(sdar_dir, tmp_path, monkeypatch):
    original = throughput.measure_decode

    def out_of_memory_at_batch_3(engine, batch, *args):
        if batch == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(engine, batch, *args)

    monkeypatch.setattr(throughput, "measure_decode", out_of_memory_at_batch_3)
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", str(sdar_dir), "--batch-sizes", "3", "1", "--buffer-sizes", "1",
                 "--prompt-len", "6", "--max-tokens", "16", "--quick", "--out", str(out)]) == 0
    failed, ok = json.loads(out.read_text())["results"]
    assert failed["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert ok["error"] is None and ok["floor_ratio"] > 0


def test_the_plot_is_drawn(sdar_dir, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "throughput.png"
    assert run_throughput(sdar_dir, tmp_path / "t.json", "--plot", str(png)) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_throughput_flags_belong_to_throughput_only(sdar_dir, tmp_path, capsys):
    assert main(["bench", "--model", str(sdar_dir), "--batch-sizes", "1"]) == 2
    assert "--batch-sizes: only for 'diffulex bench throughput'" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", str(sdar_dir), "--dataset-limit", "3"]) == 2
    assert "--dataset-limit: eval keys are not used" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", str(sdar_dir), "--buffer-size", "2"]) == 2
    assert "use --buffer-sizes" in capsys.readouterr().err


def test_profiling_runs_the_asked_decode_steps_and_leaves_the_engine_empty(sdar_dir):
    from diffulex import Diffulex

    settings = throughput.ThroughputSettings(batch_sizes=[2], buffer_sizes=[1], prompt_len=6, max_tokens=16,
                                             profile_batch=2, profile_steps=3)
    entry = throughput.ModelEntry("tiny", str(sdar_dir), "safetensors")
    with Diffulex(str(sdar_dir), **settings.engine_fields(entry, 1)) as engine:
        prof = throughput.profile_decode(engine, 2, settings)
        assert engine.is_finished()
    assert prof["steps"] == 3 and prof["wall_ms_per_step"] > 0
    assert prof["gpu_busy_share"] == 0.0  # no CUDA kernels on the CPU: the sweep skips profiling there


def test_with_micro_batches_a_step_is_a_round_over_the_whole_batch(sdar_dir, tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", str(sdar_dir), "--batch-sizes", "4", "--buffer-sizes", "1",
                 "--prompt-len", "6", "--max-tokens", "24", "--max-steps", "9", "--out", str(out),
                 "--micro-batches", "2"]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["error"] is None
    assert row["steps"] == 5  # nine engine steps of two requests each: four whole rounds and a half one
    assert row["partial_steps"] == 1
    assert row["query_tokens_per_step"] > 4 * 4 * 0.8  # a round carries the blocks of all four requests


def test_rounds_join_steps_over_disjoint_requests_only():
    from diffulex.bench.throughput import _rounds

    def raw(*steps):
        return [([(rid, f"r{rid}") for rid in ids], [k]) for k, ids in enumerate(steps)]

    alone, times = _rounds(raw((0,), (0,), (0,)), [1.0, 2.0, 3.0], micro_batches=2)
    assert len(alone) == 3 and times == [1.0, 2.0, 3.0]  # one request: every step is a whole round
    halves, times = _rounds(raw((0, 1), (2, 3), (0, 1), (2,)), [1.0, 2.0, 3.0, 4.0], micro_batches=2)
    assert [sorted(rid for rid, _ in records) for records, _ in halves] == [[0, 1, 2, 3], [0, 1, 2]]
    assert [before for _, before in halves] == [[0], [2]] and times == [3.0, 7.0]


def test_the_llada2_mini_folder_has_the_real_geometry(tmp_path):
    """16.26B parameters (LLaDA2.0-mini); a step of one 32-token block reads about 20.8 GB (163 of 256 experts
    per layer, the figure peers quote)."""
    from diffulex.models.family import load_hf_config
    from diffulex.models.llada2 import LLaDA2ForDiffusionLM

    folder = throughput.write_llada2_checkpoint(tmp_path / "mini", "llada2-mini")
    assert not list(folder.glob("*.safetensors"))
    with torch.device("meta"):
        model = LLaDA2ForDiffusionLM(load_hf_config(folder, "llada2"))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(16.26, abs=0.01)
    cost = cost_model_from_module(model, 2)
    work = StepWork(query_tokens=32, logit_rows=32, context_tokens=0, written_tokens=0, attn_pairs=0)
    assert step_bytes(cost, work) / 1e9 == pytest.approx(20.8, abs=0.1)


def test_block_size_given_to_the_engine_is_the_sweeps_block_size():
    settings = throughput.ThroughputSettings(engine_overrides={"block_size": 32})
    assert settings.block_size == 32
    assert settings.engine_fields(throughput.ModelEntry("m", "/x", "dummy"), 1)["block_size"] == 32


def test_an_sdar_folder_without_its_config_and_tokenizer_names_the_flag_to_pass(tmp_path):
    """Without the real SDAR files the harness refuses with the flag to pass, and never looks outside the
    source checkout for them."""
    from diffulex.testing.checkpoints import sdar_reference_dir

    with pytest.raises(ValueError, match=r"data_dir='.*empty' holds no SDAR-4B-Chat .*pass --data-dir DIR"):
        throughput.write_sdar_checkpoint(tmp_path / "out", "1.7b", data_dir=tmp_path / "empty")
    checkout = Path(throughput.__file__).resolve().parents[2]
    assert sdar_reference_dir().is_relative_to(checkout)


def test_bad_output_paths_and_reports_are_refused_before_anything_is_measured(sdar_dir, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not json\n")
    cases = [
        (["--out", str(tmp_path)], f"--out='{tmp_path}' is invalid: is a directory: must be a file path"),
        (["--out", str(a_file / "t.json")], f"cannot be created: '{a_file}' is a file, not a directory"),
        (["--out", str(tmp_path / "t.json"), "--plot", str(a_file / "t.png")],
         f"--plot='{a_file / 't.png'}' is invalid: cannot be created: '{a_file}' is a file"),
        (["--out", str(a_file), "--append"],
         f"--append --out '{a_file}': the existing file is not a readable JSON report: Expecting value"),
    ]  # fmt: skip
    for extra, message in cases:
        assert main(["bench", "throughput", "--model", str(sdar_dir), "--batch-sizes", "1", "--buffer-sizes", "1",
                     "--quick", *extra]) == 2  # fmt: skip
        captured = capsys.readouterr()
        assert message in captured.err and "measuring" not in captured.out, (extra, captured.err)
    other_device = tmp_path / "other.json"
    other_device.write_text(json.dumps({"device": {"name": "a GPU of elsewhere"}, "results": []}))
    assert main(["bench", "throughput", "--model", str(sdar_dir), "--out", str(other_device), "--append"]) == 2
    captured = capsys.readouterr()
    assert "measured on 'a GPU of elsewhere'" in captured.err and "measuring" not in captured.out
    assert not (tmp_path / "t.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without CUDA")
def test_the_gpu_geometries_are_refused_without_cuda_as_the_sweep_refuses_them(capsys):
    assert main(["bench", "throughput", "--models", "1.7b", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--models 1.7b: these random-weight geometries" in err and "need a CUDA device" in err
    assert "--model DIR" in err
    assert main(["bench", "throughput", "--batch-sizes", "1"]) == 2  # the default geometries, no --model
    assert "measures --models 1.7b 4b 8b unless --model DIR is given" in capsys.readouterr().err
