"""Where a cold prompt's time to first token goes: device time per kernel class against each class's floor.

The sweep's ``prefill`` target (`diffulex.bench.sweep_prefill`) compares a cold prompt's time to first token with
the compute floor of the one step that takes it (the prompt and its first block in one forward, the first token
accepted by that step). That says how far it is, not where. Here the same step runs under ``torch.profiler`` and
its kernels are summed per class, each against the floor of what that class must do:

* ``attention`` (the paged attention and KV-store kernels): the block-causal (query, key) pairs' flops over the
  measured matmul rate;
* ``gemm`` (every linear, the LM head): the linear flops of the step's rows and the LM head's flops of its sampled
  rows over the matmul rate, or the weights' bytes over the copy bandwidth, whichever is longer;
* ``elementwise`` (norms, q/k norm + rotary + KV store, SiLU-and-mul, the embedding gather, PyTorch's elementwise
  and reduction kernels): the activations those kernels read and write once each, as the engine fuses them
  (`activation_elements_per_token`), over the copy bandwidth;
* ``sampling`` (top-1, acceptance, the step advance and result publish): the logits of the sampled rows, read
  once in float32, over the copy bandwidth;
* ``other`` (copies, memsets, anything unmatched): no floor.

The time to first token is also measured without the profiler, the median of `TTFT_REPEATS` prompts of the
length (each with tokens of its own, after a warm-up one); what the kernels do not cover of it is the host's share
(the request's admission, scheduling, the step's metadata, launches) and the gaps between kernels.

On a CPU (``quick``: the tiny SDAR checkpoint, short prompts) the "kernels" are PyTorch's operators by their own
time, classed by name: the PyTorch attention path is matmuls and a softmax there, so the classes only check the
plumbing, not the split.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffulex.bench.gpu_profile import category, longest_kernels, profile_until_the_next_step, union_length
from diffulex.bench.roofline import CostModel, ModelGeometry, StepWork

CLASSES = ("attention", "gemm", "elementwise", "sampling", "other")
MODELS = ("sdar-1.7b", "sdar-8b")
PROMPT_LENS = (2048, 8192, 32000)
QUICK_MODEL = "tiny-sdar"
QUICK_PROMPT_LENS = (32, 64)
TOP_KERNELS = 12  # kernels listed per prompt, by device time
TTFT_REPEATS = 5  # timed prompts per length, unprofiled: the median is the row's time to first token
_TAIL_TOKENS = 256  # room after the longest prompt, as the sweep leaves it

# PyTorch's CPU operators that are matmuls (named as CUDA kernels never are)
_CPU_GEMMS = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|einsum|linear)$")
# the sampler's own kernels beyond `gpu_profile`'s sampler pattern
_SAMPLING = re.compile(r"advance|publish")
_ELEMENTWISE = re.compile(
    r"norm|rope|rotary|silu|gelu|elementwise|reduce|token_inputs|embedding|index|gather|scatter|cat|fill|add|mul|div|"
    r"pow|exp|rsqrt|mean|sum|neg|copy|where|masked|triton_(poi|red|per)_"
)


def kernel_class(name: str) -> str:
    """The class of one kernel (or CPU operator) by its name: one of `CLASSES`."""
    base = category(name)
    lowered = name.lower()
    if base == "attention":
        return "attention"
    if base in ("gemm", "moe") or _CPU_GEMMS.match(lowered):
        return "gemm"
    if base == "sampler" or _SAMPLING.search(lowered):
        return "sampling"
    if base != "copy" and _ELEMENTWISE.search(lowered):
        return "elementwise"
    return "other"


def activation_elements_per_token(geometry: ModelGeometry) -> int:
    """Activation elements the elementwise kernels of one token's forward read and write, each once: per layer
    two residual-add + RMSNorm kernels (read the sum's two inputs, write the sum and the normed rows), the q/k
    norm + rotary + KV store (read q, k, v; write q, k and the cached k, v) and the SiLU-and-mul (read gate and
    up, write their product); per token the embedding row and the final norm."""
    h = geometry.hidden_size
    q, kv = geometry.num_heads * geometry.head_dim, geometry.num_kv_heads * geometry.head_dim
    per_layer = 2 * 4 * h + (2 * q + 5 * kv) + 3 * geometry.intermediate_size
    return geometry.num_layers * per_layer + 2 * h + 4 * h


def class_floors(
    geometry: ModelGeometry, cost: CostModel, work: StepWork, vocab: int, bandwidth_bps: float, flops_per_s: float
) -> dict[str, float]:
    """Seconds each class needs at the least for the step's `work` (see the module docstring); ``other``: 0."""
    linear_flops = 2 * cost.trunk_linear_params * work.query_tokens + 2 * cost.lm_head_params * work.logit_rows
    return {
        "attention": cost.attn_flops_per_pair * work.attn_pairs / flops_per_s,
        "gemm": max(linear_flops / flops_per_s, cost.weight_bytes / bandwidth_bps),
        "elementwise": activation_elements_per_token(geometry) * work.query_tokens * cost.itemsize / bandwidth_bps,
        "sampling": 4 * work.logit_rows * vocab / bandwidth_bps,
        "other": 0.0,
    }


@dataclass(frozen=True)
class KernelTime:
    name: str
    start_us: float
    seconds: float


def profiled_kernels(prof: Any, device: torch.device) -> list[KernelTime]:
    """The kernels of a finished profile on CUDA; on a CPU, PyTorch's operators by their own time."""
    if device.type == "cuda":
        return [
            KernelTime(e.name, e.time_range.start, (e.time_range.end - e.time_range.start) / 1e6)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
        ]
    return [
        KernelTime(e.name, e.time_range.start, e.self_cpu_time_total / 1e6)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")
    ]


def time_by_class(kernels: Sequence[KernelTime]) -> dict[str, dict[str, float]]:
    """Seconds and kernel count of each class."""
    out = {c: {"seconds": 0.0, "kernels": 0} for c in CLASSES}
    for k in kernels:
        row = out[kernel_class(k.name)]
        row["seconds"] += k.seconds
        row["kernels"] += 1
    return out


def top_kernels(kernels: Sequence[KernelTime], count: int = TOP_KERNELS) -> list[dict[str, Any]]:
    longest = longest_kernels(((k.name[:120], k.seconds) for k in kernels), count)
    return [{"name": n, "class": kernel_class(n), "calls": calls, "ms": 1e3 * s} for n, calls, s in longest]


def profile_first_token(engine: Any, prompt: list[int], max_steps: int) -> tuple[dict[str, Any], list[KernelTime]]:
    """One cold prompt's time to first token under the profiler, with only the kernels of the steps before it
    (`diffulex.bench.gpu_profile.profile_until_the_next_step`)."""
    from torch.profiler import ProfilerActivity, profile

    from diffulex.bench.sweep_prefill import BLOCK_SIZE, time_to_first_token

    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    with profile_until_the_next_step(engine, prof) as stop:
        measured = time_to_first_token(engine, prompt, BLOCK_SIZE, max_steps, on_first_token=stop)
    kernels = profiled_kernels(prof, engine.device)
    if engine.device.type == "cuda":
        measured["timeline"] = first_token_timeline(prof, kernels, measured["ttft_s"])
    return measured, kernels


def first_token_timeline(prof: Any, kernels: Sequence[KernelTime], ttft_s: float) -> dict[str, Any]:
    """Where the profiled time to first token's wall time went around its kernels: from the profile's first host
    event (the synchronization before the prompt is added) to the first kernel's start, the kernels' span and the
    idle time inside it, and the rest of the time to first token after the last kernel; with the CUDA runtime
    calls the host made before the first kernel started, each up to that start (what a host-bound start spends its
    time on)."""
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    if not cpu or not kernels:
        return {}
    start = min(e.time_range.start for e in cpu)
    first = min(k.start_us for k in kernels)
    last = max(k.start_us + 1e6 * k.seconds for k in kernels)
    busy = union_length([(k.start_us, k.start_us + 1e6 * k.seconds) for k in kernels]) / 1e3
    calls: dict[str, list[float]] = {}
    for e in cpu:
        if e.name.startswith("cuda") and e.time_range.start < first:
            count_ms = calls.setdefault(e.name, [0, 0.0])
            count_ms[0] += 1
            count_ms[1] += (min(e.time_range.end, first) - e.time_range.start) / 1e3
    before = (first - start) / 1e3
    span = (last - first) / 1e3
    return {
        "before_first_kernel_ms": before, "kernel_span_ms": span, "idle_in_span_ms": span - busy,
        "after_last_kernel_ms": 1e3 * ttft_s - before - span,
        "runtime_calls_before_first_kernel": {
            name: {"calls": n, "ms": ms} for name, (n, ms) in sorted(calls.items(), key=lambda kv: -kv[1][1])
        },
    }  # fmt: skip


def _engine(path: Path, load_format: str, max_model_len: int, fields: Mapping[str, Any] | None = None) -> Any:
    from diffulex import Diffulex
    from diffulex.bench.sweep_prefill import BLOCK_SIZE

    return Diffulex(str(path), decoding_strategy="multi_bd", block_size=BLOCK_SIZE, buffer_size=1,
                    max_model_len=max_model_len, load_format=load_format, seed=0, max_num_reqs=4,
                    max_num_batched_tokens=max_model_len, enable_prefix_caching=True, **(fields or {}))


def anatomy_of_model(
    model: str, prompt_lens: Sequence[int], workdir: Path, peaks: Any, data_dir: str | None = None,
    log: Callable[[str], None] = print, engine_fields: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Each prompt length of one geometry (random weights): warm-up, the time to first token without the
    profiler, then another prompt's under it, its kernels per class against the class floors."""
    from diffulex.bench.hardware import add_matmul_peak
    from diffulex.bench.roofline import cost_model_from_module, step_floors
    from diffulex.bench.sweep_models import write_model
    from diffulex.bench.sweep_prefill import BLOCK_SIZE, _prompt, median_time_to_first_token, time_to_first_token

    path = write_model(model, workdir / model, data_dir)
    load_format = "safetensors" if any(path.glob("*.safetensors")) else "dummy"
    geometry = ModelGeometry.from_config(json.loads((path / "config.json").read_text(encoding="utf-8")))
    engine = _engine(path, load_format, max(prompt_lens) + _TAIL_TOKENS + 16 * BLOCK_SIZE, engine_fields)
    rows: list[dict[str, Any]] = []
    try:
        device = engine.device
        cost = cost_model_from_module(engine.model, torch.empty((), dtype=engine.dtype).element_size())
        flops_per_s = add_matmul_peak(peaks, device, engine.dtype, device.type != "cuda")
        bandwidth = peaks.copy_bandwidth_bps
        max_steps = 64
        for k, n in enumerate(prompt_lens):
            time_to_first_token(engine, _prompt(engine, n, 1000 + k), BLOCK_SIZE, max_steps)  # compiles, warms
            prompts = [_prompt(engine, n, k + 100 * r) for r in range(TTFT_REPEATS)]
            plain, times = median_time_to_first_token(engine, prompts, BLOCK_SIZE, max_steps)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            profiled, kernels = profile_first_token(engine, _prompt(engine, n, 2000 + k), max_steps)
            works = profiled["works"]
            floors: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
            for work in works:
                for name, seconds in class_floors(geometry, cost, work, geometry.vocab_size, bandwidth,
                                                  flops_per_s).items():
                    floors[name] += seconds
            compute_floor_s = sum(step_floors(cost, w, bandwidth, flops_per_s).compute_s for w in works)
            by_class = time_by_class(kernels)
            running = [(k.start_us, k.start_us + 1e6 * k.seconds) for k in kernels if category(k.name) != "copy"]
            busy_s = union_length(running) / 1e6
            classes = {
                name: {"ms": 1e3 * by_class[name]["seconds"], "kernels": by_class[name]["kernels"],
                       "floor_ms": 1e3 * floors[name],
                       "x_floor": by_class[name]["seconds"] / floors[name] if floors[name] > 0 else None}
                for name in CLASSES
            }  # fmt: skip
            row = {
                "model": model, "prompt_len": n, "steps": len(works),
                "query_tokens": sum(w.query_tokens for w in works), "attn_pairs": sum(w.attn_pairs for w in works),
                "ttft_ms": 1e3 * plain["ttft_s"], "ttft_runs_ms": [1e3 * t for t in times],
                "profiled_ttft_ms": 1e3 * profiled["ttft_s"],
                "kernel_ms": 1e3 * sum(k.seconds for k in kernels), "busy_ms": 1e3 * busy_s,
                "classes": classes, "class_floor_ms": 1e3 * sum(floors.values()),
                "compute_floor_ms": 1e3 * compute_floor_s, "top_kernels": top_kernels(kernels),
                "profiled_timeline": profiled.get("timeline", {}),
            }  # fmt: skip
            row["host_and_gaps_ms"] = max(0.0, row["ttft_ms"] - row["busy_ms"])
            row["x_compute_floor"] = row["ttft_ms"] / row["compute_floor_ms"]
            rows.append(row)
            log(format_row(row))
    finally:
        with contextlib.suppress(Exception):
            engine.exit()
    return rows


def format_row(row: dict[str, Any]) -> str:
    lines = [f"{row['model']} prompt {row['prompt_len']}: TTFT {row['ttft_ms']:.2f} ms = "
             f"{row['x_compute_floor']:.2f}x the compute floor {row['compute_floor_ms']:.2f} ms; kernels "
             f"{row['kernel_ms']:.2f} ms (busy {row['busy_ms']:.2f}), host and gaps {row['host_and_gaps_ms']:.2f} ms",
             f"  {'class':12s} {'ms':>10s} {'floor ms':>10s} {'x floor':>8s} {'kernels':>8s}"]  # fmt: skip
    for name, c in row["classes"].items():
        ratio = "-" if c["x_floor"] is None else f"{c['x_floor']:.2f}"
        lines.append(f"  {name:12s} {c['ms']:10.3f} {c['floor_ms']:10.3f} {ratio:>8s} {c['kernels']:8d}")
    timeline = row.get("profiled_timeline") or {}
    if timeline:
        lines.append(f"  profiled: {timeline['before_first_kernel_ms']:.2f} ms to the first kernel, kernels over "
                     f"{timeline['kernel_span_ms']:.2f} ms (idle {timeline['idle_in_span_ms']:.2f}), "
                     f"{timeline['after_last_kernel_ms']:.2f} ms after the last")
        calls = list(timeline["runtime_calls_before_first_kernel"].items())[:6]
        lines += [f"    before the first kernel: {c['ms']:7.3f} ms {c['calls']:5d}x {name}" for name, c in calls]
    lines.append("  top kernels:")
    lines += [f"    {k['ms']:9.3f} ms {k['calls']:5d}x  [{k['class']}] {k['name'][:90]}" for k in row["top_kernels"]]
    return "\n".join(lines)


def run_anatomy(out_dir: Path, quick: bool, models: Sequence[str] | None = None,
                prompt_lens: Sequence[int] | None = None, data_dir: str | None = None,
                log: Callable[[str], None] = print,
                engine_fields: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Every model and prompt length; writes ``out_dir/prefill_anatomy.json`` and returns its content.
    ``engine_fields``: engine fields over the anatomy's own (``max_prefill_graph_tokens``: which prompts replay
    prefill graphs rather than run eagerly)."""
    import tempfile

    from diffulex.bench.hardware import measure_peaks
    from diffulex.bench.sweep_common import release

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = list(models or ([QUICK_MODEL] if quick else MODELS))
    prompt_lens = list(prompt_lens or (QUICK_PROMPT_LENS if quick else PROMPT_LENS))
    t0 = time.perf_counter()
    peaks = measure_peaks(device, [], quick=quick or device.type != "cuda")
    report: dict[str, Any] = {"tool": "prefill_anatomy", "hardware": peaks.to_dict(), "models": models,
                              "prompt_lens": prompt_lens, "engine_fields": dict(engine_fields or {}),
                              "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            report["rows"] += anatomy_of_model(model, prompt_lens, Path(tmp), peaks, data_dir, log, engine_fields)
            release(device)  # the engine's KV cache, before the next one plans its memory
    report["hardware"] = peaks.to_dict()  # with the matmul rates measured on the way
    report["seconds"] = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prefill_anatomy.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report
