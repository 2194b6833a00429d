"""The engine: builds the strategy's components from a Config and drives the step loop.

One step = the scheduler picks the batch and advances running sets -> the model runner does one forward and
samples -> each request applies its tokens, commits blocks, and is checked for completion. With
``async_scheduling`` a step whose successor has known rows gets that successor queued before its result is read
(`diffulex.engine.continuation`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from diffulex.attention.layer import triton_supports_head_dim
from diffulex.config import EDIT_MODEL_NAMES, Config, inert_settings, warn
from diffulex.engine.block import BlockStatus
from diffulex.engine.cpu_resources import available_memory, choose_cpu_threads, default_cpu_threads, usable_cores
from diffulex.engine.cuda_graph import MAX_GRAPH_REQUESTS
from diffulex.engine.edit_request import EditRequest
from diffulex.engine.model_runner import RunnerSettings
from diffulex.engine.request import CompletionReason, DecodeSettings, Request, StepRecord
from diffulex.engine.scheduler import SchedulerLimits
from diffulex.engine.step_profiler import StepProfiler
from diffulex.errors import EngineClosedError, EngineDeadError, RequestFailure
from diffulex.layers.token_merge import TokenMergeSettings
from diffulex.outputs import GenerationOutputs, Trajectory
from diffulex.prompts import Prompt, encode_prompt, is_conversation
from diffulex.registry import (
    AutoKVCacheManager,
    AutoModelForDiffusionLM,
    AutoModelRunner,
    AutoReq,
    AutoSampler,
    AutoScheduler,
)
from diffulex.sampler import SamplerSettings
from diffulex.sampler.confidence import PendingWrites
from diffulex.sampler.dmax import DMaxSampler
from diffulex.sampler.edit import EditSampler, EditSettings
from diffulex.sampling_params import SamplingParams

logger = logging.getLogger("diffulex")


# Share of the host's available memory a CPU page pool may take at most (the rest: activations, other processes).
CPU_KV_MEMORY_FRACTION = 0.5
GIB = float(1 << 30)
# The build's garbage is all in the youngest generation (the collector is paused while it is built): collecting
# that one before freezing frees it without rescanning every object the process holds (a full collection there
# took 0.4-0.6 s of the built-in model's build on a busy 2-core machine; older garbage, if any, is frozen too).
GC_BUILD_GENERATION = 0


class RequestUpdate:
    """What one step did to one request; ``trajectory`` is set once the request has finished.

    ``committed_token_ids`` (answer tokens in committed blocks: final, safe to stream) and ``answer_token_ids``
    (the decoded answer prefix so far, up to the first mask) are cut from the request's token list when first
    read, not at every step: decoded positions never change again, so the bounds taken at the step stay valid,
    and a caller that reads neither (offline generation) pays nothing per request and step.
    """

    __slots__ = ("req_id", "record", "finished", "trajectory", "_tokens", "_start", "_committed_end", "_answer_end")

    def __init__(
        self,
        req_id: int,
        record: StepRecord | None,
        finished: bool,
        committed_token_ids: list[int],
        answer_token_ids: list[int],
        trajectory: Trajectory | None = None,
    ) -> None:
        if answer_token_ids[: len(committed_token_ids)] != committed_token_ids:
            raise ValueError("committed_token_ids must be a prefix of answer_token_ids")
        self._set(req_id, record, finished, trajectory, answer_token_ids, 0, len(committed_token_ids))

    def _set(
        self,
        req_id: int,
        record: StepRecord | None,
        finished: bool,
        trajectory: Trajectory | None,
        tokens: list[int],
        start: int,
        committed_end: int,
        answer_end: int | None = None,
    ) -> None:
        """The answers are ``tokens[start:answer_end]`` (default: to the end), committed up to ``committed_end``."""
        self.req_id, self.record, self.finished, self.trajectory = req_id, record, finished, trajectory
        self._tokens, self._start = tokens, start
        self._committed_end = committed_end
        self._answer_end = len(tokens) if answer_end is None else answer_end

    @classmethod
    def of_request(cls, req: Request, record: StepRecord, trajectory: Trajectory | None) -> RequestUpdate:
        """The update of a request right after its step (a finished one reports its trajectory's answer)."""
        update = cls.__new__(cls)
        if trajectory is not None:
            answer = trajectory.token_ids
            update._set(req.req_id, record, True, trajectory, answer, 0, len(answer))
            return update
        answer_end = req.answer_end
        committed_end = min(req.committed_len, answer_end)
        update._set(req.req_id, record, False, None, req.token_ids, req.prompt_len, committed_end, answer_end)
        return update

    @property
    def committed_token_ids(self) -> list[int]:
        return self._tokens[self._start : self._committed_end]

    @property
    def answer_token_ids(self) -> list[int]:
        return self._tokens[self._start : self._answer_end]

    def __repr__(self) -> str:
        return (
            f"RequestUpdate(req_id={self.req_id}, finished={self.finished}, record={self.record!r}, "
            f"answer_token_ids={self.answer_token_ids!r})"
        )


def _resolve_device(config: Config) -> torch.device:
    if torch.cuda.is_available():
        index = config.device_ids[0] if config.device_ids else config.device_start
        return torch.device("cuda", index)
    return torch.device("cpu")


def generation_inputs(
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[list[Prompt], list[SamplingParams]]:
    """``generate``'s arguments as one list of prompts (a single prompt, text, token ids or a
    conversation, becomes a list of one) and one `SamplingParams` per prompt (one given for all, or one each).

    The shapes are checked here, before anything is queued, with an error naming the argument (and the prompt's
    index): a malformed call is a programming error, not a prompt to reject among others.
    """
    single = isinstance(prompts, str) or is_conversation(prompts)
    if single or (isinstance(prompts, (list, tuple)) and prompts and _is_token_id(prompts[0])):
        prompts = [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            f"prompts={_preview(prompts)} is invalid: must be a string, a list of token ids, or a list of those"
            + (" (decode bytes to str first)" if isinstance(prompts, (bytes, bytearray)) else "")
        )
    prompts = list(prompts)
    for i, prompt in enumerate(prompts):
        check_prompt_type(prompt, f"prompts[{i}]")
    if isinstance(sampling_params, SamplingParams) or sampling_params is None:
        return prompts, [sampling_params or SamplingParams()] * len(prompts)
    if not isinstance(sampling_params, (list, tuple)):  # a bad entry of a list rejects its prompt only
        raise ValueError(
            f"sampling_params={_preview(sampling_params)} is invalid: must be a SamplingParams, or a list of them "
            "with one per prompt"
        )
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ValueError(
            f"sampling_params has {len(params)} entries: must be one, or one per prompt ({len(prompts)})"
        )
    return prompts, params


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _preview(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_prompt_type(prompt: object, name: str = "prompt") -> None:
    """A prompt is a string, a list (or tuple) of integer token ids or a conversation; anything else is refused with
    its name, so that e.g. bytes are never read as a list of small integers."""
    if isinstance(prompt, str) or is_conversation(prompt):  # a conversation's messages: `encode_prompt` checks them
        return
    if isinstance(prompt, (list, tuple)):
        bad = next((t for t in prompt if not _is_token_id(t)), None)
        if bad is not None:
            raise ValueError(
                f"{name} is invalid: token ids must all be integers, got {_preview(bad)} ({type(bad).__name__})"
            )
        return
    hint = " (decode bytes to str first)" if isinstance(prompt, (bytes, bytearray)) else ""
    raise ValueError(
        f"{name}={_preview(prompt)} is invalid: must be a string or a list of token ids, not "
        f"{type(prompt).__name__}{hint}"
    )


def check_prompt(prompt: object, name: str = "prompt") -> None:
    """`check_prompt_type`, and the prompt is not empty and is valid Unicode (a lone surrogate cannot be encoded)."""
    check_prompt_type(prompt, name)
    if not prompt:
        raise ValueError(f"{name}={prompt!r} is invalid: must be a non-empty string or list of token ids")
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"{name} is invalid: it is not valid Unicode text ({err.reason} at character {err.start})"
            ) from None


def _select_moe_path(model: torch.nn.Module, moe_gemm_impl: str) -> None:
    """``moe_gemm_impl`` on the model's MoE layers: ``triton`` (the default) leaves each layer its own choice (the
    grouped GEMM on Hopper in bf16, else every expert; a Triton MoE kernel is to come), ``naive`` takes the
    reference paths (the experts one by one on the CPU, every expert on CUDA). ``vllm*`` is refused earlier."""
    from diffulex.layers.moe import SparseMoE

    if moe_gemm_impl != "naive":
        return
    for module in model.modules():
        if isinstance(module, SparseMoE):
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
    """Parameters in the checkpoint's safetensors files, read from their headers (no weight is read); None for
    ``load_format="dummy"`` or a folder the loader will reject anyway (it reports why)."""
    from safetensors import safe_open

    from diffulex.models.loader import checkpoint_files

    if config.load_format != "safetensors":
        return None
    try:
        total = 0
        for path in checkpoint_files(config.model):
            with safe_open(str(path), framework="pt") as f:
                total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        return total
    except (OSError, ValueError, RuntimeError):
        return None


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
    if config.tensor_parallel_size > 1:
        unsupported.append(f"tensor_parallel_size={config.tensor_parallel_size}")
    if config.data_parallel_size > 1:
        unsupported.append(
            f"data_parallel_size={config.data_parallel_size} in one engine (Diffulex(...) starts one replica per "
            "device for offline generate; the server runs one engine)"
        )
    if config.expert_parallel_size > 1:
        unsupported.append(f"expert_parallel_size={config.expert_parallel_size}")
    if config.sampling_mode == "edit" and config.decoding_strategy not in ("multi_bd", "dmax"):
        unsupported.append(
            f"sampling_mode='edit' with decoding_strategy={config.decoding_strategy!r} (edit mode runs under "
            "multi_bd and dmax)"
        )
    if config.moe_gemm_impl.startswith("vllm") and config.model_name in ("sdar_moe", *EDIT_MODEL_NAMES):
        unsupported.append(f"moe_gemm_impl={config.moe_gemm_impl!r} (vLLM's MoE kernels are not a dependency)")
    if config.kv_cache_layout != "unified":
        unsupported.append(f"kv_cache_layout={config.kv_cache_layout!r}")
    if config.decoding_strategy not in AutoReq:
        unsupported.append(f"decoding_strategy={config.decoding_strategy!r} (available: {AutoReq.names()})")
    if config.model_name not in AutoModelForDiffusionLM:
        unsupported.append(f"model_name={config.model_name!r} (available: {AutoModelForDiffusionLM.names()})")
    if unsupported:
        raise ValueError("not supported yet in this version of Diffulex: " + ", ".join(unsupported))


@dataclass
class _InFlightStep:
    """A launched step whose result the host has not applied yet."""

    batch: list[Request]
    views: list[tuple[tuple[int, int], tuple[int, ...]]]  # per request: query range, running block indices
    pending: PendingWrites
    started: float  # perf_counter() at scheduling
    continuation: bool = False  # launched before the previous step's result (`diffulex.engine.continuation`)
    # a continuation that only stores decoded blocks samples nothing: the host applies it without waiting for it
    result_known: bool = False


@dataclass
class _AppliedStep:
    """A step whose result is applied to its requests, not yet reported (`DiffulexEngine.step`)."""

    index: int
    step_time: float  # seconds from scheduling to the applied result
    # per request: its view at launch (query range, running block indices) and how many masks it filled
    requests: list[tuple[Request, tuple[tuple[int, int], tuple[int, ...]], int]] = field(default_factory=list)


class DiffulexEngine:
    """Offline and online generation over one model replica."""

    def __init__(self, config: Config) -> None:
        import diffulex.models  # noqa: F401  (registers the model families)
        import diffulex.strategy  # noqa: F401  (registers the strategies)
        from diffulex.models.loader import build_model
        from diffulex.tokenizer import load_tokenizer

        _reject_unsupported(config)
        self.config = config
        for line in inert_settings(config):
            warn(line)
        self.device = _resolve_device(config)
        step_threads = None
        if self.device.type == "cpu":
            step_threads, build_threads = _cpu_threads(config)
            torch.set_num_threads(build_threads)  # process-wide, as torch has it
        with _collector_paused():
            self.tokenizer = load_tokenizer(config.tokenizer_path or config.model)
            self.dtype = _resolve_dtype(config, config.model_config_dict.get("torch_dtype"), self.device)
            self.model = build_model(
                config.model_name, config.model, self.dtype, self.device, load_format=config.load_format,
                seed=config.seed, lora_path=config.lora_path if config.use_lora else None,
                merge_lora=config.pre_merge_lora,
            )  # fmt: skip
            _select_moe_path(self.model, config.moe_gemm_impl)
            self.mask_token_id = self._resolve_mask_token_id()
            self.vocab_limit = min(len(self.tokenizer), self.model.config.vocab_size)
            self.settings = self._decode_settings()
            self._build_components()
        if step_threads is not None:
            torch.set_num_threads(step_threads)
        self._next_req_id = 0
        self._num_steps = 0
        self._num_launches = 0
        self._in_flight: deque[_InFlightStep] = deque()
        self.num_continuations = 0  # steps launched before their predecessor's result (statistics)
        self._profiler = StepProfiler(config.profiler_config) if config.profiler_config.enabled else None
        self.num_dropped_continuations = 0  # of those, steps the host found it would not have launched
        self._closed = False
        self._dead: str | None = None  # why the device stopped working, once it has
        self._launching: list[Request] = []  # the batch whose launch is under way (for a failure inside it)
        self._applying: _InFlightStep | None = None  # the step whose result is being applied (likewise)
        # Everything built so far (model, tokenizer tables, graphs) lives as long as the engine: move it out of
        # the collector's reach, or every full collection during generation rescans it (tens of ms per pause).
        gc.collect(GC_BUILD_GENERATION)
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # once per process, however many engines
        atexit.register(gc.unfreeze)  # let interpreter shutdown free them (extension modules report leaks)

    def _resolve_mask_token_id(self) -> int:
        """The explicit field, else what the checkpoint and tokenizer files name, else the family default."""
        from diffulex.tokenizer import resolve_mask_token_id

        config = self.config
        mask_id = config.mask_token_id
        if mask_id is None:
            model_cls = AutoModelForDiffusionLM.get(config.model_name)
            family_mask = getattr(model_cls, "family_defaults", {}).get("mask_token_id")
            mask_id = resolve_mask_token_id(self.tokenizer, self.model.config, config.model, family_mask)
        if mask_id is None:
            raise ValueError(
                f"could not determine the mask token of {config.model}: the checkpoint config, tokenizer and "
                "special_tokens_map name none; pass mask_token_id=<id>"
            )
        vocab = self.model.config.vocab_size
        if not 0 <= mask_id < vocab:
            raise ValueError(f"mask_token_id={mask_id} is invalid: must be within the model's vocabulary [0, {vocab})")
        return mask_id

    def _decode_settings(self) -> DecodeSettings:
        from diffulex.tokenizer import stop_token_ids

        config, thresholds = self.config, self.config.decoding_thresholds
        model_cls = AutoModelForDiffusionLM.get(config.model_name)
        return DecodeSettings(
            block_size=config.block_size,
            buffer_size=config.buffer_size,
            mask_token_id=self.mask_token_id,
            max_model_len=config.max_model_len,
            stop_token_ids=frozenset(stop_token_ids(self.tokenizer, config.model)),
            accept_threshold=thresholds.accept_threshold,
            add_block_threshold=thresholds.add_block_threshold,
            semi_complete_threshold=thresholds.semi_complete_threshold,
            auto_max_nfe_warmup_steps=config.auto_max_nfe_warmup_steps,
            auto_max_nfe_tpf_floor=config.auto_max_nfe_tpf_floor,
            logits_shift=bool(getattr(model_cls, "logits_shift", False)),
            max_post_edit_steps=config.max_post_edit_steps,
            token_stability_threshold=thresholds.token_stability_threshold,
        )

    def _build_components(self) -> None:
        """The strategy's runner, page pool and scheduler, and the family's sampler."""
        config, strategy = self.config, self.config.decoding_strategy
        token_merge = self._token_merge()
        if config.sampling_mode == "edit":
            edit_settings = EditSettings(
                self.vocab_limit, self.mask_token_id, self.settings.accept_threshold,
                config.decoding_thresholds.edit_threshold, config.penalty_lambda, config.seed,
                config.dmax_sampler_fast_path, token_merge,
            )  # fmt: skip
            sampler = DMaxSampler(edit_settings) if strategy == "dmax" else EditSampler(edit_settings)
        else:
            sampler = AutoSampler.get(config.model_name)(
                SamplerSettings(self.vocab_limit, self.mask_token_id, self.settings.accept_threshold, config.seed)
            )
        runner_settings = RunnerSettings(
            block_size=config.block_size,
            page_size=config.page_size,
            prefix_full=bool(config.multi_block_prefix_full),
            device=self.device,
            kv_dtype=self.dtype,
            attn_impl=config.attn_impl,
            token_merge=token_merge,
        )
        self.runner = AutoModelRunner.get(strategy)(runner_settings, self.model, sampler)
        self._maybe_compile()
        num_pages = self._plan_num_pages()
        self.runner.allocate_kv_cache(num_pages)
        self.runner.warm_up_attention()
        self._maybe_capture_graphs()
        self.runner.warm_up_sampling(config.max_num_reqs * self._max_rows_per_request(), self.dtype)
        kv_cache = AutoKVCacheManager.get(strategy)(num_pages, config.page_size, bool(config.enable_prefix_caching))
        limits = SchedulerLimits(config.max_num_reqs, config.max_num_batched_tokens, self._continues)
        self.scheduler = AutoScheduler.get(strategy)(limits, kv_cache)
        # edit mode keeps the strategy's scheduling with requests whose decoded tokens stay editable
        self.request_cls = EditRequest if config.sampling_mode == "edit" else AutoReq.get(strategy)
        logger.info(
            "Diffulex engine: model=%s (%s, %s) strategy=%s block=%d buffer=%d pages=%d x %d on %s",
            config.model, config.model_name, self.dtype, strategy, config.block_size, config.buffer_size,
            num_pages, config.page_size, self.device,
        )

    def _token_merge(self) -> TokenMergeSettings | None:
        """DMax's soft inputs, when the strategy is dmax and ``token_merge_weight > 0``."""
        config = self.config
        if config.decoding_strategy != "dmax" or config.token_merge_weight <= 0:
            return None
        return TokenMergeSettings(
            config.token_merge_mode, config.token_merge_top_k, config.token_merge_weight,
            config.token_merge_renormalize, self.mask_token_id,
        )  # fmt: skip

    @property
    def _continues(self) -> bool:
        """Whether steps may be continued on the device (``async_scheduling`` with one batch per step, greedy
        graph sampling and a single-block running set); with two micro-batches the other half already hides the
        host's work."""
        config = self.config
        return (
            config.async_scheduling
            and config.micro_batches == 1
            and config.buffer_size == 1
            and config.sampling_mode == "naive"  # edit mode samples on the host
        )

    @property
    def _staging_buffers(self) -> int:
        """Host staging buffers of the graphs: one per step that may be in flight."""
        return 2 if self._continues else self.config.micro_batches

    def _max_rows_per_request(self) -> int:
        """The most rows one request adds to a decode step: its running set, plus the recomputed row of a shifted
        family. Bounds the graphs' query length, the sampled rows and the profiled logits."""
        return self.config.buffer_size * self.config.block_size + int(self.settings.logits_shift)

    # ----- memory -------------------------------------------------------------------------------------------

    def _plan_num_pages(self) -> int:
        """Pages that fit: the explicit ``num_pages``, else what memory leaves after weights and activations."""
        config = self.config
        if config.num_pages > 0:
            return config.num_pages
        page_bytes = self.runner.page_bytes()
        pages_per_req = -(-config.max_model_len // config.page_size)
        wanted = pages_per_req * config.max_num_reqs
        if self.device.type == "cuda":
            budget, report = self._gpu_kv_budget()
        else:
            budget, report = self._cpu_kv_budget(wanted * page_bytes)
        affordable = max(budget, 0) // page_bytes
        if affordable < pages_per_req:
            raise ValueError(
                f"not enough memory for the KV cache: one request of max_model_len={config.max_model_len} needs "
                f"{pages_per_req} pages of {page_bytes} bytes ({pages_per_req * page_bytes / GIB:.2f} GiB) but "
                f"only {affordable} fit ({report}); lower max_model_len, max_num_batched_tokens or max_num_reqs, "
                "raise gpu_memory_utilization, or use a smaller model"
            )
        return int(min(wanted, affordable))

    @staticmethod
    def _cpu_kv_budget(wanted_bytes: int) -> tuple[int, str]:
        """Bytes a CPU page pool may take: `CPU_KV_MEMORY_FRACTION` of the memory the host has available (cgroup
        limit included). The pool is allocated as untouched zero pages, so it costs memory only as pages fill."""
        available = available_memory()
        if available is None:
            return wanted_bytes, "the host's available memory is unknown"
        budget = int(available * CPU_KV_MEMORY_FRACTION)
        report = (
            f"{available / GIB:.2f} GiB of host memory available x {CPU_KV_MEMORY_FRACTION} = {budget / GIB:.2f} GiB"
        )
        return budget, report

    def _gpu_kv_budget(self) -> tuple[int, str]:
        """Bytes left for pages: ``total * gpu_memory_utilization`` minus what the process and others already hold,
        minus the measured activation peak of the largest forward, minus the CUDA graphs' pool.

        The peak is measured, not estimated: one eager forward over the largest step the scheduler can build
        (``max(max_num_batched_tokens, max_model_len)`` rows) and the sampler's logits for every running row.
        """
        config, dev = self.config, self.device
        num_tokens = max(config.max_num_batched_tokens, config.max_model_len)
        sample_rows = config.max_num_reqs * self._max_rows_per_request()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        weights = torch.cuda.memory_allocated(dev)
        self.runner.allocate_kv_cache(1)  # attention needs a bound cache; the profile stores nothing
        self.runner.profile_run(num_tokens, config.max_model_len, sample_rows)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        self.runner.release_kv_cache()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        others = (total - free) - torch.cuda.memory_reserved(dev)  # other processes, CUDA context, NCCL
        activations = peak - weights
        graphs = 0
        if self._use_cuda_graphs():
            # the graphs' pool holds one decode forward of the largest bucket (scale the measured peak) and its
            # sampling graph's logits, which cover every row of the bucket
            graph_tokens = min(config.max_num_reqs, MAX_GRAPH_REQUESTS) * self._max_rows_per_request()
            graphs = int(activations * min(1.0, graph_tokens / num_tokens))
            graphs += graph_tokens * self.runner.token_embedding().num_embeddings * self.dtype.itemsize
        budget = int(total * config.gpu_memory_utilization) - others - peak - graphs
        report = (
            f"{total / GIB:.1f} GiB x gpu_memory_utilization={config.gpu_memory_utilization} = "
            f"{total * config.gpu_memory_utilization / GIB:.1f} GiB; weights {weights / GIB:.2f} GiB, activation "
            f"peak {activations / GIB:.2f} GiB ({num_tokens} tokens), CUDA graphs {graphs / GIB:.2f} GiB, other "
            f"processes and the CUDA context {others / GIB:.2f} GiB; {max(budget, 0) / GIB:.2f} GiB left"
        )
        logger.info("memory plan: %s", report)
        return budget, report

    # ----- CUDA graphs and torch.compile -----------------------------------------------------------------------

    def _use_cuda_graphs(self) -> bool:
        config = self.config
        return (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self._token_merge() is None  # soft inputs are an eager-step feature
            and config.enable_full_static_runner
            and config.attn_impl in ("triton", "triton_grouped")
            # a captured step replays its launches: the PyTorch attention path reads the layout on the host
            and all(triton_supports_head_dim(layer.head_dim) for layer in self.runner.attention_layers)
        )

    def _maybe_compile(self) -> None:
        """``enable_torch_compile`` with ``enable_cudagraph_torch_compile``: compile the forward the graphs capture."""
        config = self.config
        if self._use_cuda_graphs() and config.enable_torch_compile and config.enable_cudagraph_torch_compile:
            self.runner.compile_forward(config.torch_compile_mode)

    def _maybe_capture_graphs(self) -> None:
        if self.device.type == "cuda" and not self._use_cuda_graphs() and not self.config.enforce_eager:
            logger.info(
                "CUDA graphs off: they need attn_impl 'triton' or 'triton_grouped' and the static runner, and no "
                "token merge (dmax with token_merge_weight > 0)"
            )
        if not self._use_cuda_graphs():
            return
        t0 = time.perf_counter()
        self.enable_static_decode(capture=True)
        logger.info("CUDA graph capture took %.1f s", time.perf_counter() - t0)

    def enable_static_decode(self, capture: bool) -> None:
        """Serve decode steps from the padded static buffers of the graph path, captured as CUDA graphs or (CPU
        tests, ``capture=False``) run through the eager forward: one place for the shape the engine's graphs
        take."""
        config = self.config
        self.runner.enable_decode_graphs(
            max_requests=config.max_num_reqs,
            max_query_len=self._max_rows_per_request(),
            max_model_len=config.max_model_len,
            capture=capture,
            staging_buffers=self._staging_buffers,
            continuations=self._continues,
            logits_shift=self.settings.logits_shift,
        )

    # ----- requests -----------------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> list[int]:
        ids = encode_prompt(self.tokenizer, prompt, mask_token_id=self.mask_token_id, vocab_size=self.vocab_limit)
        if len(ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens is invalid: must be shorter than max_model_len="
                f"{self.config.max_model_len} so that at least one token can be generated"
            )
        return ids

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Raises ValueError for bad input without touching engine state."""
        self._check_open()
        check_prompt(prompt)
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params={sp!r} is invalid: must be a SamplingParams")
        ids = self._encode(prompt)
        kv = self.scheduler.kv_cache
        needed = kv.pages_for(min(len(ids) + sp.max_tokens, self.config.max_model_len))
        if needed > kv.num_pages:
            raise ValueError(
                f"request needs up to {needed} KV pages but the pool has {kv.num_pages}; raise num_pages or lower "
                "max_tokens"
            )
        req = self.request_cls(self._next_req_id, ids, sp, self.settings)
        self._next_req_id += 1
        self.scheduler.add(req)
        return req.req_id

    def abort_request(self, req_id: int) -> bool:
        """Stop a waiting or running request now and free its pages; False if it is unknown or finished."""
        return self.scheduler.abort(req_id) is not None

    def is_finished(self) -> bool:
        return not self.scheduler.has_unfinished()

    def step(self) -> list[RequestUpdate]:
        """Run one forward over the scheduled requests and advance them.

        The call waits for the oldest launched step, applies its result, launches the next step, and only then
        builds the returned updates and step records: the GPU computes the next step while the host reports this
        one. So when a call returns, the next step is usually already in flight; a request added now joins the
        step after it, and one aborted now has the in-flight step's result dropped.

        With ``micro_batches=2`` the running requests form two micro-batches that take turns: one is in flight
        while the host finishes, schedules and collects the other. Each request sees exactly the steps it would
        see alone; only the interleaving with other requests changes.

        A failure inside the step finishes the requests it can be traced to (a `RequestFailure` names them, else
        every request of the failed step) with ``CompletionReason.ERROR`` and the error in their trajectory; the
        other requests go on, and so does the engine. Only a device that no longer works raises
        (`EngineDeadError`): nothing can be served on it any more.
        """
        self._check_open()
        if self._profiler is not None:
            self._profiler.before_step()
        applied: _AppliedStep | None = None
        try:
            self._launch_until_full()
            if not self._in_flight:
                if self.scheduler.waiting:
                    raise RequestFailure(
                        [req.req_id for req in self.scheduler.waiting],
                        "no request could be scheduled although requests are waiting",
                    )
                return []
            self._maybe_continue()
            self._applying = self._in_flight.popleft()
            applied = self._apply(self._applying)
            self._applying = None
            self._check_continuation()
            self._launch_until_full()
            updates = self._report(applied)
        except Exception as err:  # noqa: BLE001  (any failure of a step is contained, see the docstring)
            return self._recover(err, applied)
        if self._profiler is not None:
            self._profiler.after_step()
        return updates

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine cannot serve any more: its device failed ({self._dead})")
        if self._closed:
            raise EngineClosedError("the engine has been shut down (exit() was called); build a new Diffulex engine")

    def _recover(self, err: Exception, applied: _AppliedStep | None) -> list[RequestUpdate]:
        """Contain a failed step: finish the requests it is traced to with the error, drop every launched step
        (a continuation's inputs come from the failed one, and a dropped step's rows are launched again when its
        requests are next scheduled, as for a dropped continuation), and report what was applied before the
        failure, so that no finished request goes unreported."""
        if not self._device_works():
            self._dead = f"{type(err).__name__}: {err}"
            logger.error("the device failed; the engine stops serving", exc_info=err)
            raise EngineDeadError(f"the engine cannot serve any more: its device failed ({self._dead})") from err
        if isinstance(err, RequestFailure):
            queued = {req.req_id: req for req in (*self.scheduler.running, *self.scheduler.waiting)}
            victims = [queued[rid] for rid in err.req_ids if rid in queued]
            message = f"{err}"
        else:  # the batch of the step that failed: being launched, being applied, applied, else all in flight
            if self._launching:
                victims = list(self._launching)
            elif self._applying is not None:
                victims = list(self._applying.batch)
            elif applied is not None:
                victims = [req for req, _, _ in applied.requests]
            else:
                victims = [req for step in self._in_flight for req in step.batch]
            message = f"the engine step failed: {type(err).__name__}: {err}"
        logger.error("a step failed; %d request(s) finish with an error: %s", len(victims), message, exc_info=err)
        self._in_flight.clear()
        self._applying, self._launching = None, []
        self.runner.forget_launches()
        updates = self._safe_report(applied) if applied is not None else []
        reported = {update.req_id for update in updates}
        for req in victims:
            if req.is_finished:
                continue
            self.scheduler.finish(req, CompletionReason.ERROR)
            req.error = message
            trajectory = self._trajectory(req)
            if req.req_id in reported:  # it advanced in the applied step: replace that update with the failure
                updates = [u for u in updates if u.req_id != req.req_id]
            updates.append(RequestUpdate.of_request(req, None, trajectory))
        return updates

    def _safe_report(self, applied: _AppliedStep) -> list[RequestUpdate]:
        try:
            return self._report(applied)
        except Exception:  # noqa: BLE001  (a report that failed once fails again: its requests are failed)
            logger.exception("reporting the applied step failed")
            return []

    def _device_works(self) -> bool:
        """Whether the device still runs work: a CUDA error that poisons the context fails every later call."""
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
            torch.zeros(1, device=self.device).add_(1).item()
        except Exception:  # noqa: BLE001
            return False
        return True

    def _launch_until_full(self) -> None:
        """Launch steps until ``micro_batches`` are in flight or nothing more can be scheduled."""
        while len(self._in_flight) < self.config.micro_batches:
            launched = self._launch()
            if launched is None:
                return
            self._in_flight.append(launched)

    def _launch(self) -> _InFlightStep | None:
        """Schedule the next (micro-)batch among the requests not in flight and queue its forward and sampler."""
        t0 = time.perf_counter()
        scheduler = self.scheduler
        busy = {req.req_id for step in self._in_flight for req in step.batch}
        active = len(scheduler.running) + len(scheduler.waiting)
        batch = scheduler.schedule(busy, max_reqs=-(-active // self.config.micro_batches))
        if not batch:
            return None
        # the forward's view of each request, for its step record: its query range and its running set
        views = [(req.query_range(), tuple(b.index for b in req.running)) for req in batch]
        self._launching = batch
        pending = self.runner.launch(batch, self._num_launches % self._staging_buffers)
        self._launching = []
        self._num_launches += 1
        return _InFlightStep(batch, views, pending, t0)

    def _maybe_continue(self) -> None:
        """Queue the successor of the step in flight before reading its result, when its rows are known already
        (`diffulex.engine.continuation`): nobody waits for admission, every running request takes part, and each
        computes the same rows next step whatever this step accepts."""
        if len(self._in_flight) != 1 or not self._continues or not self.runner.can_continue:
            return
        newest, scheduler = self._in_flight[-1], self.scheduler
        if scheduler.waiting or len(newest.batch) != len(scheduler.running):
            return
        for req, (query, _) in zip(newest.batch, newest.views, strict=True):
            if req.is_finished or req.query_range() != query or not req.next_step_has_same_rows():
                return
        t0 = time.perf_counter()
        pending = self.runner.launch_continuation(self._num_launches % self._staging_buffers)
        self._num_launches += 1
        self.num_continuations += 1
        self._in_flight.append(_InFlightStep(newest.batch, newest.views, pending, t0, continuation=True))

    def _check_continuation(self) -> None:
        """Now that its predecessor's result is applied, check the continuation in flight against the step the
        host would launch itself, request by request; drop it if one differs (its result is never read, and what
        it stored is stored again by the step launched instead). A continuation that only stores decoded blocks
        samples nothing, so its result is known: the next call applies it at once and launches the step after it
        without waiting for the device.

        A continuation samples the positions of the predecessor's layout that are still masks, and stores a block
        once none is left. The host's next step samples its `Request.sample_targets` and stores a block that became
        ``TO_CACHE``. They differ when a stop token in the middle of the block moved the decoding limit. A
        continuation whose requests have all finished is dropped too.
        """
        if not self._in_flight or not self._in_flight[0].continuation:
            return
        launched = self._in_flight[0]
        if all(req.is_finished for req in launched.batch):  # nothing left to apply it to
            self._in_flight.popleft()
            return
        pending, mask = launched.pending, self.mask_token_id
        left: dict[int, list[int]] = {}
        for owner, position in zip(pending.owners, pending.positions, strict=True):
            left.setdefault(owner, []).append(position)
        stores_only = True
        for req in launched.batch:
            if req.is_finished:
                continue
            device_rows = [p for p in left.get(req.req_id, []) if req.token_ids[p] == mask]
            host_rows = [p for target in req.sample_targets() for p in target.positions]
            block = req.running[0]
            stores = block.status is BlockStatus.TO_CACHE
            if device_rows != host_rows or stores != (not device_rows):
                self._in_flight.popleft()
                self.num_dropped_continuations += 1
                logger.debug("dropped a continuation step: request %d differs from the host's next step", req.req_id)
                return
            stores_only &= stores
        launched.result_known = stores_only

    def _apply(self, launched: _InFlightStep) -> _AppliedStep:
        """Wait for a launched step's result and apply it to its requests: everything the next schedule reads.

        A request aborted while its step was in flight is skipped: nothing of that step is applied to it.
        """
        writes = launched.pending.writes if launched.result_known else launched.pending.result()
        applied = _AppliedStep(self._num_steps, time.perf_counter() - launched.started)
        for req, view in zip(launched.batch, launched.views, strict=True):
            if req.is_finished:
                continue
            filled = self.scheduler.finish_step(req, writes[req.req_id])
            if not req.is_finished and req.sampling_params.stop:
                self._check_stop_strings(req)
            applied.requests.append((req, view, filled))
        self._num_steps += 1
        return applied

    def _report(self, applied: _AppliedStep) -> list[RequestUpdate]:
        """The step records and updates of an applied step.

        Built after the next step's launch, which may open blocks (masks appended after every decoded position)
        or preempt (cached blocks stay committed): neither moves a bound the record or the update takes, the
        first mask, the committed end, or the tokens of the step's own query range.
        """
        updates = []
        for req, ((start, end), ids), filled in applied.requests:
            lo = req.blocks[ids[0]].start if ids else end
            record = StepRecord(applied.index, end - start, filled, ids, tuple(req.token_ids[lo:end]))
            record.step_time = applied.step_time
            req.steps.append(record)
            trajectory = self._trajectory(req) if req.is_finished else None
            updates.append(RequestUpdate.of_request(req, record, trajectory))
        return updates

    def _check_stop_strings(self, req: Request) -> None:
        """Finish a request whose decoded answer contains one of its stop strings."""
        text = self.tokenizer.decode(req.answer_token_ids(), skip_special_tokens=True)
        if any(stop in text for stop in req.sampling_params.stop):
            self.scheduler.finish(req, CompletionReason.STOP_STRING)

    def _answer(self, req: Request) -> tuple[list[int], str]:
        """The final answer; with a stop string, cut before its first occurrence (text and tokens)."""
        ids = req.answer_token_ids()
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if req.completion_reason is CompletionReason.STOP_STRING:
            text = text[: min(i for i in (text.find(s) for s in req.sampling_params.stop) if i >= 0)]
            # Keep the shortest token prefix whose text covers what remains of the answer.
            keep = next(
                k for k in range(len(ids) + 1)
                if len(self.tokenizer.decode(ids[:k], skip_special_tokens=True)) >= len(text)
            )
            ids = ids[:keep]
        return ids, text

    def _trajectory(self, req: Request, index: int = -1) -> Trajectory:
        answer, text = self._answer(req)
        return Trajectory(
            index=index,
            req_id=req.req_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=answer,
            text=text,
            completion_reason=req.completion_reason.value if req.completion_reason else None,
            nfe=req.nfe,
            steps=req.steps,
            num_preemptions=req.num_preemptions,
            error=req.error,
        )

    # ----- offline generation --------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        apply_chat_template: bool = True,
        parse_special_tokens: bool = False,
    ) -> GenerationOutputs:
        """Generate for every prompt; a rejected prompt gets a trajectory with ``error`` set, the rest run.

        A prompt is text, token ids or a conversation (a list of ``{"role", "content"}`` messages). A chat model
        (its tokenizer has a chat template) is asked the way it was trained: a text prompt becomes the user message
        of its chat template; ``apply_chat_template=False`` sends text as it is. Special-token text inside text and
        messages (``<|im_end|>``) is plain text unless ``parse_special_tokens``: see `diffulex.prompts`.
        """
        self._check_open()
        prompts, params = generation_inputs(prompts, sampling_params)
        t0 = time.perf_counter()
        results: list[Trajectory | None] = [None] * len(prompts)
        index_of: dict[int, int] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            try:
                ids = encode_prompt(
                    self.tokenizer, prompt, mask_token_id=self.mask_token_id, vocab_size=self.vocab_limit,
                    apply_chat_template=apply_chat_template, parse_special_tokens=parse_special_tokens,
                )
                index_of[self.add_request(ids, sp)] = i
            except ValueError as err:
                logger.warning("prompt %d rejected: %s", i, err)
                token_list = isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt)
                ids = list(prompt) if token_list else []
                results[i] = Trajectory(i, -1, ids, [], "", "rejected", 0, error=str(err))
        steps_before = self._num_steps
        bar = None
        if use_tqdm and index_of:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(index_of), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while index_of and any(results[i] is None for i in index_of.values()):
                for update in self.step():
                    if update.finished and update.req_id in index_of:
                        traj = update.trajectory
                        traj.index = index_of[update.req_id]
                        results[traj.index] = traj
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    done_tokens = sum(t.num_generated_tokens for t in results if t is not None)
                    if done_tokens:  # no rate to show before the first request finishes
                        rate = done_tokens / max(time.perf_counter() - t0, 1e-9)
                        bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
        outputs = GenerationOutputs([t for t in results if t is not None], time.perf_counter() - t0,
                                    self._num_steps - steps_before)
        logger.info("generate: %s", outputs.summary())
        return outputs

    # ----- lifetime ------------------------------------------------------------------------------------------

    def exit(self) -> None:
        """Abort what is left and release the KV cache. Safe to call twice."""
        if self._closed:
            return
        while self._in_flight:  # the device may still write into the cache these steps were given
            try:
                self._in_flight.popleft().pending.result()
            except Exception:  # noqa: BLE001  (shutting down: a failed step's result is not needed)
                logger.exception("a step in flight failed during exit()")
        for queue in (self.scheduler.waiting, self.scheduler.running):
            for req in list(queue):
                self.scheduler.finish(req, CompletionReason.ABORTED)
        self.runner.release_kv_cache()
        if getattr(self, "_profiler", None) is not None:
            self._profiler.close()
        self._closed = True

    def __enter__(self) -> DiffulexEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.exit()
