"""The prefill anatomy (`diffulex.bench.prefill_anatomy`): which class each kernel lands in, each class's floor
by hand on a small geometry, and one quick run end to end on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffulex.bench import prefill_anatomy as anatomy
from diffulex.bench.roofline import ModelGeometry, StepWork

GEOMETRY = ModelGeometry(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, vocab_size=1000, tied=False)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("_paged_attention_kernel", "attention"),
        ("_store_kv_kernel", "attention"),
        ("nvjet_tst_192x192_64x3_2x1_v_bz_coopA_TNT", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>", "gemm"),
        ("_skinny_kernel", "gemm"),
        ("_qk_norm_rope_kernel", "elementwise"),
        ("_rms_norm_kernel", "elementwise"),
        ("_gated_mul_kernel", "elementwise"),
        ("_token_inputs_kernel", "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<BFloat16>>", "elementwise"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "elementwise"),
        ("_top1_kernel", "sampling"),
        ("_accept_kernel", "sampling"),
        ("_advance_kernel", "sampling"),
        ("_publish_kernel", "sampling"),
        ("Memcpy HtoD (Pinned -> Device)", "other"),
        ("Memset (Device)", "other"),
        ("aten::mm", "gemm"),
        ("aten::addmm", "gemm"),
        ("aten::as_strided", "other"),
    ],
)
def test_each_kernel_lands_in_its_class(name, expected):
    assert anatomy.kernel_class(name) == expected


def test_class_floors_by_hand():
    """Attention: pairs x 4 x layers x heads x head_dim flops; GEMMs: the rows' linear flops or the weights'
    bytes, the longer; elementwise: the activations read and written once; sampling: the sampled rows' logits."""
    cost = GEOMETRY.cost_model(itemsize=2)
    work = StepWork(query_tokens=100, logit_rows=4, context_tokens=0, written_tokens=100, attn_pairs=5200)
    floors = anatomy.class_floors(GEOMETRY, cost, work, vocab=1000, bandwidth_bps=1e9, flops_per_s=1e12)
    assert floors["attention"] == pytest.approx(5200 * 4 * 2 * 4 * 16 / 1e12)
    trunk = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)
    linear_flops = 2 * trunk * 100 + 2 * 1000 * 64 * 4
    assert floors["gemm"] == pytest.approx(max(linear_flops / 1e12, cost.weight_bytes / 1e9))
    per_layer = 8 * 64 + (2 * 64 + 5 * 32) + 3 * 128
    assert anatomy.activation_elements_per_token(GEOMETRY) == 2 * per_layer + 6 * 64
    assert floors["elementwise"] == pytest.approx((2 * per_layer + 6 * 64) * 100 * 2 / 1e9)
    assert floors["sampling"] == pytest.approx(4 * 4 * 1000 / 1e9)
    assert floors["other"] == 0.0


def test_a_quick_run_profiles_one_cold_step_per_prompt(tmp_path: Path):
    report = anatomy.run_anatomy(tmp_path, quick=True, log=lambda _: None)
    assert json.loads((tmp_path / "prefill_anatomy.json").read_text()) == report
    rows = report["rows"]
    assert [(r["model"], r["prompt_len"]) for r in rows] == [("tiny-sdar", 32), ("tiny-sdar", 64)]
    for r in rows:
        # the prompt and its first block in one forward, its first token accepted by that step
        assert r["steps"] == 1 and r["query_tokens"] == r["prompt_len"] + 4
        assert set(r["classes"]) == set(anatomy.CLASSES)
        assert sum(c["ms"] for c in r["classes"].values()) == pytest.approx(r["kernel_ms"])
        assert r["classes"]["gemm"]["ms"] > 0 and r["classes"]["gemm"]["kernels"] > 0
        for name in ("attention", "gemm", "elementwise", "sampling"):
            assert r["classes"][name]["floor_ms"] > 0
        assert r["class_floor_ms"] == pytest.approx(sum(c["floor_ms"] for c in r["classes"].values()))
        assert r["ttft_ms"] > 0 and r["top_kernels"]
    assert rows[1]["classes"]["attention"]["floor_ms"] > 3 * rows[0]["classes"]["attention"]["floor_ms"]


def test_engine_fields_reach_the_engine_and_the_report(tmp_path: Path):
    """``max_prefill_graph_tokens`` (which prompts replay prefill graphs) is the engine's field, validated there."""
    report = anatomy.run_anatomy(tmp_path, quick=True, prompt_lens=[32], log=lambda _: None,
                                 engine_fields={"max_prefill_graph_tokens": 64})  # fmt: skip
    assert report["engine_fields"] == {"max_prefill_graph_tokens": 64} and len(report["rows"]) == 1
    with pytest.raises(ValueError, match="max_prefill_graph_tokens"):
        anatomy.run_anatomy(tmp_path, quick=True, prompt_lens=[32], log=lambda _: None,
                            engine_fields={"max_prefill_graph_tokens": 2})  # fmt: skip



def test_the_profile_holds_the_steps_before_the_first_token_and_not_the_next(tmp_path: Path):
    """The engine launches the next step before `step` returns the token; the profile stops before that launch, so
    a prompt whose first step gives the token shows one forward: one embedding lookup (``index_select``)."""
    from diffulex.bench.sweep_models import write_model
    from diffulex.bench.sweep_prefill import _prompt

    engine = anatomy._engine(write_model("tiny-sdar", tmp_path / "tiny"), "safetensors", 256)
    try:
        measured, kernels = anatomy.profile_first_token(engine, _prompt(engine, 32, 1), max_steps=64)
        assert measured["steps"] == 1
        assert sum(k.name == "aten::index_select" for k in kernels) == 1
        assert "_launch" not in vars(engine)  # the engine's own method again
        engine.generate([_prompt(engine, 32, 2)])  # and it still serves
    finally:
        engine.exit()


def test_the_timeline_splits_the_first_token_around_its_kernels():
    """Host time before the first kernel (with the runtime calls made then), the kernels' span and its idle time,
    and what follows the last kernel, from one profile's events (microseconds on one clock)."""
    from types import SimpleNamespace

    import torch

    def event(name: str, start: float, end: float, cuda: bool = False) -> SimpleNamespace:
        kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        return SimpleNamespace(name=name, device_type=kind, time_range=SimpleNamespace(start=start, end=end))

    events = [
        event("cudaDeviceSynchronize", 0, 100),
        event("cudaMemcpyAsync", 300, 400),
        event("cudaMemcpyAsync", 500, 700),
        event("cudaGraphLaunch", 1000, 1150),
        event("cudaStreamSynchronize", 1150, 5000),  # counted up to the first kernel's start
        event("cudaEventQuery", 1600, 1610),  # after it: not counted
    ]
    kernels = [anatomy.KernelTime("a", 1500, 1e-3), anatomy.KernelTime("b", 3000, 1e-3)]  # 1 ms each, 0.5 ms apart
    timeline = anatomy.first_token_timeline(SimpleNamespace(events=lambda: events), kernels, ttft_s=5e-3)
    assert timeline["before_first_kernel_ms"] == pytest.approx(1.5)
    assert timeline["kernel_span_ms"] == pytest.approx(2.5)
    assert timeline["idle_in_span_ms"] == pytest.approx(0.5)
    assert timeline["after_last_kernel_ms"] == pytest.approx(1.0)
    calls = timeline["runtime_calls_before_first_kernel"]
    assert list(calls) == ["cudaStreamSynchronize", "cudaMemcpyAsync", "cudaGraphLaunch", "cudaDeviceSynchronize"]
    assert calls["cudaMemcpyAsync"] == {"calls": 2, "ms": pytest.approx(0.3)}
    assert calls["cudaStreamSynchronize"] == {"calls": 1, "ms": pytest.approx(0.35)}
