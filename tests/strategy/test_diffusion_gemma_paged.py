"""The runner's row path (encoder pieces and canvases over the paged cache) against the model's dense path, which
tests/models/test_diffusion_gemma.py holds to transformers; and the expert paths against the exact one.

On the CPU attention runs on the PyTorch paged path; on a GPU with Triton the same tests run the kernel (float32).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from diffulex.layers.dispatch import triton_available
from diffulex.layers.moe import grouped_mm_supported
from diffulex.models.diffusion_gemma import EncoderKV, StackedExperts, load_diffusion_gemma
from diffulex.strategy.diffusion_gemma.canvas import CanvasSchedule
from diffulex.strategy.diffusion_gemma.runner import CanvasRunner, CanvasRunnerSettings
from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 4  # positions per page: contexts straddle pages
# K/V (unit-scale after their norms). On a GPU the Triton kernel's softmax (exp2, its own summation order) feeds the
# later layers' K/V: measured 2.3e-5 there, so the bound is five times wider (a wrong row moves them by ~1)
ATOL = 2e-5 if DEVICE.type == "cpu" else 1e-4
# hidden states reach |5| here; two correct float32 summation orders (masked einsum attention against SDPA over
# padded contexts) differ by a few ulps of that after 4 layers: the dense path batched and alone differ by 2.4e-5
# on the CPU, by 1.0e-4 against the Triton kernel on an H200
HIDDEN_ATOL = 1e-4 if DEVICE.type == "cpu" else 5e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    folder = write_tiny_diffusion_gemma_checkpoint(tmp_path_factory.mktemp("dgemma") / "tiny", seed=3)
    return load_diffusion_gemma(folder, device=DEVICE)


def make_runner(model, num_pages: int = 64) -> CanvasRunner:
    schedule = CanvasSchedule(max_steps=4, stability_threshold=1, confidence_threshold=0.1, t_min=0.0, t_max=1.0,
                              entropy_bound=1.0)  # fmt: skip
    settings = CanvasRunnerSettings(DEVICE, torch.float32, PAGE, 300, 0, schedule)
    runner = CanvasRunner(settings, model)
    runner.allocate_kv_cache(num_pages)
    return runner


def tokens(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(7, 300, (n,), generator=g).to(DEVICE)


def stored_context(runner: CanvasRunner, table: list[int], length: int) -> EncoderKV:
    """The K/V of positions ``[0, length)`` read back from the pages, every position of every layer."""
    slots = torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in range(length)], device=DEVICE)
    keys = tuple(k.view(-1, *k.shape[2:])[slots][None] for k in runner.k_cache)
    values = tuple(v.view(-1, *v.shape[2:])[slots][None] for v in runner.v_cache)
    return EncoderKV(keys, values, length)


def test_encoder_rounds_store_the_dense_encoders_kv(model) -> None:
    """Three requests encoded together in pieces (a prompt, then a canvas; one prompt longer than the sliding
    window, one piece starting mid-page): the pages hold, position for position and layer by layer, the K/V the
    dense encoder computes over the same pieces."""
    g = torch.Generator().manual_seed(0)
    runner = make_runner(model)
    prompts = [tokens(g, n) for n in (5, 13, 21)]
    canvases = [tokens(g, model.config.canvas_length) for _ in prompts]
    tables = [list(range(0, 12)), list(range(24, 36)), list(range(40, 52))]
    runner._encode_round([(t, 0, len(p)) for t, p in zip(tables, prompts, strict=True)], torch.cat(prompts))
    spans = [(len(p), len(p) + len(c)) for p, c in zip(prompts, canvases, strict=True)]
    runner._encode_round([(t, lo, hi) for t, (lo, hi) in zip(tables, spans, strict=True)], torch.cat(canvases))
    for table, prompt, canvas in zip(tables, prompts, canvases, strict=True):
        dense = model.encode(prompt[None], keep_all_positions=True)
        dense = model.encode(canvas[None], dense, keep_all_positions=True)
        paged = stored_context(runner, table, dense.length)
        for layer, (k_dense, k_paged) in enumerate(zip(dense.keys, paged.keys, strict=True)):
            torch.testing.assert_close(k_paged, k_dense, atol=ATOL, rtol=0, msg=f"keys of layer {layer}")
        for v_dense, v_paged in zip(dense.values, paged.values, strict=True):
            torch.testing.assert_close(v_paged, v_dense, atol=ATOL, rtol=0)


@pytest.mark.parametrize("self_conditioned", [False, True])
def test_decoder_rows_equal_the_dense_batched_decoder(model, self_conditioned: bool) -> None:
    """Canvases after contexts of 5, 13 and 21 positions (below and beyond the window of 8) from the pages give
    the hidden states `denoise_hidden` gives over the dense contexts, with and without self-conditioning inputs;
    and through a graph bucket's static buffers (padded to 4 canvases, not captured) the same again."""
    g = torch.Generator().manual_seed(1)
    runner = make_runner(model)
    prompts = [tokens(g, n) for n in (5, 13, 21)]
    tables = [list(range(0, 10)), list(range(20, 30)), list(range(30, 40))]
    runner._encode_round([(t, 0, len(p)) for t, p in zip(tables, prompts, strict=True)], torch.cat(prompts))
    C, hidden = model.config.canvas_length, model.config.hidden_size
    canvases = torch.stack([tokens(g, C) for _ in prompts])
    soft = torch.randn(3, C, hidden, generator=g).to(DEVICE) if self_conditioned else None
    contexts = [model.encode(p[None]) for p in prompts]
    expected = model.denoise_hidden(canvases, contexts, soft)
    lengths = [len(p) for p in prompts]
    got = runner.decode(canvases, soft, lengths, tables)
    torch.testing.assert_close(got, expected, atol=HIDDEN_ATOL, rtol=0)

    static = make_runner(model)
    static.k_cache, static.v_cache = runner.k_cache, runner.v_cache
    static.settings = replace(static.settings, graph_buckets=(1, 4))
    static.capture_graphs = False
    torch.testing.assert_close(static.decode(canvases, soft, lengths, tables), got, atol=HIDDEN_ATOL, rtol=0)
    assert list(static.graphs) == [4]


def experts_and_inputs(seed: int) -> tuple[StackedExperts, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    experts = StackedExperts(num_experts=6, hidden_size=16, intermediate_size=8, top_k=3)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(6, 16, 16, generator=g) * 0.3)
        experts.down_proj.copy_(torch.randn(6, 16, 8, generator=g) * 0.3)
    x = torch.randn(11, 16, generator=g)
    experts_chosen = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(11)])
    weights = torch.rand(11, 3, generator=g)
    return experts, x, weights, experts_chosen


def test_static_expert_paths_equal_the_exact_loop() -> None:
    """Every expert over every token weighted by the routing (``dense``, capturable), and the grouped GEMM where
    torch has one for this device, sum the same expert outputs as the exact per-expert loop."""
    experts, x, weights, chosen = experts_and_inputs(0)
    experts.impl = "loop"
    exact = experts(x, weights, chosen)
    experts.impl = "dense"
    torch.testing.assert_close(experts(x, weights, chosen), exact, atol=1e-6, rtol=0)
    if grouped_mm_supported(x):
        experts.impl = "grouped"
        torch.testing.assert_close(experts(x, weights, chosen), exact, atol=1e-5, rtol=1e-4)
    experts.impl = "fast"
    with pytest.raises(ValueError, match="moe impl must be one of fused, grouped, dense, loop, got 'fast'"):
        experts(x, weights, chosen)


def test_experts_take_the_exact_loop_on_the_cpu_and_a_capturable_path_on_cuda() -> None:
    experts, x, _, _ = experts_and_inputs(1)
    assert experts.impl_for(x) == "loop"
    if torch.cuda.is_available():
        assert experts.impl_for(x.cuda()) == "dense"  # float32: no grouped GEMM
        # 11 rows of 3 experts among 6: decode-sized, the fused kernels' (tests/models/test_diffusion_gemma.py)
        fused = "fused" if triton_available() else ("grouped" if grouped_mm_supported(x.cuda().bfloat16()) else "dense")
        assert experts.impl_for(x.cuda().bfloat16()) == fused


def test_a_step_past_the_pages_is_refused(tmp_path: Path, model) -> None:
    runner = make_runner(model, num_pages=4)
    with pytest.raises(RuntimeError, match="positions up to 21 have no page"):
        request = type("R", (), {})()
        request.req_id, request.prompt_len, request.canvas_length, request.canvases_done = 5, 21, 16, 0
        request.encoded_len, request.page_table, request.token_ids, request.blocks = 0, [0, 1], [7] * 21, []
        runner._encode_missing([request])


def test_the_memory_profile_runs_a_whole_step_in_a_scratch_pool(model) -> None:
    """`profile_run` (what the memory planner measures) encodes a prompt, decodes canvases after it, takes the
    logits of a group and the rule's temporaries, and leaves no pages behind."""
    runner = make_runner(model)
    runner.release_kv_cache()
    runner.profile_run(num_tokens=4096, max_model_len=40, num_sample_rows=3 * model.config.canvas_length)
    assert runner.num_pages == 0 and runner.k_cache == []


def test_logits_are_taken_for_as_many_canvases_as_the_budget_holds(model, monkeypatch) -> None:
    from diffulex.strategy.diffusion_gemma import runner as runner_module

    runner = make_runner(model)
    per_canvas = model.config.canvas_length * model.config.vocab_size * 4
    monkeypatch.setattr(runner_module, "LOGITS_GROUP_BYTES", 3 * per_canvas + 1)
    assert [runner._logits_group_size(n) for n in (1, 2, 3, 8)] == [1, 2, 3, 3]
    monkeypatch.setattr(runner_module, "LOGITS_GROUP_BYTES", 1)
    assert runner._logits_group_size(8) == 1


def test_warm_up_compiles_every_attention_variant_a_step_launches(model, monkeypatch) -> None:
    """With launches recorded instead of run (as on a GPU with PDL): the variants an encoder round (prompts of
    several lengths) and decoder passes (eager, and from a padded bucket) launch were all launched by the
    runner's warm-up, so none compiles while serving."""
    from diffulex.kernels import paged_attention as pa
    from diffulex.kernels.pdl import PDL_MAX_ROWS
    from tests.kernels.test_paged_attention import LaunchRecorder

    recorder = LaunchRecorder()
    monkeypatch.setattr(pa, "_paged_attention_kernel", recorder)
    monkeypatch.setattr(pa, "pdl_enabled", lambda device, rows: rows <= PDL_MAX_ROWS)
    monkeypatch.setattr(pa, "warm_up", pa._launch_every_variant)  # warm_up itself launches only on CUDA
    monkeypatch.setattr(pa, "_fills_gpu", lambda device, programs: programs >= 132)  # an H100's SMs
    runner = make_runner(model)
    runner.use_triton = True
    runner.settings = replace(runner.settings, graph_buckets=(2, 4))
    runner.capture_graphs = False
    runner.warm_up_attention()
    warmed = set(recorder.variants)
    assert len(warmed) >= 4
    g = torch.Generator().manual_seed(2)
    for lengths in ((1,), (3, 40), (2, 9, 17)):
        recorder.variants.clear()
        prompts = [tokens(g, n) for n in lengths]
        tables = [list(range(12 * i, 12 * i + 12)) for i in range(len(lengths))]
        runner._encode_round([(t, 0, n) for t, n in zip(tables, lengths, strict=True)], torch.cat(prompts))
        canvases = torch.stack([tokens(g, model.config.canvas_length) for _ in lengths])
        runner.decode(canvases, None, list(lengths), tables)  # buckets 2 and 4
        runner.decode(canvases[:1], None, list(lengths[:1]), tables[:1])  # eager: no bucket of 1
        assert set(recorder.variants) <= warmed, lengths
