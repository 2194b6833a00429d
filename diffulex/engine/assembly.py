"""Building an engine's parts from a Config: device, dtype, tokenizer, model, decode settings, the family's sampler,
the strategy's runner, page pool and scheduler, in the order their memory and compiles need.

`assemble` is the engine's constructor body; the step loop (`diffulex.engine.engine`) only uses what it returns.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from diffulex.config import Config, inert_settings
from diffulex.engine.build_phases import BuildPhases
from diffulex.engine.cpu_resources import choose_cpu_threads, default_cpu_threads, usable_cores
from diffulex.engine.graph_policy import GraphPolicy
from diffulex.engine.kv_cache_manager import KVCacheManager
from diffulex.engine.memory_plan import plan_num_pages, profile_shape
from diffulex.engine.model_runner import ModelRunner, RunnerSettings
from diffulex.engine.prefill_cost import PrefillCostModel
from diffulex.engine.scheduler import Scheduler, SchedulerLimits
from diffulex.engine.tensor_parallel import (
    DEATH_WAIT_S,
    TensorParallelWorkers,
    WorkerDiedError,
    engine_world_size,
    rank_device,
    start_tensor_parallel,
)
from diffulex.engine.tensor_parallel_check import parallel_fields
from diffulex.layers.parallel_state import engine_ranks
from diffulex.strategy.request import DecodeSettings, Request, decoded_for_progress
from diffulex.strategy.strategy import RunnerContext, SamplerContext, StepRunner, Strategy
from diffulex.validation import invalid_value, warn

if TYPE_CHECKING:
    from diffulex.kernels.build_manifest import BuildManifest
    from diffulex.kernels.parallel_compile import CompileHelpers, CompileReport

logger = logging.getLogger("diffulex")

# Compiling in helper processes pays off only with at least this many cores beside the build's own.
MIN_SPARE_CORES_FOR_HELPERS = 2
# The most compile helpers a build starts (0: none), where many builds share the host's cores: a test suite over
# pytest workers, several engines started side by side. Unset: as many as the spare cores allow.
COMPILE_HELPERS_ENV = "DIFFULEX_COMPILE_HELPERS"
# 0: the attention variants only eager steps launch compile at their first launch (`attention_warm_up_wanted`).
ATTENTION_WARM_UP_ENV = "DIFFULEX_ATTENTION_WARM_UP"
# The build phase in which the helper processes compile the warm-ups' kernel variants.
HELPER_PHASE = "kernels compiled in helper processes"
# The module that loads tokenizers (transformers only for a folder it cannot build itself), imported in its own phase.
TOKENIZER_MODULE = "diffulex.tokenizer"


@dataclass
class EngineParts:
    """Everything an engine serves with, built once."""

    device: torch.device
    dtype: torch.dtype
    tokenizer: object
    model: torch.nn.Module
    mask_token_id: int
    vocab_limit: int  # ids at or past this are padding rows of the embedding: never proposed
    settings: DecodeSettings
    runner: StepRunner
    scheduler: Scheduler
    request_cls: type[Request]
    policy: GraphPolicy
    build: BuildPhases
    workers: TensorParallelWorkers | None = None  # rank 0 of a tensor-parallel group: the other ranks


def assemble(config: Config, build: BuildPhases | None = None) -> EngineParts:
    """Build the parts in order: load, decide the graph policy, plan and allocate pages, warm up, capture.

    With ``tensor_parallel_size`` or ``expert_parallel_size > 1`` the engine's process first starts the other ranks
    (`diffulex.engine.tensor_parallel`), which run this same build on their shards, in step with it."""
    # the phases go on `build` (the engine's, started by Diffulex(...), which logs them once the engine is ready),
    # else on a clock of the assembly's own, logged here
    owned = build is None
    build = BuildPhases() if build is None else build
    _reject_unsupported(config)
    ranks = engine_ranks()
    if ranks.size > 1 and ranks.rank == 0:  # only a worker builds inside its group: this is rank 0 of an open engine
        raise ValueError(
            f"{parallel_fields(config)} is invalid here: this process is rank 0 of an open engine of {ranks.size} "
            "ranks, whose groups every layer built here would join (its workers are not in this build); exit() that "
            "engine first"
        )
    if ranks.rank == 0:  # said once, by the engine's process
        for line in inert_settings(config):
            warn(line)
    workers = None
    if engine_world_size(config) > 1 and engine_ranks().size == 1:  # the engine's process: rank 0
        workers = start_tensor_parallel(config, assemble)
        build.done("tensor-parallel workers")
    try:
        parts = _assemble_rank(config, build)
        if workers is not None:
            workers.wait_ready()
            parts.runner.workers = parts.workers = workers
    except BaseException as err:
        if workers is not None:  # they may wait inside a collective rank 0 will never reach
            death = workers.dead(DEATH_WAIT_S)
            workers.kill()
            # a worker's death explains a failed collective; an invalid setting every rank refused says itself
            if death is not None and not isinstance(err, (WorkerDiedError, ValueError)):
                raise WorkerDiedError(death) from err
        raise
    if owned:
        logger.info(build.summary())
    return parts


def _assemble_rank(config: Config, build: BuildPhases) -> EngineParts:
    """This rank's parts (the whole engine at one rank)."""
    device = _resolve_device(config)
    _initialize_device(device)
    build.done("device init")
    helpers = _start_compile_helpers(config, device)  # they import while the weights load
    try:
        return _assemble_parts(config, build, device, helpers)
    finally:
        if helpers is not None:
            helpers.close()


def _assemble_parts(
    config: Config,
    build: BuildPhases,
    device: torch.device,
    helpers: CompileHelpers | None,
) -> EngineParts:
    """The rank's parts once its device is up: weights, tokenizer, then the components."""
    from diffulex.layers.peer_exchange import connect_peer_exchange
    from diffulex.models.loader import build_model

    step_threads = None
    if device.type == "cpu":
        step_threads, build_threads = _cpu_threads(config)
        torch.set_num_threads(build_threads)  # process-wide, as torch has it
    with _collector_paused():
        dtype = _resolve_dtype(config, config.model_config_dict.get("torch_dtype"), device)
        model = build_model(
            config.model_name, config.model, dtype, device, load_format=config.load_format,
            seed=config.seed, lora_path=config.lora_path if config.use_lora else None,
            merge_lora=config.pre_merge_lora,
        )  # fmt: skip
        _select_moe_path(model, config.moe_gemm_impl, config.model_name)
        connect_peer_exchange(model, device, dtype, config.distributed_timeout_seconds)
        build.done("weights")
        # a phase of its own, so that a slow first import shows in the log (transformers takes seconds; it is imported
        # only for a tokenizer folder that diffulex.tokenizer cannot build itself)
        load_tokenizer = importlib.import_module(TOKENIZER_MODULE).load_tokenizer
        build.done("tokenizer import")
        tokenizer = load_tokenizer(config.tokenizer_path or config.model)
        build.done("tokenizer")
        mask_token_id = _resolve_mask_token_id(config, tokenizer, model)
        vocab_limit = min(len(tokenizer), model.config.vocab_size)
        settings = _decode_settings(config, tokenizer, mask_token_id)
        parts = _build_components(
            config, device, dtype, tokenizer, model, mask_token_id, vocab_limit, settings, build, helpers
        )  # fmt: skip
    if step_threads is not None:
        torch.set_num_threads(step_threads)
    return parts


def _build_components(
    config: Config,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer: object,
    model: torch.nn.Module,
    mask_token_id: int,
    vocab_limit: int,
    settings: DecodeSettings,
    build: BuildPhases,
    helpers: CompileHelpers | None = None,
) -> EngineParts:
    """The strategy's runner (or the engine's, with the strategy's sampler for the family), the page pool and the
    scheduler. `helpers` (`diffulex.kernels.parallel_compile.CompileHelpers`, on CUDA) first compile the kernel
    variants of the warm-ups that follow (`_dry_warm_ups`), all at once."""
    strategy = config.strategy
    token_merge = strategy.soft_inputs(config.strategy_options, mask_token_id)
    runner = strategy.make_runner(
        RunnerContext(
            model, device, dtype, config.page_size, vocab_limit, config.seed, config.strategy_options,
            enforce_eager=bool(config.enforce_eager),
        )
    )
    if runner is None:
        runner = _model_runner(config, device, dtype, model, mask_token_id, vocab_limit, token_merge)
    policy = GraphPolicy.decide(config, device, runner, settings.logits_shift)
    policy.maybe_compile(runner, config)
    build.done("runner")
    cache_entries = report = manifest = None
    if helpers is not None:
        manifest = _open_manifest(config, device, dtype)
        if manifest is not None and manifest.ready:
            helpers.close()
            logger.info("kernels: the %d variants this engine's last build launched are all in the Triton cache: no "
                        "dry pass", len(manifest.variants or ()))  # fmt: skip
        else:
            report = _compile_in_helpers(helpers, runner, _dry_warm_ups(config, runner, policy, dtype), device)
            cache_entries = _triton_cache_entries()
        build.done(HELPER_PHASE)
    with _compile_locks(device) as launched:  # another build on this host compiling a variant: wait, then load it
        num_pages = plan_num_pages(config, runner, device, dtype, policy)
        _allocate_kv_cache(config, runner, num_pages)
        build.done("memory plan and KV cache")
        if _leaves_attention_to_first_launch(runner):
            logger.info("kernels: the attention variants of eager steps compile at their first launch (%s=0)",
                        ATTENTION_WARM_UP_ENV)
        else:
            runner.warm_up_attention()
        build.done("attention kernels")
        policy.maybe_capture(runner, config, device)
        build.done("CUDA graphs")
        runner.warm_up_sampling(config.max_num_reqs * policy.max_rows_per_request, dtype)
        build.done("sampling kernels")
    if manifest is not None and launched is not None:
        manifest.record(launched)
    if report is not None and launched is not None:
        from diffulex.kernels.parallel_compile import never_launched, unforeseen

        for lines, what in ((never_launched(report.variants, launched), "recorded by the dry pass but never launched"),
                            (unforeseen(launched, report.variants), "launched but not recorded by the dry pass")):
            if lines:
                logger.info("kernels: %d %s: %s", len(lines), what, " | ".join(lines))
    if cache_entries is not None:
        after = _triton_cache_entries()
        if after is not None:  # what the dry pass did not foresee (or a helper compiled under another key)
            logger.info("kernels: %d compiled by the build itself after the helper processes%s",
                        len(after - cache_entries), _named_counts(_cached_kernel_names(after - cache_entries)))
    kv_cache = KVCacheManager(num_pages, config.page_size, bool(config.enable_prefix_caching))
    # the engine runner's continuations store blocks and open the next ones before the host sees them, so their
    # pages are lent ahead (a strategy's own runner continues only steps that store nothing)
    lends_pages = policy.continues and isinstance(runner, ModelRunner)
    limits = SchedulerLimits(
        config.max_num_reqs, config.max_num_batched_tokens, lends_pages, bool(config.enable_chunked_prefill),
        policy.prefill_chunk_rows, config.max_prefill_chunk_cost, _prefill_cost_model(config, model),
    )
    scheduler = Scheduler(limits, kv_cache)
    request_cls = strategy.request_class
    logger.info(
        "Diffulex engine: model=%s (%s, %s) strategy=%s block=%d buffer=%d pages=%d x %d on %s",
        config.model, config.model_name, dtype, strategy.name, config.block_size, config.buffer_size,
        num_pages, config.page_size, device,
    )  # fmt: skip
    return EngineParts(
        device, dtype, tokenizer, model, mask_token_id, vocab_limit, settings, runner, scheduler, request_cls, policy,
        build,
    )  # fmt: skip


def _prefill_cost_model(config: Config, model: torch.nn.Module) -> PrefillCostModel | None:
    """The price of prompt rows where ``max_prefill_chunk_cost`` sizes chunks by it, from the model's sizes."""
    if not (config.enable_chunked_prefill and config.max_prefill_chunk_cost > 0):
        return None
    try:
        return PrefillCostModel.from_model_config(model.config)
    except ValueError as err:
        raise invalid_value("max_prefill_chunk_cost", config.max_prefill_chunk_cost, str(err)) from None


def check_sampler_fits_strategy(strategy: Strategy, sampler: object) -> None:
    """A strategy that says its greedy steps sample inside the decode graph (`Strategy.samples_in_graph`, inherited
    as True) needs a sampler with the device rule those graphs capture (``greedy_result``). Checked at every build,
    on the CPU too, so that a plugin whose rule runs only on the host fails where it is written, naming the
    attribute, not at its first CUDA-graph capture on a GPU."""
    if strategy.samples_in_graph and not callable(getattr(sampler, "greedy_result", None)):
        raise ValueError(
            f"decoding_strategy={strategy.name!r} is invalid: samples_in_graph is True but its sampler "
            f"{type(sampler).__name__} has no greedy_result (the rule a decode graph captures); set "
            "samples_in_graph = False on the strategy for a rule that runs on the host (docs/architecture.md, "
            "\"Add a decoding strategy\")"
        )


def _model_runner(
    config: Config,
    device: torch.device,
    dtype: torch.dtype,
    model: torch.nn.Module,
    mask_token_id: int,
    vocab_limit: int,
    token_merge: object,
) -> ModelRunner:
    """The engine's runner: the block-causal forward over paged K/V, with the strategy's sampler."""
    strategy = config.strategy
    thresholds = config.decoding_thresholds
    sampler = strategy.make_sampler(
        SamplerContext(
            config.family, vocab_limit, mask_token_id, thresholds.accept_threshold, thresholds.edit_threshold,
            config.seed, config.strategy_options,
        )
    )  # fmt: skip
    check_sampler_fits_strategy(strategy, sampler)
    block_size = strategy.attention_block_size(config)
    runner_settings = RunnerSettings(
        block_size=block_size,
        page_size=config.page_size,
        prefix_full=bool(config.multi_block_prefix_full),
        device=device,
        kv_dtype=dtype,
        attn_impl=config.attn_impl,
        token_merge=token_merge,
        samples_in_graph=strategy.samples_in_graph,
        key_tails=strategy.attends_past_rows,
        mask_token_id=mask_token_id,
        # a sampler that forces in every block (Stable-DiffCoder's) lets a continuation's blocks force from the first
        decoded_to_force=0 if getattr(sampler, "force_every_block", False)
        else decoded_for_progress(block_size, thresholds.semi_complete_threshold),
        decoded_to_join=decoded_for_progress(block_size, thresholds.add_block_threshold),
    )
    return ModelRunner(runner_settings, model, sampler)


def _resolve_mask_token_id(config: Config, tokenizer: object, model: torch.nn.Module) -> int:
    """The explicit field, else what the checkpoint and tokenizer files name, else the family default."""
    from diffulex.tokenizer import resolve_mask_token_id

    mask_id = config.mask_token_id
    if mask_id is None:
        mask_id = resolve_mask_token_id(tokenizer, model.config, config.model, config.family.mask_token_id)
    if mask_id is None:
        raise ValueError(
            f"could not determine the mask token of {config.model}: the checkpoint config, tokenizer and "
            "special_tokens_map name none; pass mask_token_id=<id>"
        )
    vocab = model.config.vocab_size
    if not 0 <= mask_id < vocab:
        raise ValueError(f"mask_token_id={mask_id} is invalid: must be within the model's vocabulary [0, {vocab})")
    return mask_id


def _decode_settings(config: Config, tokenizer: object, mask_token_id: int) -> DecodeSettings:
    from diffulex.tokenizer import stop_token_ids

    thresholds = config.decoding_thresholds
    return DecodeSettings(
        block_size=config.strategy.attention_block_size(config),
        buffer_size=config.buffer_size,
        mask_token_id=mask_token_id,
        max_model_len=config.max_model_len,
        stop_token_ids=frozenset(stop_token_ids(tokenizer, config.model)),
        accept_threshold=thresholds.accept_threshold,
        add_block_threshold=thresholds.add_block_threshold,
        semi_complete_threshold=thresholds.semi_complete_threshold,
        auto_max_nfe_warmup_steps=config.auto_max_nfe_warmup_steps,
        auto_max_nfe_tpf_floor=config.auto_max_nfe_tpf_floor,
        logits_shift=config.family.logits_shift,
        token_stability_threshold=thresholds.token_stability_threshold,
        options=config.strategy_options,
    )


def _start_compile_helpers(config: Config, device: torch.device) -> CompileHelpers | None:
    """Helper processes that will compile the build's kernel variants side by side (`CompileHelpers`), where they
    can: a CUDA device, Triton attention, a triton with the hook a dry run needs, spare cores. None else. They start
    now (importing while the weights load) only where Triton's cache is empty; else once the dry pass has found what
    the cache lacks."""
    from diffulex.attention.layer import TRITON_IMPLS
    from diffulex.layers.dispatch import triton_available

    if device.type != "cuda" or config.attn_impl not in TRITON_IMPLS or not triton_available():
        return None
    # an engine's ranks build at once on one host (tensor or expert parallel): each takes its share of the cores, of
    # which its own thread keeps one
    spare = usable_cores() // engine_world_size(config) - 1
    if spare < MIN_SPARE_CORES_FOR_HELPERS:
        return None
    from diffulex.kernels.parallel_compile import MAX_HELPERS, CompileHelpers, parallel_compile_supported

    count = min(MAX_HELPERS, spare, helper_limit())
    if count < 1 or not parallel_compile_supported():
        return None
    return CompileHelpers(count, start_now=not _triton_cache_entries())  # an empty cache: every variant to compile


def _open_manifest(config: Config, device: torch.device, dtype: torch.dtype) -> BuildManifest | None:
    """This build's manifest of kernel variants (`diffulex.kernels.build_manifest`), named by what decides them, or
    None where it cannot be (Triton's cache folder or target unknown)."""
    try:
        import triton

        from diffulex.kernels.build_manifest import BuildManifest

        fields = {
            "engine": {name: value for name, value in config.to_dict().items() if name != "model"},
            "model": config.model_config_dict,
            "dtype": str(dtype),
            "device": [torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device))],
            "versions": [torch.__version__, triton.__version__],
            "attention warm-up": attention_warm_up_wanted(),
        }
        return BuildManifest.open(triton.knobs.cache.dir, fields, _compile_target(device))
    except Exception as err:  # noqa: BLE001  (no manifest costs only the dry pass it would have saved)
        logger.info("kernels: no build manifest (%s: %s)", type(err).__name__, err)
        return None


def _compile_locks(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """`diffulex.kernels.parallel_compile.compile_locks` where the build compiles Triton kernels for a GPU; a block
    that does nothing elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from diffulex.kernels.parallel_compile import compile_locks, parallel_compile_supported  # imports no triton

    return compile_locks() if parallel_compile_supported() else contextlib.nullcontext()


def helper_limit(environ: Mapping[str, str] | None = None) -> int:
    """`COMPILE_HELPERS_ENV` as a count of helpers (a non-negative integer), or no limit where it is unset."""
    raw = (os.environ if environ is None else environ).get(COMPILE_HELPERS_ENV, "").strip()
    if not raw:
        return sys.maxsize
    if not raw.isdigit():
        raise ValueError(f"{COMPILE_HELPERS_ENV}={raw!r} is invalid: must be an integer >= 0 (0: no compile helpers)")
    return int(raw)


def attention_warm_up_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """`ATTENTION_WARM_UP_ENV`: whether the build compiles every attention variant an eager step may launch (``1``,
    or unset) or leaves them to their first launch (``0``; only where the helpers compile the graphs' variants from
    the dry pass's forwards, `_leaves_attention_to_first_launch`). Serving wants them all before the first request (a
    compile met there stalls that step for seconds); a test suite on a fresh GPU machine, whose many engines of
    distinct geometries each launch a few of them, spends most of its CPU compiling the rest."""
    raw = (os.environ if environ is None else environ).get(ATTENTION_WARM_UP_ENV, "1").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(
            f"{ATTENTION_WARM_UP_ENV}={raw!r} is invalid: must be 1 (compile every attention variant while building, "
            "the default) or 0 (at their first launch)"
        )
    return raw == "1"


def _dry_warm_ups(
    config: Config, runner: StepRunner, policy: GraphPolicy, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    """The build's warm-ups that a dry pass may run (`diffulex.kernels.parallel_compile`), named, in the order the
    build runs them: the memory plan's profile forward (unless ``num_pages`` is given), the attention warm-up (unless
    `_leaves_attention_to_first_launch`), the warm-up forwards before the CUDA graphs' capture, the sampling warm-up;
    only the attention's where `_forwards_run_dry` says no; no graph warm-ups where ``torch.compile`` compiles the
    captured forward (Inductor compiles for real, outside Triton's hook)."""
    attention = {"attention": runner.warm_up_attention}
    if not _forwards_run_dry(runner):
        return attention
    warm_ups: dict[str, Callable[[], None]] = {}
    if config.num_pages <= 0:
        warm_ups["profile forward"] = lambda: runner.profile_run(*profile_shape(config, policy))
    if not _leaves_attention_to_first_launch(runner):
        warm_ups.update(attention)
    if runner.graph_forward == runner.model.forward:
        warm_ups["CUDA graph warm-ups"] = lambda: policy.rehearse_capture(runner, config)
    sample_rows = config.max_num_reqs * policy.max_rows_per_request
    warm_ups["sampling"] = lambda: runner.warm_up_sampling(sample_rows, dtype)
    return warm_ups


def _forwards_run_dry(runner: StepRunner) -> bool:
    """Whether a dry pass can run the build's forwards and sampling, not only its attention warm-up: not for a
    strategy's own runner, an engine of several ranks (their forwards and LM heads meet in collectives), a model with
    MoE layers (the experts' routing indexes memory by the router's output, which a skipped launch leaves as garbage)
    or with heads the Triton attention cannot tile (the PyTorch attention reads the step's layout back)."""
    from diffulex.attention.layer import triton_supports_head_dim
    from diffulex.layers.moe import ExpertLayer

    if not isinstance(runner, ModelRunner) or engine_ranks().size > 1:
        return False
    if any(isinstance(module, ExpertLayer) for module in runner.model.modules()):
        return False
    return all(triton_supports_head_dim(layer.head_dim) for layer in runner.attention_layers)


def _leaves_attention_to_first_launch(runner: StepRunner) -> bool:
    """`attention_warm_up_wanted` says no and the helpers still compile the graphs' variants (`_forwards_run_dry`):
    where only the attention warm-up runs dry, it is how the graphs' attention variants reach the helpers, and
    without it they would compile one after another in the capture."""
    return not attention_warm_up_wanted() and _forwards_run_dry(runner)


def _compile_in_helpers(
    helpers: CompileHelpers, runner: StepRunner, warm_ups: dict[str, Callable[[], None]], device: torch.device
) -> CompileReport | None:
    """Have `helpers` compile what `warm_ups` would compile (a dry pass of them, over a cache of one page, dropped
    after), for this device's target; their report, or None where that failed. Whatever goes wrong here is logged
    and costs only time: the warm-ups that follow compile what is missing themselves."""
    try:
        target = _compile_target(device)
        runner.allocate_kv_cache(1)  # attention needs a bound cache; a dry pass stores nothing
        try:
            report = helpers.compile_for(warm_ups, target)
        finally:
            runner.release_kv_cache()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except Exception as err:  # noqa: BLE001  (the real warm-ups compile for themselves)
        helpers.close()
        logger.warning("kernels: compiling in helper processes failed (%s: %s); the build compiles them itself",
                       type(err).__name__, err)  # fmt: skip
        return None
    recorded = ", ".join(f"{name} {count}" for name, count in report.recorded_by.items())
    logger.info(
        "kernels: %d variants (%s), %d not in the Triton cache%s, %d compiled by helper processes%s",
        report.recorded, recorded, report.missing, _named_counts(list(report.missing_names)), report.compiled,
        f" ({len(report.errors)} left to the build: {' | '.join(report.errors)})" if report.errors else "",
    )  # fmt: skip
    return report


def _triton_cache_entries() -> set[str] | None:
    """Entries of Triton's on-disk cache (one folder per compiled variant; none before its first compile), or None
    where it cannot be read."""
    try:
        import triton

        from diffulex.kernels.build_manifest import MANIFEST_FOLDER

        folder = triton.knobs.cache.dir
        return set(os.listdir(folder)) - {MANIFEST_FOLDER} if os.path.exists(folder) else set()
    except (AttributeError, ImportError, OSError):
        return None


def _cached_kernel_names(entries: set[str]) -> list[str]:
    """The kernel each cache entry holds (its metadata file is named after the kernel), for the build log."""
    import triton

    names = []
    for entry in entries:
        try:
            files = os.listdir(os.path.join(triton.knobs.cache.dir, entry))
        except OSError:
            continue
        names += [f.removesuffix(".json") for f in files if f.endswith(".json") and not f.startswith("__grp__")]
    return names


def _named_counts(names: list[str]) -> str:
    """`` (a x2, b)``: which kernels a log line's count is made of; empty for none."""
    if not names:
        return ""
    counts = Counter(names)
    return " (" + ", ".join(f"{name} x{n}" if n > 1 else name for name, n in sorted(counts.items())) + ")"


def _compile_target(device: torch.device) -> object:
    """The Triton target of `device`, which the helpers compile for (they never touch the GPU)."""
    from triton.runtime import driver

    with torch.cuda.device(device):
        return driver.active.get_current_target()


def _initialize_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device and create its context now, in its own phase, rather
    than inside whichever phase first touches the device (the driver's start and the context take seconds on some
    machines). Current, because Triton launches on the current device whatever its tensors' device: a replica on
    ``cuda:1`` of a process left at ``cuda:0`` fails its first kernel. Nothing to do on the CPU."""
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.set_device(device)
        torch.cuda.mem_get_info(device)  # the first query on the device creates its context


def _resolve_device(config: Config) -> torch.device:
    """This rank's device (`rank_device`; rank 0 on one rank)."""
    return rank_device(config, engine_ranks().rank)


def _select_moe_path(model: torch.nn.Module, moe_gemm_impl: str, model_name: str) -> None:
    """``moe_gemm_impl`` on the model's MoE layers: ``triton`` (the default) leaves each layer its own choice (the
    fused Triton kernels at decode row counts, the grouped GEMM on Hopper in bf16, else every expert), ``naive``
    takes the reference paths (the experts one by one on the CPU, every expert on CUDA). ``vllm*`` names kernels
    that are not a dependency: refused for a model with MoE layers (a dense model has nothing it would change).
    Every family's routed experts are such layers (`ExpertLayer`)."""
    from diffulex.layers.moe import ExpertLayer

    layers = [module for module in model.modules() if isinstance(module, ExpertLayer)]
    if layers and moe_gemm_impl.startswith("vllm"):
        raise ValueError(
            f"not supported yet in this version of Diffulex: moe_gemm_impl={moe_gemm_impl!r} for "
            f"model_name={model_name!r} (vLLM's MoE kernels are not a dependency)"
        )
    if moe_gemm_impl != "naive":
        return
    for module in layers:
        module.impl = "dense" if next(module.parameters()).is_cuda else "loop"


def _resolve_dtype(config: Config, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cpu":
        return torch.float32
    known = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    return known.get(checkpoint_dtype or "", torch.bfloat16)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No automatic garbage collection while the engine is built: nearly everything it allocates lives as long as
    the engine, so the collections its allocations trigger free nothing (0.3 s of the built-in model's build)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _checkpoint_num_params(config: Config) -> int | None:
    """Parameters in the checkpoint's safetensors files, read from their headers (`checkpoint_tensors`: no weight
    is read); None for ``load_format="dummy"`` or a folder the loader will reject anyway (it reports why)."""
    from diffulex.models.loader import checkpoint_tensors

    if config.load_format != "safetensors":
        return None
    try:
        return sum(math.prod(header.shape) for _, header in checkpoint_tensors(config.model).values())
    except (OSError, ValueError):
        return None


def _allocate_kv_cache(config: Config, runner: StepRunner, num_pages: int) -> None:
    """The page pool; a ``num_pages`` the user gave that the device cannot hold is refused naming the field (the
    planned count always fits: `plan_num_pages`)."""
    try:
        runner.allocate_kv_cache(num_pages)
    except (MemoryError, torch.OutOfMemoryError) as err:
        if config.num_pages <= 0:
            raise
        gib = num_pages * runner.page_bytes() / 2**30
        raise ValueError(
            f"num_pages={config.num_pages} is invalid: its KV cache takes {gib:.2f} GiB, more than the device can "
            f"allocate ({type(err).__name__}); lower it, or leave num_pages at -1 to size the cache by the memory left"
        ) from None


def _cpu_threads(config: Config) -> tuple[int, int]:
    """The CPU thread count of this model's steps (`diffulex.engine.cpu_resources.choose_cpu_threads`), and the
    count its build runs with: no more than the default for its size, since a small model's load is many small
    copies that a second thread only slows down where another process holds a core (the built-in model: 0.1 s on
    one thread, up to 1.4 s on two of a busy 2-core machine)."""
    num_params = _checkpoint_num_params(config)
    threads, why = choose_cpu_threads(config.cpu_threads, num_params)
    cores = usable_cores()
    if threads > cores:
        warn(f"{why} asks for {threads} CPU threads but this process may use {cores} cores: steps will wait")
    logger.info("CPU threads: %d (%s)", threads, why)
    build_threads = threads if num_params is None else min(threads, default_cpu_threads(num_params, cores))
    return threads, build_threads


def _reject_unsupported(config: Config) -> None:
    """Fields that validate today but whose feature arrives later fail here, where they would be used."""
    unsupported = []
    if config.data_parallel_size > 1:
        unsupported.append(
            f"data_parallel_size={config.data_parallel_size} in one engine (Diffulex(...) starts one replica per "
            "device for offline generate; the server runs one engine)"
        )
    if config.kv_cache_layout != "unified":
        unsupported.append(f"kv_cache_layout={config.kv_cache_layout!r}")
    if config.strategy.request_class is None:
        unsupported.append(f"decoding_strategy={config.decoding_strategy!r} (its engine step is still to come)")
    if unsupported:
        raise ValueError("not supported yet in this version of Diffulex: " + ", ".join(unsupported))
