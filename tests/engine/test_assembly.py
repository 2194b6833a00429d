"""The build's dry pass (`diffulex.kernels.parallel_compile`): which warm-ups an engine runs dry before running
them for real, and that the CUDA graphs' part of it runs every bucket's warm-up forward and leaves the runner as it
found it.

On the CPU nothing launches a Triton kernel, so the captured forward is wrapped in a stand-in launch that asks
Triton's ``jit_cache_hook`` as a kernel's first launch does (the dry pass's hook records it and says skip). On a
GPU the same tests build CUDA engines, and the build's warm-ups then run dry on real kernels: that none of them
reads device data back is checked there (`tools/start_gpu_check.sh` runs this file)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest
import torch

from diffulex import SamplingParams
from diffulex.engine import assembly
from diffulex.engine.cuda_graph import request_buckets
from diffulex.engine.prefill_graphs import CHUNK_EXTRA_ROWS_PER_REQUEST, prefill_buckets
from diffulex.testing.checkpoints import write_tiny_checkpoint
from tests.engine.test_engine_matches_reference import make_engine

triton = pytest.importorskip("triton")
pc = pytest.importorskip("diffulex.kernels.parallel_compile")
if not hasattr(getattr(getattr(triton, "knobs", None), "runtime", None), "jit_cache_hook"):
    pytest.skip(f"triton {triton.__version__} has no jit_cache_hook: no dry pass", allow_module_level=True)

BUILD_ORDER = ["profile forward", "attention", "CUDA graph warm-ups", "sampling"]


@pytest.fixture(autouse=True)
def default_attention_warm_up(monkeypatch):
    """Each build here warms attention up as by default, whatever the run's environment (the GPU suite sets
    ``DIFFULEX_ATTENTION_WARM_UP=0``); a test that wants otherwise sets it."""
    monkeypatch.delenv(assembly.ATTENTION_WARM_UP_ENV, raising=False)


@dataclasses.dataclass(frozen=True)
class ForwardKernel:
    """What the hook reads of a JIT function: its module and name."""

    module: str = "a_forward_kernel"
    name: str = "forward"


def with_forward_launches(forward, launched: list[int]):
    """Wrap `forward` in a stand-in launch per call, specialized on its row count: skipped where the hook says so,
    else counted in `launched` as run."""

    def launching_forward(ids, positions, meta, readers=None, **kwargs):
        hook = triton.knobs.runtime.jit_cache_hook
        rows = ids.shape[0]
        if hook is None or not hook(fn=ForwardKernel(), compile={"specialization_data": json.dumps({"rows": rows})}):
            launched.append(rows)
        return forward(ids, positions, meta, readers, **kwargs)

    return launching_forward


def test_a_dense_engine_runs_every_warm_up_dry_in_build_order(peaky_sdar_dir: Path):
    with make_engine(peaky_sdar_dir) as llm:
        runner, policy, config = llm.runner, llm.policy, llm.config
        assert list(assembly._dry_warm_ups(config, runner, policy, torch.float32)) == BUILD_ORDER
        given = dataclasses.replace(config, num_pages=64)  # no memory plan: no profile forward
        assert list(assembly._dry_warm_ups(given, runner, policy, torch.float32)) == BUILD_ORDER[1:]
        runner.graph_forward = lambda *args, **kwargs: runner.model(*args, **kwargs)  # as torch.compile leaves it
        assert "CUDA graph warm-ups" not in assembly._dry_warm_ups(config, runner, policy, torch.float32)


@pytest.mark.parametrize("attention_warm_up", ["1", "0"])
def test_an_moe_engine_runs_only_its_attention_warm_up_dry(tmp_path: Path, monkeypatch, attention_warm_up):
    """Even where the attention warm-up may be left out (``DIFFULEX_ATTENTION_WARM_UP=0``): it is how the graphs'
    attention variants reach the helpers when the forwards cannot run dry."""
    monkeypatch.setenv(assembly.ATTENTION_WARM_UP_ENV, attention_warm_up)
    model_dir = write_tiny_checkpoint(tmp_path / "moe", "sdar_moe", num_hidden_layers=1)
    with make_engine(model_dir, max_num_reqs=2) as llm:
        warm_ups = assembly._dry_warm_ups(llm.config, llm.runner, llm.policy, torch.float32)
    assert list(warm_ups) == ["attention"]  # its routing would index memory by a skipped kernel's output


def test_an_engine_with_heads_triton_cannot_tile_runs_only_its_attention_warm_up_dry(tmp_path: Path):
    model_dir = write_tiny_checkpoint(tmp_path / "odd-heads", hidden_size=96, num_attention_heads=4, head_dim=24)
    with make_engine(model_dir, max_num_reqs=2) as llm:
        warm_ups = assembly._dry_warm_ups(llm.config, llm.runner, llm.policy, torch.float32)
    assert list(warm_ups) == ["attention"]  # the PyTorch attention those heads take reads the step's layout back


def test_the_graph_rehearsal_records_every_bucket_forward_and_keeps_no_graph(peaky_sdar_dir: Path):
    with make_engine(peaky_sdar_dir, max_num_reqs=5, max_prefill_graph_tokens=40) as llm:
        runner, config = llm.runner, llm.config
        policy = dataclasses.replace(llm.policy, cuda_graphs=True, prefill_graph_rows=40)
        kept = (runner.graphs, runner.short_graphs, runner.prefill_graphs, runner.chunk_graphs, runner.straggler_graphs)
        launched: list[int] = []
        runner.graph_forward = with_forward_launches(runner.graph_forward, launched)
        with pc.dry_pass() as variants:
            policy.rehearse_capture(runner, config)
        assert (runner.graphs, runner.short_graphs, runner.prefill_graphs, runner.chunk_graphs,
                runner.straggler_graphs) == kept  # fmt: skip
        rows = policy.max_rows_per_request
        decode = [bucket * rows for bucket in reversed(request_buckets(config.max_num_reqs))]
        prefill = sorted(prefill_buckets(40, rows) + prefill_buckets(40), reverse=True)  # one-request and group sets
        chunk_rows = rows + CHUNK_EXTRA_ROWS_PER_REQUEST
        chunk = [bucket * chunk_rows for bucket in reversed(request_buckets(config.max_num_reqs))]
        expected = list(dict.fromkeys(decode + prefill + chunk))  # a row count two sets run is one variant
        # (on a GPU the engine's own kernels are compiled already: they launch, and only the stand-in is recorded)
        stand_in = [v for v in variants if v.module == ForwardKernel.module]
        assert [json.loads(v.specialization)["rows"] for v in stand_in] == expected
        assert launched == []  # every launch skipped
        policy.rehearse_capture(runner, config)  # not dry: each bucket's forward launches once
        assert sorted(launched) == sorted(decode + prefill + chunk)


class StandInHelpers:
    """What the build hands its helper processes: the warm-ups, run dry here as `CompileHelpers.compile_for` runs
    them (nothing compiles on the CPU), or a failure of the helpers themselves."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.names: list[str] = []
        self.errors: list[str] = []  # what the dry warm-ups raised (a read of device data among them)
        self.target = None
        self.closed = False

    def compile_for(self, warm_ups, target):
        if self.fails:
            raise OSError("a helper's pipe broke")
        self.names, self.target = list(warm_ups), target
        with pc.dry_pass():
            for name, warm_up in warm_ups.items():
                try:
                    warm_up()
                except Exception as err:  # noqa: BLE001  (as the helpers do: reported, the build goes on)
                    self.errors.append(f"{name}: {type(err).__name__}: {err}")
        return pc.CompileReport(recorded_by=dict.fromkeys(warm_ups, 0), errors=tuple(self.errors))

    def close(self) -> None:
        self.closed = True


def build_with(
    monkeypatch, model_dir: Path, helpers: StandInHelpers, manifest: StandInManifest | None = None,
    attention_warm_up: str | None = None,
):
    """An engine built as on a GPU with helper processes (`helpers`) and the kernel manifest `manifest` (none: the
    build runs its dry pass), recording every KV cache it allocates; `attention_warm_up`: the
    ``DIFFULEX_ATTENTION_WARM_UP`` setting (None: the default)."""
    pages: list[int] = []
    allocate = assembly.ModelRunner.allocate_kv_cache
    if attention_warm_up is not None:
        monkeypatch.setenv(assembly.ATTENTION_WARM_UP_ENV, attention_warm_up)

    def recording_allocate(self, num_pages):
        pages.append(num_pages)
        allocate(self, num_pages)

    monkeypatch.setattr(assembly, "_start_compile_helpers", lambda config, device: helpers)
    monkeypatch.setattr(assembly, "_compile_target", lambda device: "hopper")
    monkeypatch.setattr(assembly, "_open_manifest", lambda config, device, dtype: manifest)
    monkeypatch.setattr(assembly.ModelRunner, "allocate_kv_cache", recording_allocate)
    return make_engine(model_dir), pages


def test_the_helpers_phase_compiles_the_dry_warm_ups_before_the_memory_plan(monkeypatch, peaky_sdar_dir: Path,
                                                                            caplog):
    helpers = StandInHelpers()
    with caplog.at_level(logging.INFO, logger="diffulex"):
        llm, pages = build_with(monkeypatch, peaky_sdar_dir, helpers)
    # the build says how many variants it still compiled itself once the helpers were done (0 when all foreseen)
    itself = r"kernels: -?\d+ compiled by the build itself after the helper processes( \(.+\))?"
    assert any(re.fullmatch(itself, r.message) for r in caplog.records)
    with llm:
        phases = list(llm.build_seconds)
        assert helpers.names == BUILD_ORDER and helpers.target == "hopper" and helpers.closed
        assert helpers.errors == []  # on a GPU: every warm-up ran dry to its end, reading no device data back
        assert phases.index("runner") + 1 == phases.index(assembly.HELPER_PHASE)
        assert phases.index(assembly.HELPER_PHASE) + 1 == phases.index("memory plan and KV cache")
        # the dry pass's one page, dropped (on a GPU the memory plan's profile takes one too), then the planned cache
        assert pages[0] == 1 and pages[-1] == llm.runner.num_pages
        assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids


def test_without_the_attention_warm_up_the_build_leaves_those_variants_to_their_first_launch(
    monkeypatch, peaky_sdar_dir: Path, caplog
):
    """`DIFFULEX_ATTENTION_WARM_UP=0` (the GPU test suite's setting): neither the dry pass nor the build runs the
    attention warm-up; the other warm-ups still run, and the engine still answers."""
    helpers = StandInHelpers()
    warmed = []
    monkeypatch.setattr(assembly.ModelRunner, "warm_up_attention", lambda self: warmed.append(self))
    with caplog.at_level(logging.INFO, logger="diffulex"):
        llm, _ = build_with(monkeypatch, peaky_sdar_dir, helpers, attention_warm_up="0")
    with llm:
        assert helpers.names == [name for name in BUILD_ORDER if name != "attention"] and warmed == []
        assert any("compile at their first launch (DIFFULEX_ATTENTION_WARM_UP=0)" in r.message for r in caplog.records)
        assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids


@pytest.mark.parametrize(("setting", "wanted"), [(None, True), ("1", True), ("0", False), (" ", True)])
def test_the_attention_warm_up_is_on_unless_the_environment_says_0(setting, wanted):
    environ = {} if setting is None else {assembly.ATTENTION_WARM_UP_ENV: setting}
    assert assembly.attention_warm_up_wanted(environ) is wanted


def test_a_bad_attention_warm_up_setting_is_refused_naming_it_and_what_it_takes(monkeypatch, peaky_sdar_dir: Path):
    with pytest.raises(ValueError, match=r"DIFFULEX_ATTENTION_WARM_UP='yes' is invalid: must be 1 .* or 0"):
        assembly.attention_warm_up_wanted({assembly.ATTENTION_WARM_UP_ENV: "yes"})
    monkeypatch.setenv(assembly.ATTENTION_WARM_UP_ENV, "yes")
    with pytest.raises(ValueError, match="DIFFULEX_ATTENTION_WARM_UP='yes' is invalid"):  # a build, on any device
        make_engine(peaky_sdar_dir)


def test_helpers_that_fail_cost_the_build_nothing_but_time(monkeypatch, peaky_sdar_dir: Path, caplog):
    helpers = StandInHelpers(fails=True)
    with caplog.at_level(logging.WARNING, logger="diffulex"):
        llm, pages = build_with(monkeypatch, peaky_sdar_dir, helpers)
    with llm:
        assert any("compiling in helper processes failed (OSError" in r.message for r in caplog.records)
        assert helpers.closed and assembly.HELPER_PHASE in llm.build_seconds
        assert pages[0] == 1 and pages[-1] == llm.runner.num_pages
        assert all(layer.k_cache.shape[0] == llm.runner.num_pages for layer in llm.runner.attention_layers)
        assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids


class StandInManifest:
    """A build's manifest of kernel variants (`diffulex.kernels.build_manifest.BuildManifest`): ready or not, and
    what the build records in it."""

    def __init__(self, ready: bool, variants: list | None = None) -> None:
        self.ready, self.variants = ready, variants
        self.recorded: list | None = None

    def record(self, launched) -> None:
        self.recorded = list(launched)


def test_a_build_whose_manifest_is_all_cached_skips_the_dry_pass(monkeypatch, peaky_sdar_dir: Path, caplog):
    helpers = StandInHelpers()
    manifest = StandInManifest(ready=True, variants=[pc.KernelVariant("m", "k", "{}")] * 3)
    with caplog.at_level(logging.INFO, logger="diffulex"):
        llm, _ = build_with(monkeypatch, peaky_sdar_dir, helpers, manifest)
    with llm:
        assert helpers.names == [] and helpers.closed, "no warm-up ran dry; the helpers were let go"
        assert any("the 3 variants this engine's last build launched are all in the Triton cache: no dry pass"
                   in r.message for r in caplog.records)  # fmt: skip
        assert assembly.HELPER_PHASE in llm.build_seconds
        assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids


def test_a_build_records_in_its_manifest_what_its_real_warm_ups_launched(monkeypatch, peaky_sdar_dir: Path):
    import contextlib

    helpers, manifest = StandInHelpers(), StandInManifest(ready=False)
    launched = [pc.KernelVariant("m", "k", '{"rows": 4}')]

    @contextlib.contextmanager
    def locks(device):
        yield launched

    monkeypatch.setattr(assembly, "_compile_locks", locks)
    llm, _ = build_with(monkeypatch, peaky_sdar_dir, helpers, manifest)
    with llm:
        assert helpers.names == BUILD_ORDER, "a manifest that is not all cached leaves the dry pass to run"
        assert manifest.recorded == launched


def test_the_profile_forward_is_recorded_dry_at_the_memory_plans_shape(peaky_sdar_dir: Path):
    with make_engine(peaky_sdar_dir) as llm:
        runner, config, policy = llm.runner, llm.config, llm.policy
        launched: list[int] = []
        runner.forward = with_forward_launches(runner.forward, launched)
        profile = assembly._dry_warm_ups(config, runner, policy, torch.float32)["profile forward"]
        with pc.dry_pass() as variants:
            profile()
    stand_in = [json.loads(v.specialization)["rows"] for v in variants if v.module == ForwardKernel.module]
    assert stand_in == [max(config.max_num_batched_tokens, config.max_model_len)] and launched == []


def test_naive_moe_gemm_puts_diffusion_gemma_experts_on_the_reference_path(tmp_path: Path):
    """``moe_gemm_impl`` reaches DiffusionGemma's stacked experts as it does SparseMoE layers: ``triton`` leaves each
    layer its own choice (the fused kernels where they win), ``naive`` the reference path (the loop on the CPU),
    ``vllm`` is refused by name."""
    from diffulex.models.diffusion_gemma import StackedExperts, load_diffusion_gemma
    from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint

    model = load_diffusion_gemma(write_tiny_diffusion_gemma_checkpoint(tmp_path / "dgemma", seed=0))
    experts = [module for module in model.modules() if isinstance(module, StackedExperts)]
    assert len(experts) == len(model.layers)
    assembly._select_moe_path(model, "triton", "dgemma")
    assert {module.impl for module in experts} == {None}
    assembly._select_moe_path(model, "naive", "dgemma")
    assert {module.impl for module in experts} == {"loop"}
    with pytest.raises(ValueError, match="moe_gemm_impl='vllm' for model_name='dgemma'"):
        assembly._select_moe_path(model, "vllm", "dgemma")


def helpers_started_on_16_cores(monkeypatch, stand_in=lambda count, start_now: count, **config):
    """What `_start_compile_helpers` gives on a 16-core host with triton's hook, `CompileHelpers` replaced by
    `stand_in`, for a config of these fields (the only ones the helpers' start reads; one rank by default)."""
    import types

    import diffulex.kernels.parallel_compile as parallel_compile

    monkeypatch.setattr(assembly, "usable_cores", lambda: 16)
    monkeypatch.setattr(parallel_compile, "parallel_compile_supported", lambda: True)
    monkeypatch.setattr(parallel_compile, "CompileHelpers", stand_in)
    monkeypatch.setattr("diffulex.layers.dispatch.triton_available", lambda: True)
    fields = {"attn_impl": "triton", "tensor_parallel_size": 1, "expert_parallel_size": 1, **config}
    return assembly._start_compile_helpers(types.SimpleNamespace(**fields), torch.device("cuda"))


@pytest.mark.parametrize(("setting", "started"), [(None, 15), ("3", 3), ("0", None)])
def test_the_compile_helpers_a_build_starts_are_capped_by_the_environment(monkeypatch, setting, started):
    """`DIFFULEX_COMPILE_HELPERS` caps the helper processes of a build (0: none), where many builds share the cores
    (a test suite over pytest workers); unset, the spare cores decide (all but the build's own, up to `MAX_HELPERS`)."""
    if setting is None:
        monkeypatch.delenv(assembly.COMPILE_HELPERS_ENV, raising=False)
    else:
        monkeypatch.setenv(assembly.COMPILE_HELPERS_ENV, setting)
    assert helpers_started_on_16_cores(monkeypatch) == started


@pytest.mark.parametrize(("tensor_parallel", "expert_parallel", "started"), [(1, 1, 15), (2, 1, 7), (1, 4, 3)])
def test_the_ranks_of_one_engine_share_the_hosts_cores_among_their_helpers(
    monkeypatch, tensor_parallel, expert_parallel, started
):
    monkeypatch.delenv(assembly.COMPILE_HELPERS_ENV, raising=False)
    ranks = {"tensor_parallel_size": tensor_parallel, "expert_parallel_size": expert_parallel}
    assert helpers_started_on_16_cores(monkeypatch, **ranks) == started


@pytest.mark.parametrize(("entries", "start_now"), [(set(), True), (None, True), ({"a1b2"}, False)])
def test_the_helpers_start_with_the_build_only_on_an_empty_triton_cache(monkeypatch, entries, start_now):
    """A first start compiles everything, so the helpers import while the weights load; with a filled cache they wait
    for the dry pass to find what is missing (most often nothing)."""
    monkeypatch.setattr(assembly, "_triton_cache_entries", lambda: entries)
    monkeypatch.delenv(assembly.COMPILE_HELPERS_ENV, raising=False)
    assert helpers_started_on_16_cores(monkeypatch, stand_in=lambda count, start_now: start_now) is start_now


def test_the_build_compiles_under_the_variant_locks_only_for_a_gpu(monkeypatch):
    """Its real warm-ups hold each compiling variant's lock, shared with the other builds of the host."""
    import contextlib

    import diffulex.kernels.parallel_compile as parallel_compile

    monkeypatch.setattr(parallel_compile, "parallel_compile_supported", lambda: True)
    locks = contextlib.nullcontext("locks")
    monkeypatch.setattr(parallel_compile, "compile_locks", lambda: locks)
    assert assembly._compile_locks(torch.device("cuda")) is locks
    assert assembly._compile_locks(torch.device("cpu")) is not locks


def test_a_bad_compile_helpers_setting_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"DIFFULEX_COMPILE_HELPERS='-1' is invalid: must be an integer >= 0"):
        assembly.helper_limit({"DIFFULEX_COMPILE_HELPERS": "-1"})
    assert assembly.helper_limit({}) > assembly.helper_limit({"DIFFULEX_COMPILE_HELPERS": "5"}) == 5
