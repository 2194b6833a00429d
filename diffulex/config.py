"""Engine configuration.

Everything the engine needs to know is checked here, before any weight is loaded or any process is spawned,
so that a wrong setting fails in a second with a message that names the field, the value and what is allowed.
Each field carries ``help`` (and, where the set is closed, ``choices``) metadata so that the CLI, the YAML
loader and the HTTP server can all be generated from this one dataclass instead of repeating it.

``__post_init__`` order (later steps rely on earlier ones):

0. the ``plugins`` modules, so that the families and strategies they register count;
1. model directory, ``config.json`` (read once into ``model_config_dict``), tokenizer directory;
2. ``model_name`` (given or inferred) and its `Family`, ``decoding_strategy`` (aliases, family default, the
   family's rules) and its `Strategy`, ``sampling_mode`` (the strategy's variant for it);
3. defaults taken from the checkpoint (``mask_token_id``, ``block_size``), then the checks of single fields;
4. the strategy normalizer (`Strategy.normalize`, ``diffulex/strategy/<name>/``), which may rewrite sizes and flags;
5. checks that span several fields (``block_size <= page_size``, the strategies' options, ``max_model_len`` clamp,
   batch budget);
6. profiler, decoding thresholds.

Model names and strategy names are whatever the registries hold (`diffulex.models.family.FAMILIES`,
`diffulex.strategy.strategy.STRATEGIES`): a family or strategy a plugin registers is valid here like the
package's own. This module imports no engine code.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diffulex.checkpoint_folder import checkpoint_path
from diffulex.models.family import FAMILIES, Family, model_type_to_model_name
from diffulex.models.loader import LOAD_FORMATS
from diffulex.plugins import import_plugins
from diffulex.strategy.dmax import TOKEN_MERGE_MODES
from diffulex.strategy.strategy import STRATEGIES, Strategy
from diffulex.validation import (
    check_bool,
    check_choice,
    check_dir,
    check_int,
    check_nonempty_str,
    check_number,
    format_choices,
    invalid_value,
    is_int,
    reject_unknown_keys,
    shown_value,
    warn,
)

logger = logging.getLogger(__name__)

BLOCK_SIZES = (4, 8, 16, 32)
DEFAULT_BLOCK_SIZE = 32

SAMPLING_MODES = ("naive", "edit")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_LAYOUTS = ("unified", "distinct")
ATTN_IMPLS = ("triton_grouped", "triton", "naive")
# More micro-batches than two buy nothing: one is on the GPU while the host prepares the other.
MAX_MICRO_BATCHES = 2
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MOE_GEMM_IMPLS = ("triton", "vllm", "vllm_modular", "naive")
MOE_DISPATCHER_BACKENDS = ("standard", "naive", "deepep")
DEEPEP_MODES = ("normal", "low_latency", "auto")
DISTRIBUTED_BACKENDS = ("nccl", "gloo")
EXECUTOR_BACKENDS = ("mp", "ray")
PROFILERS = (None, "torch")
# "<run_id>.json" must fit the 255 bytes most file systems allow a file name.
PROFILER_RUN_ID_BYTES = 250


# ----------------------------------------------------------------------------------------------------------
# Validation helpers, shared with SamplingParams and the strategy normalizers so every error reads the same.
# ----------------------------------------------------------------------------------------------------------


# Fields that validate (so that the original's configs load) but that this version does not act on, and why. A
# value other than the default is reported once, when an engine is built (`inert_settings`).
INERT_FIELDS: dict[str, str] = {
    "k_cache_hdim_split_factor_x": "it shapes the 'distinct' KV layout, which is not implemented",
    "enable_vllm_layers": "vLLM is not a dependency; the layers are this package's own",
    "enable_prefill_cudagraph": "a step's prompt rows replay the prefill graphs that max_prefill_graph_tokens sizes",
    "prefill_cudagraph_max_len": "a step's prompt rows replay the prefill graphs that max_prefill_graph_tokens sizes",
    "skip_warmup": "the warm-up always runs: it compiles the kernels so that no step pays a compile",
    "moe_dispatcher_backend": "expert parallelism combines the ranks' experts with one all-reduce, no dispatcher",
    "deepep_mode": "DeepEP is not a dependency; expert parallelism combines the experts with one all-reduce",
    "deepep_num_max_dispatch_tokens_per_rank": "DeepEP is not a dependency; the experts need no dispatch buffer",
    "dmax_force_prefill_active": "a profiling switch of the original; DMax steps run as every other step",
    "enable_vectorized_sampler": "the sampler always handles the whole batch on the device",
    "enable_vectorized_sampler_compile": "the sampler always handles the whole batch on the device",
    "shm_name": "tensor parallelism sends each step to its workers in a gloo broadcast, not through shared memory",
    "remask_threshold": "no sampler re-masks decoded tokens (the original does not read it either)",
}


def inert_settings(config: Config) -> list[str]:
    """One line per field of `INERT_FIELDS` that ``config`` sets to something other than its default, and per LoRA
    field set without ``use_lora`` (the original's YAML files may carry a ``lora_path`` with ``use_lora: false``)."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    defaults.update({f.name: f.default for f in dataclasses.fields(DecodingThresholds)})
    lines = []
    for name, why in INERT_FIELDS.items():
        value, default = getattr(config, name), defaults.get(name, dataclasses.MISSING)
        if default is not dataclasses.MISSING and value != default:
            lines.append(f"{name}={value!r} has no effect in this version of Diffulex: {why}")
    for name in ("lora_path", "pre_merge_lora"):
        if not config.use_lora and getattr(config, name) != defaults[name]:
            lines.append(f"{name}={getattr(config, name)!r} has no effect: use_lora=False loads no adapter; "
                         "use_lora=True applies it")  # fmt: skip
    return lines


def _field(default: Any, help: str, choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None) -> Any:
    """A dataclass field with the metadata the CLI/YAML/HTTP front ends are generated from. ``choices`` is the closed
    set of values, or a function giving it where registrations (plugins included) decide (`field_choices`)."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = choices if callable(choices) else list(choices)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# Old names of engine fields (the original Diffulex's and its benchmark files'), accepted wherever fields are given:
# keyword arguments, YAML files (`diffulex.cli`, `diffulex.bench.config`) and lm-eval's model_args.
FIELD_ALIASES = {
    "diffusion_block_size": "block_size",
    "max_num_seqs": "max_num_reqs",
    "num_kvcache_blocks": "num_pages",
}


def resolve_field_aliases(
    fields: Mapping[str, Any], where: str = "", aliases: Mapping[str, str] = FIELD_ALIASES
) -> dict[str, Any]:
    """``fields`` with each other name of ``aliases`` (`FIELD_ALIASES`) replaced by its field; both names with
    different values are refused (which one was meant is unknowable), both with one value accepted. ``where``
    prefixes the message (a file's name)."""
    out = dict(fields)
    for old, new in aliases.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out and out[new] != value:
            raise ValueError(
                f"{where}{old}={shown_value(value)} conflicts with {new}={shown_value(out[new])}: {old} is another "
                f"name of {new}, give only one"
            )
        out[new] = value
    return out


# ----------------------------------------------------------------------------------------------------------
# Nested settings
# ----------------------------------------------------------------------------------------------------------


@dataclass
class DecodingThresholds:
    """The confidence/progress thresholds of the block decoders, grouped so they travel as one object."""

    add_block_threshold: float = _field(0.1, "Progress of the newest running block that opens the next one.")
    semi_complete_threshold: float = _field(
        0.9, "Progress of the previous block needed before a block may force-accept its best token."
    )
    accept_threshold: float = _field(0.9, "Confidence above which a masked position takes its sampled token.")
    edit_threshold: float = _field(0.0, "Confidence above which a decoded token may be replaced (edit).")
    remask_threshold: float = _field(0.4, "Confidence below which a decoded token is masked again.")
    token_stability_threshold: float = _field(0.0, "Share of stable tokens a DMax edit block needs.")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, check_number(f.name, getattr(self, f.name), 0.0, 1.0))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DecodingThresholds:
        """Build from a YAML/HTTP dict; missing keys keep their defaults, unknown keys are an error."""
        reject_unknown_keys("decoding_thresholds", values, cls.names())
        return cls(**values)


@dataclass
class ProfilerConfig:
    """Torch profiler settings; disabled (``profiler=None``) unless asked for."""

    profiler: str | None = _field(None, "Profiler to run: None (off) or 'torch'.", PROFILERS)
    torch_profiler_dir: str | None = _field(None, "Directory for traces; required with profiler='torch'.")
    record_shapes: bool = _field(False, "Record operator input shapes.")
    profile_memory: bool = _field(False, "Track tensor memory allocation.")
    with_stack: bool = _field(False, "Record Python stacks for operators.")
    with_modules: bool = _field(False, "Record the module hierarchy of operators.")
    use_cuda: bool = _field(True, "Profile CUDA activity as well as CPU activity.")
    delay_iterations: int = _field(0, "Engine steps to skip before the profiler starts.")
    max_iterations: int = _field(0, "Profiled steps before stopping automatically; 0 = until stopped.")
    run_id: str | None = _field(
        None, "Name of the exported files (a plain file name); None = a timestamp and the process id."
    )

    def __post_init__(self) -> None:
        check_choice("profiler_config.profiler", self.profiler, PROFILERS)
        if self.torch_profiler_dir is not None:
            self.torch_profiler_dir = self._check_dir(self.torch_profiler_dir)
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("profiler_config.profiler='torch' requires profiler_config.torch_profiler_dir")
        for name in ("record_shapes", "profile_memory", "with_stack", "with_modules", "use_cuda"):
            check_bool(f"profiler_config.{name}", getattr(self, name))
        check_int("profiler_config.delay_iterations", self.delay_iterations, low=0)
        check_int("profiler_config.max_iterations", self.max_iterations, low=0)
        if self.run_id is not None:
            self._check_run_id(self.run_id)

    @staticmethod
    def _check_dir(value: Any) -> str:
        """The directory as an absolute path: a non-empty str or os.PathLike without NUL that is not an existing
        file. The engine creates it when it is built (`diffulex.engine.step_profiler`)."""
        name = "profiler_config.torch_profiler_dir"
        path = os.fspath(value) if isinstance(value, os.PathLike) else value
        if not isinstance(path, str):
            raise invalid_value(name, value, "must be a path to a directory (a str or os.PathLike of str)")
        if not path:
            raise invalid_value(name, value, "must be a non-empty path to a directory")
        if "\0" in path:
            raise invalid_value(name, path, "must not contain a NUL character")
        path = os.path.abspath(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise invalid_value(name, path, "is an existing file, not a directory")
        return path

    @staticmethod
    def _check_run_id(value: Any) -> None:
        """A plain file name: the trace is ``torch_profiler_dir/<run_id>.json``, never a path outside it."""
        name = "profiler_config.run_id"
        check_nonempty_str(name, value)
        if "\0" in value:
            raise invalid_value(name, value, "must not contain a NUL character")
        if "/" in value or "\\" in value or value in (".", ".."):
            raise invalid_value(name, value, "must be a plain file name: no '/' or '\\', not '.' or '..'")
        if len(value.encode("utf-8", "surrogatepass")) > PROFILER_RUN_ID_BYTES:
            raise invalid_value(name, value, f"must be at most {PROFILER_RUN_ID_BYTES} bytes (a file name's limit)")

    @property
    def enabled(self) -> bool:
        return self.profiler is not None

    @classmethod
    def from_value(cls, value: ProfilerConfig | Mapping[str, Any] | None) -> ProfilerConfig:
        """Accept the object, a dict (unknown keys are an error) or None (profiling off)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            reject_unknown_keys("profiler_config", value, [f.name for f in dataclasses.fields(cls)])
            return cls(**value)
        raise invalid_value("profiler_config", value, "must be a ProfilerConfig, a dict or None")


# ----------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------


def field_choices(f: dataclasses.Field) -> list[Any] | None:
    """The values a field allows, as its metadata states them (asking the registries where they decide)."""
    choices = f.metadata.get("choices")
    return list(choices()) if callable(choices) else choices


def _block_size_choices() -> list[int]:
    """The diffusion block sizes, and the canvas of every family whose model fixes one."""
    canvases = sorted({f.canvas_size for f in FAMILIES.values() if f.canvas_size is not None} - set(BLOCK_SIZES))
    return [*BLOCK_SIZES, *canvases]


@dataclass
class Config:
    """Validated engine settings: ``Config(model, **fields)``. ``docs/configuration.md`` lists every field."""

    model: str = field(metadata={"help": "Local checkpoint directory (must contain config.json)."})
    tokenizer_path: str | None = _field(None, "Tokenizer directory; None = the model directory.")
    model_name: str | None = _field(
        None, "Model family (adapter and sampler); None = inferred from config.json.", FAMILIES.names
    )
    decoding_strategy: str | None = _field(
        None, "Decoding strategy; None = the default of the model family.", STRATEGIES.names
    )
    strategy_options: dict[str, Any] | None = _field(
        None,
        "Options of the decoding strategy (a dict: a plugin strategy's own settings); a key here wins over the engine "
        "field of the same name. Once validated, the strategy's options object.",
    )
    plugins: list[str] = _field(
        [],
        "Python modules to import first, which register strategies or model families (docs/architecture.md); "
        "installed `diffulex.plugins` entry points load anyway.",
    )
    sampling_mode: str = _field(
        "naive", "Sampler behaviour; 'edit' allows token-to-token edits.", SAMPLING_MODES
    )
    mask_token_id: int | None = _field(
        None, "Id of the mask token; None = config.json, else resolved from the tokenizer by the engine."
    )
    dtype: str = _field("auto", "Compute dtype; auto = float32 on CPU, checkpoint dtype on GPU.", DTYPES)
    seed: int = _field(0, "Base random seed for requests that set no seed of their own (and for dummy weights).")
    load_format: str = _field(
        "safetensors",
        "How weights are obtained: 'safetensors' files, or 'dummy' random weights of the checkpoint's shapes "
        "(benchmarks; no weight files needed).",
        LOAD_FORMATS,
    )

    # Parallelism and memory
    tensor_parallel_size: int = _field(1, "GPUs one model replica is split across (1..8).")
    data_parallel_size: int = _field(1, "Independent model replicas (1..1024).")
    distributed_executor_backend: str = _field(
        "mp",
        "Where data-parallel replicas and tensor-parallel workers run: 'mp' = processes on this host, 'ray' = Ray "
        "actors placed on the Ray cluster (RAY_ADDRESS, else a local instance; pip install 'diffulex[ray]').",
        EXECUTOR_BACKENDS,
    )
    expert_parallel_size: int = _field(
        1,
        "GPUs the routed experts of an MoE model are split across (1..8): equal to tensor_parallel_size (the same "
        "ranks), or with tensor_parallel_size=1 (everything else replicated on each).",
    )
    gpu_memory_utilization: float = _field(0.9, "Share of GPU memory the engine may plan to use, in (0, 1].")
    max_model_len: int = _field(2048, "Longest prompt + output; clamped to the checkpoint's position limit.")
    max_num_batched_tokens: int = _field(4096, "Token budget for the prefill requests admitted in one step.")
    max_num_reqs: int = _field(128, "Most requests running at once (and scheduled in one step).")
    enable_chunked_prefill: bool = _field(
        False,
        "Compute a prompt longer than the step's token budget over several steps, one block-aligned chunk per "
        "step, beside the decoding requests (block-causal strategies only; d2f attends the whole prompt).",
    )
    max_prefill_chunk_cost: int = _field(
        0,
        "With enable_chunked_prefill, while other requests decode: the most row equivalents of prompt rows one step "
        "computes, a row after C cached tokens costing 1 + C / C_parity (C_parity: the context at which a row's "
        "attention flops equal its linear flops, from the model's sizes), so a long prompt's chunks shrink as its "
        "context grows. 0 = off (only the token budget and max_prefill_graph_tokens bound a chunk).",
    )
    num_pages: int = _field(
        -1,
        "KV cache pages; <= 0 = max_num_reqs x max_model_len worth, capped by the memory left (GPU: "
        "gpu_memory_utilization after weights and activations; CPU: half the host's available memory).",
    )
    cpu_threads: int | None = _field(
        None,
        "Threads of CPU compute (set process-wide when the engine runs on a CPU); None = OMP_NUM_THREADS if set, "
        "else one per 25M parameters, never more than the cores this process may use (affinity, cgroup quota).",
    )

    # Blocks and KV cache
    block_size: int | None = _field(
        None,
        "Tokens per diffusion block; None = config.json block_size if supported, else the family's default (8 for "
        "Fast-dLLM v2, its sub-block), else 32.",
        _block_size_choices,
    )
    buffer_size: int = _field(4, "Most blocks of one request decoded at the same time.")
    page_size: int = _field(
        32, "Tokens per KV cache page; must be >= block_size.", _block_size_choices
    )
    multi_block_prefix_full: bool | None = _field(
        None, "Prompt attends bidirectionally (d2f); set by the strategy normalizer."
    )
    kv_cache_layout: str = _field("unified", "Physical layout of the KV cache.", KV_CACHE_LAYOUTS)
    attn_impl: str = _field("triton_grouped", "Attention backend.", ATTN_IMPLS)
    k_cache_hdim_split_factor_x: int = _field(8, "Head-dim split of the 'distinct' K layout (power of two).")
    enable_prefix_caching: bool | None = _field(
        None, "Share KV pages of identical prefixes; None = the strategy decides (off for d2f)."
    )

    # Runtime optimizations
    enforce_eager: bool = _field(False, "Disable CUDA graphs and compiled paths (debugging).")
    enable_full_static_runner: bool = _field(True, "Replay decode steps from captured CUDA graphs.")
    enable_torch_compile: bool = _field(True, "Allow torch.compile where the runner supports it.")
    enable_cudagraph_torch_compile: bool = _field(False, "Compile the model forward before graph capture.")
    torch_compile_mode: str = _field("reduce-overhead", "Mode passed to torch.compile.", TORCH_COMPILE_MODES)
    enable_vllm_layers: bool = _field(True, "Use vLLM-backed common layers when vLLM is installed.")
    max_prefill_graph_tokens: int = _field(
        2048,
        "Most store-only prompt rows of one request that a step computes in a captured prefill graph before its "
        "decode graph, or with its first block when it is alone (block-causal strategies); longer ones run the "
        "step eagerly. 0 = off; else >= block_size + 1.",
    )
    enable_prefill_cudagraph: bool = _field(False, "Capture CUDA graphs for prefill steps too.")
    prefill_cudagraph_max_len: int = _field(0, "Longest prefill captured in a CUDA graph (>= 0).")
    skip_warmup: bool = _field(False, "Skip the warmup forward at startup.")
    micro_batches: int = _field(
        1,
        "Interleaved micro-batches of the running requests (1 or 2): with 2 the host finishes and schedules one "
        "while the GPU computes the other.",
    )
    async_scheduling: bool = _field(
        True,
        "With micro_batches=1, queue the next decode step on the GPU before reading this one's result whenever its "
        "rows are already known (greedy, CUDA graphs; edit decoding at buffer_size=1; Fast-dLLM v2's refinements; "
        "DiffusionGemma's denoising steps where no canvas is to end): the host's work between steps leaves the GPU's "
        "critical path. Tokens are the same either way.",
    )
    admission_delay_steps: int = _field(
        4,
        "With steps continued on the GPU (async_scheduling), the most steps a request that could be admitted waits "
        "so that the requests finishing meanwhile are admitted with it: each admission is a step the host plans "
        "while the GPU waits, and under a steady stream of arrivals into a large batch one request finishes at "
        "almost every step. 0 admits at the next step; an idle engine admits at once (>= 0).",
    )
    auto_max_nfe_warmup_steps: int = _field(8, "Warmup term of the automatic max_nfe cap (> 0).")
    auto_max_nfe_tpf_floor: float = _field(1.0, "Tokens-per-forward floor of the automatic max_nfe (> 0).")

    # Token merge (DMax)
    token_merge_mode: str = _field("dmax_topk", "How token-merge candidates are built.", TOKEN_MERGE_MODES)
    token_merge_top_k: int = _field(1, "Candidate tokens kept per position for token merge (1..1024, <= vocabulary).")
    token_merge_renormalize: bool = _field(True, "Renormalize candidate probabilities after filtering.")
    token_merge_weight: float = _field(1.0, "Interpolation weight of token merge (>= 0).")

    # MoE
    moe_gemm_impl: str = _field("triton", "MoE expert GEMM implementation.", MOE_GEMM_IMPLS)
    moe_dispatcher_backend: str = _field("standard", "MoE token dispatcher.", MOE_DISPATCHER_BACKENDS)
    deepep_mode: str = _field("auto", "DeepEP dispatch mode.", DEEPEP_MODES)
    deepep_num_max_dispatch_tokens_per_rank: int = _field(256, "Tokens per rank in DeepEP dispatch (> 0).")

    # DMax / edit sampling
    max_post_edit_steps: int = _field(16, "Edit steps allowed per block after it is filled (0..1024).")
    penalty_lambda: float = _field(0.0, "Edit sampling: lowers the logit of the previous position's token (>= 0).")
    dmax_sampler_fast_path: bool = _field(True, "Fast argmax path for DMax confidences.")
    dmax_force_prefill_active: bool = _field(False, "Keep DMax active blocks on the prefill path.")
    enable_vectorized_sampler: bool = _field(False, "Vectorized greedy sampler for batched mask filling.")
    enable_vectorized_sampler_compile: bool = _field(False, "torch.compile the vectorized sampler step.")

    # Fast-dLLM v2
    fdv2_use_block_cache: bool = _field(
        True, "Reuse KV of refined sub-blocks; False recomputes every sub-block."
    )

    # DiffusionGemma
    diffusion_gemma_max_denoising_steps: int = _field(48, "Denoising steps per canvas at most (1..1024).")
    diffusion_gemma_stability_threshold: int = _field(2, "Equal argmaxes in a row that mean converged (> 0).")
    diffusion_gemma_confidence_threshold: float = _field(0.1, "Mean-entropy bound for convergence (>= 0).")
    diffusion_gemma_t_min: float = _field(0.0, "Lowest temperature of the denoising schedule (0..100).")
    diffusion_gemma_t_max: float = _field(1.0, "Highest (first) temperature of the denoising schedule (0..100).")
    diffusion_gemma_entropy_bound: float = _field(1.0, "Entropy bound for stochastic re-masking (>= 0).")

    # Distributed
    master_addr: str = _field("localhost", "torch.distributed address the tensor-parallel ranks meet at.")
    master_port: int = _field(2333, "torch.distributed port the tensor-parallel ranks meet at (1..65535).")
    distributed_backend: str = _field(
        "nccl", "torch.distributed backend of the collectives on CUDA (the CPU always uses gloo).", DISTRIBUTED_BACKENDS
    )
    distributed_timeout_seconds: int = _field(600, "Timeout of collective operations, in seconds (> 0).")
    device_start: int = _field(0, "First CUDA device index used when device_ids is empty.")
    device_ids: list[int] = _field([], "Logical CUDA device ids, one per rank; empty = from device_start.")
    shm_name: str = _field("diffulex_shm", "Shared-memory segment for rank-0 to worker calls.")

    # LoRA
    use_lora: bool = _field(False, "Load a LoRA adapter.")
    lora_path: str = _field("", "LoRA adapter directory; required with use_lora.")
    pre_merge_lora: bool = _field(False, "Merge the adapter into the base weights before serving.")

    # Profiling and thresholds
    profiler_config: ProfilerConfig | dict | None = _field(
        None, "Profiler settings (ProfilerConfig or dict); None = off."
    )
    decoding_thresholds: DecodingThresholds | dict | None = _field(
        None, "Decoding thresholds (object or dict); flat *_threshold fields override it."
    )
    add_block_threshold: float | None = _field(None, "Overrides decoding_thresholds.add_block_threshold.")
    semi_complete_threshold: float | None = _field(
        None, "Overrides decoding_thresholds.semi_complete_threshold."
    )
    accept_threshold: float | None = _field(None, "Overrides decoding_thresholds.accept_threshold.")
    edit_threshold: float | None = _field(None, "Overrides decoding_thresholds.edit_threshold.")
    remask_threshold: float | None = _field(None, "Overrides decoding_thresholds.remask_threshold.")
    token_stability_threshold: float | None = _field(
        None, "Overrides decoding_thresholds.token_stability_threshold."
    )

    # Derived, not user-settable.
    model_config_dict: dict[str, Any] = field(
        init=False,
        repr=False,
        default_factory=dict,
        metadata={"help": "Raw config.json of the checkpoint.", "internal": True},
    )
    family: Family = field(
        init=False, repr=False, default=None, metadata={"help": "The model family of model_name.", "internal": True}
    )
    strategy: Strategy = field(
        init=False,
        repr=False,
        default=None,
        metadata={"help": "The decoding strategy, in its sampling_mode variant.", "internal": True},
    )

    # ------------------------------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        self._load_plugins()
        self._load_model_dir()
        self._resolve_model_name()
        self._resolve_strategy()
        self._check_sampling_mode()
        self._resolve_checkpoint_defaults()
        self._check_fields()
        self.strategy.normalize(self)
        self._check_after_strategy()
        self._resolve_strategy_options()
        self._clamp_lengths()
        self.profiler_config = ProfilerConfig.from_value(self.profiler_config)
        self._build_thresholds()

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> Config:
        """Build from a loose kwargs dict (Python API, YAML, lm-eval model_args).

        Unknown keys are dropped, but never silently: one warning names all of them, so a typo such as
        ``acept_threshold`` is visible. The old names of `FIELD_ALIASES` are read as their fields.
        """
        kwargs = resolve_field_aliases(kwargs)
        known = {f.name for f in engine_fields()} - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            warn(f"ignoring unknown engine arguments: {', '.join(unknown)}")
        return cls(model, **{k: v for k, v in kwargs.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        """The user-settable fields as plain JSON-able values; ``Config(**to_dict())`` rebuilds the config."""
        out: dict[str, Any] = {}
        for f in engine_fields():
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = dataclasses.asdict(value)
            elif isinstance(value, list):
                value = list(value)
            out[f.name] = value
        return out

    # --- step 0: plugins -----------------------------------------------------------------------------------

    def _load_plugins(self) -> None:
        """Import the user's plugin modules before any name is looked up, so their registrations count."""
        if not isinstance(self.plugins, (list, tuple)) or not all(isinstance(m, str) and m for m in self.plugins):
            raise invalid_value("plugins", self.plugins, "must be a list of module names")
        self.plugins = list(self.plugins)
        import_plugins(self.plugins)

    # --- step 1: model directory ---------------------------------------------------------------------------

    def _load_model_dir(self) -> None:
        self.model = check_dir("model", self.model)
        config_path = checkpoint_path(self.model, "config.json")  # never a link out of the folder
        if not os.path.isfile(config_path):
            raise ValueError(f"model={self.model!r} has no config.json")
        try:
            with open(config_path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"model={self.model!r} has an unreadable config.json: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"model={self.model!r} has a config.json that is not a JSON object")
        self.model_config_dict = data
        self.tokenizer_path = (
            self.model if self.tokenizer_path is None else check_dir("tokenizer_path", self.tokenizer_path)
        )

    def _checkpoint_value(self, key: str) -> Any:
        """A config.json value, from the top level or else from ``text_config`` (multimodal wrappers)."""
        if key in self.model_config_dict:
            return self.model_config_dict[key]
        text_config = self.model_config_dict.get("text_config")
        if isinstance(text_config, dict):
            return text_config.get(key)
        return None

    # --- step 2: model family and strategy -----------------------------------------------------------------

    def _resolve_model_name(self) -> None:
        if self.model_name is None:
            model_type = self.model_config_dict.get("model_type")
            architectures = self.model_config_dict.get("architectures") or []
            name = model_type_to_model_name(
                model_type if isinstance(model_type, str) else None,
                [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else [],
            )
            if name is None:
                raise ValueError(
                    f"model_name could not be inferred from model_type={model_type!r} "
                    f"(architectures={architectures!r}); "
                    f"pass model_name, one of {format_choices(FAMILIES.names())}, or load a plugin that "
                    "registers a family for this model_type (plugins=[MODULE], --plugin MODULE; docs/architecture.md, "
                    "\"Add a model family\")"
                )
            self.model_name = name
        self.family = FAMILIES.get(self.model_name)

    def _resolve_strategy(self) -> None:
        """The strategy asked for (an old spelling warns), else the family's; a family that runs only with some
        strategies gets its default instead of another one; the strategy must accept the family."""
        family, requested = self.family, self.decoding_strategy
        name = family.default_strategy if requested is None else requested
        strategy = STRATEGIES.get(name)
        if strategy.name != name:
            warn(f"decoding_strategy={name!r} is deprecated; use {strategy.name!r}", DeprecationWarning)
        if family.strategies is not None and strategy.name not in family.strategies:
            warn(
                f"decoding_strategy={requested!r} is replaced by {family.default_strategy!r}: "
                f"model_name={self.model_name!r} runs with {' or '.join(map(repr, family.strategies))}"
            )
            strategy = STRATEGIES.get(family.default_strategy)
        strategy.check_family(family)
        self.decoding_strategy = strategy.name
        self.strategy = strategy

    def _check_sampling_mode(self) -> None:
        """The family and the strategy must both support the mode; the strategy may run a variant under it."""
        check_choice("sampling_mode", self.sampling_mode, SAMPLING_MODES)
        modes = self.family.sampling_modes
        if self.sampling_mode not in modes:
            if self.sampling_mode == "edit":
                capable = [name for name in FAMILIES.names() if "edit" in FAMILIES.get(name).sampling_modes]
                requirement = f"requires an edit-capable model_name ({format_choices(capable)})"
            else:
                requirement = f"model_name={self.model_name!r} requires {format_choices(modes)}"
            raise invalid_value("sampling_mode", self.sampling_mode, f"{requirement}, got {self.model_name!r}")
        self.strategy = self.strategy.for_sampling_mode(self.sampling_mode)

    # --- step 3: checkpoint defaults and single-field checks -----------------------------------------------

    def _resolve_checkpoint_defaults(self) -> None:
        if self.mask_token_id is None:
            value = self._checkpoint_value("mask_token_id")
            if is_int(value) and value >= 0:
                self.mask_token_id = value
        else:
            check_int("mask_token_id", self.mask_token_id, low=0)
        if self.block_size is None:
            if self.family.canvas_size is not None:
                self.block_size = self.family.canvas_size
            else:
                value = self.model_config_dict.get("block_size")
                fallback = self.family.default_block_size or DEFAULT_BLOCK_SIZE
                self.block_size = value if is_int(value) and value in BLOCK_SIZES else fallback

    def _allowed_sizes(self) -> tuple[int, ...]:
        canvas = self.family.canvas_size
        return BLOCK_SIZES if canvas is None else (*BLOCK_SIZES, canvas)

    def _check_fields(self) -> None:
        """Type and range of every field that does not depend on the strategy normalizer."""
        # Every bool field must hold a real bool ("false" from YAML/HTTP must not mean True). Annotations are
        # strings in this module (``from __future__ import annotations``), hence the comparison with "bool".
        for f in dataclasses.fields(self):
            if f.type == "bool":
                check_bool(f.name, getattr(self, f.name))
        for name in ("multi_block_prefix_full", "enable_prefix_caching"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))

        check_choice("dtype", self.dtype, DTYPES)
        check_int("seed", self.seed, low=0)
        check_choice("load_format", self.load_format, LOAD_FORMATS)
        check_choice("block_size", self.block_size, self._allowed_sizes())
        check_choice("page_size", self.page_size, self._allowed_sizes())
        check_int("buffer_size", self.buffer_size, low=1)

        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 8)
        check_int("data_parallel_size", self.data_parallel_size, 1, 1024)
        check_choice("distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS)
        check_int("expert_parallel_size", self.expert_parallel_size, 1, 8)
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if ep > 1 and tp > 1 and ep != tp:
            raise invalid_value(
                "expert_parallel_size", ep,
                f"with tensor_parallel_size={tp} must be 1 or {tp} (both groups span the same ranks), or use "
                "tensor_parallel_size=1 to split only the experts",
            )  # fmt: skip
        self.gpu_memory_utilization = check_number(
            "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True
        )
        check_int("max_model_len", self.max_model_len, low=1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        check_int("max_num_reqs", self.max_num_reqs, low=1)
        check_int("max_prefill_chunk_cost", self.max_prefill_chunk_cost, low=0)
        check_int("num_pages", self.num_pages)
        if self.cpu_threads is not None:
            check_int("cpu_threads", self.cpu_threads, low=1)

        check_choice("kv_cache_layout", self.kv_cache_layout, KV_CACHE_LAYOUTS)
        check_choice("attn_impl", self.attn_impl, ATTN_IMPLS)
        x = self.k_cache_hdim_split_factor_x
        if not is_int(x) or x <= 0 or x & (x - 1):
            raise invalid_value("k_cache_hdim_split_factor_x", x, "must be a positive power of two")

        check_choice("torch_compile_mode", self.torch_compile_mode, TORCH_COMPILE_MODES)
        check_int("prefill_cudagraph_max_len", self.prefill_cudagraph_max_len, low=0)
        check_int("max_prefill_graph_tokens", self.max_prefill_graph_tokens, low=0)
        check_int("micro_batches", self.micro_batches, low=1, high=MAX_MICRO_BATCHES)
        check_int("admission_delay_steps", self.admission_delay_steps, low=0)
        check_int("auto_max_nfe_warmup_steps", self.auto_max_nfe_warmup_steps, low=1)
        self.auto_max_nfe_tpf_floor = check_number(
            "auto_max_nfe_tpf_floor", self.auto_max_nfe_tpf_floor, low=0.0, low_open=True
        )


        check_choice("moe_gemm_impl", self.moe_gemm_impl, MOE_GEMM_IMPLS)
        check_choice("moe_dispatcher_backend", self.moe_dispatcher_backend, MOE_DISPATCHER_BACKENDS)
        check_choice("deepep_mode", self.deepep_mode, DEEPEP_MODES)
        check_int(
            "deepep_num_max_dispatch_tokens_per_rank", self.deepep_num_max_dispatch_tokens_per_rank, low=1
        )

        check_nonempty_str("master_addr", self.master_addr)
        check_int("master_port", self.master_port, 1, 65535)
        check_choice("distributed_backend", self.distributed_backend, DISTRIBUTED_BACKENDS)
        check_int("distributed_timeout_seconds", self.distributed_timeout_seconds, low=1)
        check_int("device_start", self.device_start, low=0)
        if not isinstance(self.device_ids, (list, tuple)) or not all(
            is_int(d) and d >= 0 for d in self.device_ids
        ):
            raise invalid_value("device_ids", self.device_ids, "must be a list of non-negative integers")
        self.device_ids = list(self.device_ids)
        check_nonempty_str("shm_name", self.shm_name)

        if not isinstance(self.lora_path, str):
            raise invalid_value("lora_path", self.lora_path, "must be a directory path string")
        if self.use_lora and not self.lora_path:
            raise ValueError("use_lora=True requires lora_path")
        if self.lora_path:
            check_dir("lora_path", self.lora_path)

    # --- step 5: checks after the strategy normalizer ------------------------------------------------------

    def _check_after_strategy(self) -> None:
        """The normalizer may have rewritten sizes, flags and DiffusionGemma settings: check the results."""
        check_bool("multi_block_prefix_full", self.multi_block_prefix_full)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_choice("block_size", self.block_size, self._allowed_sizes())
        check_choice("page_size", self.page_size, self._allowed_sizes())
        check_int("buffer_size", self.buffer_size, low=1)
        if self.block_size > self.page_size:
            raise invalid_value("block_size", self.block_size, f"must be <= page_size={self.page_size}")
        least = self.block_size + 1  # one prompt block, and the cached row before it that a shifted family recomputes
        if 0 < self.max_prefill_graph_tokens < least:
            raise invalid_value(
                "max_prefill_graph_tokens",
                self.max_prefill_graph_tokens,
                f"must be 0 (no prefill graphs) or >= block_size + 1 = {least} (one prompt block per replay)",
            )

    def _resolve_strategy_options(self) -> None:
        """The strategy's options object (from ``strategy_options`` and the engine fields of its options' names).
        The engine fields that other strategies own are checked too: a bad value is an error whatever the strategy."""
        chosen = self.strategy
        self.strategy_options = chosen.options(self, self.strategy_options)
        for other in STRATEGIES.values():
            if type(other).Options is not type(chosen).Options:
                other.options(self)

    def _clamp_lengths(self) -> None:
        """Never plan for more positions than the checkpoint was trained with. A request's last block is computed
        whole (its positions past max_model_len are dropped after), so the block that holds the last position must
        end within the checkpoint's limit too: a limit that is not a whole number of blocks is rounded down."""
        for key in ("max_position_embeddings", "max_sequence_length"):
            limit = self._checkpoint_value(key)
            if is_int(limit) and limit > 0:
                whole_blocks = limit - limit % self.block_size
                last_block_end = -(-self.max_model_len // self.block_size) * self.block_size
                if last_block_end > limit:
                    if whole_blocks == 0:
                        raise invalid_value(
                            "block_size", self.block_size, f"must be <= the checkpoint's {key}={limit}"
                        )
                    reach = (
                        "exceeds"
                        if self.max_model_len > limit
                        else f"ends in a block of block_size={self.block_size} that reaches past"
                    )
                    whole = "" if whole_blocks == limit else f" (whole blocks of block_size={self.block_size})"
                    warn(
                        f"max_model_len={self.max_model_len} {reach} the checkpoint's {key}={limit}; "
                        f"using {whole_blocks}{whole}"
                    )
                    self.max_model_len = whole_blocks
                break
        if self.enable_chunked_prefill:
            self._check_chunked_prefill()
        elif self.max_prefill_chunk_cost > 0:
            raise invalid_value(
                "max_prefill_chunk_cost",
                self.max_prefill_chunk_cost,
                "must be 0 without enable_chunked_prefill=True (it sizes the chunks of a chunked prompt)",
            )
        elif self.strategy.budgets_prompt_tokens and self.max_num_batched_tokens < self.max_model_len:
            raise invalid_value(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be >= max_model_len={self.max_model_len}",
            )

    def _check_chunked_prefill(self) -> None:
        """A chunk's K/V must be what the whole prompt's forward would store, and a step must fit one block."""
        if self.multi_block_prefix_full:
            raise invalid_value(
                "enable_chunked_prefill",
                True,
                f"strategy {self.strategy.name!r} attends the whole prompt bidirectionally: the K/V of a prompt "
                "chunk would depend on the prompt after it; use a block-causal strategy such as 'multi_bd'",
            )
        request_class = self.strategy.request_class
        if request_class is None or not request_class.supports_prefill_chunks:
            raise invalid_value(
                "enable_chunked_prefill", True, f"strategy {self.strategy.name!r} does not compute prompts in chunks"
            )
        least = self.block_size + 1  # one block, and the cached row before it that a shifted family recomputes
        if self.max_num_batched_tokens < least:
            raise invalid_value(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be >= block_size + 1 = {least} with enable_chunked_prefill (one prompt block per step)",
            )

    # --- step 6: thresholds and environment ----------------------------------------------------------------

    def _build_thresholds(self) -> None:
        """Defaults, then the object/dict, then the flat fields (most specific wins); flat fields mirror."""
        given = self.decoding_thresholds
        if given is None:
            values: dict[str, Any] = {}
        elif isinstance(given, DecodingThresholds):
            values = dataclasses.asdict(given)
        elif isinstance(given, Mapping):
            reject_unknown_keys("decoding_thresholds", given, DecodingThresholds.names())
            values = dict(given)
        else:
            raise invalid_value("decoding_thresholds", given, "must be a DecodingThresholds, a dict or None")
        for name in DecodingThresholds.names():
            flat = getattr(self, name)
            if flat is not None:
                values[name] = flat
        thresholds = DecodingThresholds(**values)
        self.decoding_thresholds = thresholds
        for name in DecodingThresholds.names():
            setattr(self, name, getattr(thresholds, name))


def engine_fields() -> list[dataclasses.Field]:
    """The user-settable Config fields, in declaration order (what a CLI, YAML or HTTP schema exposes)."""
    return [f for f in dataclasses.fields(Config) if f.init and not f.metadata.get("internal")]
