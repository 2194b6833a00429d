"""How busy the GPU is during decode steps: kernel time over wall time, from a torch.profiler trace.

A decode step at small batch is short (a millisecond or two), so launch gaps and host work between steps can
leave the GPU idle for a large share of the wall time even when every kernel is fast. The union of the kernel
intervals (overlapping kernels on several streams count once) over the wall time of the profiled steps is the
busy share; one minus it is the idle share, the time the GPU waits for the host between and inside steps.
Memory copies and memsets are reported but not counted as busy: a step that spends its time copying its inputs
from the host is waiting, not computing.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Kernel-name patterns of each category, checked in this order (first match wins); names are lower-cased.
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # the routed experts: the fused MoE kernels (`diffulex.kernels.fused_moe`) and torch's grouped GEMM
    ("moe", re.compile(r"_align_kernel|_gate_up_kernel|_down_kernel|_combine_kernel|grouped|groupproblemshape")),
    ("attention", re.compile(r"attention|attn|flash|fmha|store_kv|kv_store|reshape_and_cache")),
    ("gemm", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|matmul|splitk|skinny")),
    ("sampler", re.compile(r"softmax|top1|topk|argmax|argmin|sort|multinomial|cumsum|accept")),
)
COPY_PREFIXES = ("memcpy", "memset")


@dataclass(frozen=True)
class KernelInterval:
    name: str
    start_us: float
    end_us: float


def category(name: str) -> str:
    """``moe`` (the routed experts' kernels), ``attention``, ``gemm``, ``sampler`` (softmax/top-k/argmax/sort: the
    sampler's kernels, approximately, and a router's top-k),
    ``copy`` (memcpy/memset) or ``other`` (norms, activations, rotary, elementwise glue)."""
    lowered = name.lower()
    if lowered.startswith(COPY_PREFIXES):
        return "copy"
    for label, pattern in CATEGORIES:
        if pattern.search(lowered):
            return label
    return "other"


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize_activity(kernels: Sequence[KernelInterval], wall_s: float, steps: int, top: int = 0) -> dict[str, object]:
    """Busy and idle share of `wall_s`, kernels per step, the kernel time of each category and, with ``top``, the
    ``top`` kernels of most time (per step: calls and milliseconds)."""
    compute = [k for k in kernels if category(k.name) != "copy"]
    busy_s = union_length([(k.start_us, k.end_us) for k in compute]) / 1e6
    by_category: dict[str, float] = {label: 0.0 for label, _ in CATEGORIES} | {"other": 0.0, "copy": 0.0}
    for k in kernels:
        by_category[category(k.name)] += (k.end_us - k.start_us) / 1e3
    summary: dict[str, object] = {
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall_s / steps,
        "gpu_busy_ms_per_step": 1e3 * busy_s / steps,
        "gpu_busy_share": busy_s / wall_s,
        "gpu_idle_share": max(0.0, 1.0 - busy_s / wall_s),
        "kernels_per_step": len(compute) / steps,
        "kernel_ms_per_step": {label: ms / steps for label, ms in by_category.items()},
    }
    if top > 0:
        longest = longest_kernels(((k.name, (k.end_us - k.start_us) / 1e3) for k in kernels), top)
        summary["top_kernels"] = [
            {"kernel": name, "category": category(name), "calls_per_step": calls / steps, "ms_per_step": ms / steps}
            for name, calls, ms in longest
        ]
    return summary


def kernel_intervals(profiler: Any) -> list[KernelInterval]:
    """The device activity of a finished ``torch.profiler.profile``: kernels, copies and memsets (no annotations)."""
    return [
        KernelInterval(e.name, e.time_range.start, e.time_range.end)
        for e in profiler.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
    ]


def named_by_predecessor(kernels: Sequence[KernelInterval], width: int = 60) -> list[KernelInterval]:
    """The kernels, each named ``name (after previous)`` by the kernel that started just before it (the first one
    ``(after nothing)``), names cut to ``width`` characters.

    Why: a library GEMM's name tells its tiles, not which projection ran it, and one kernel often runs several (at
    SDAR-8B batch 32 cuBLAS's 64x64 tiles run both o_proj and down); the kernel before it does tell them apart (after
    attention: o_proj; after the gated gate_up: down)."""
    ordered = sorted(kernels, key=lambda k: (k.start_us, k.end_us))
    named = []
    previous = "nothing"
    for k in ordered:
        short = k.name[:width]
        named.append(KernelInterval(f"{short} (after {previous})", k.start_us, k.end_us))
        previous = short
    return named


def longest_kernels(durations: Iterable[tuple[str, float]], count: int) -> list[tuple[str, int, float]]:
    """The ``count`` names of most total time among ``(name, duration)`` pairs, longest first: ``(name, calls,
    total duration)``."""
    totals: dict[str, list] = {}
    for name, duration in durations:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += duration
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:count]
    return [(name, calls, total) for name, (calls, total) in ranked]


def profile_steps(
    step: Callable[[], object], steps: int, device: torch.device, top: int = 0, time_unprofiled: bool = True
) -> dict[str, object]:
    """Run `step` `steps` times under torch.profiler (CPU + CUDA activity) and summarize the GPU's activity (with
    ``top``, also its ``top`` longest kernels).

    The wall time is taken between two device synchronizations around the loop, so it includes every gap. The
    profiler's own overhead (callbacks on each launch) lengthens the host part, so the idle share under it is an
    overestimate; the same number of steps is therefore also timed without the profiler first, and
    ``gpu_idle_share_unprofiled`` = 1 - profiled kernel time / unprofiled wall time is the estimate without it.
    A workload with only `steps` steps left (requests that finish) passes ``time_unprofiled=False``: the
    unprofiled loop would consume them, and both entries are None.
    """
    from torch.profiler import ProfilerActivity, profile

    def timed_loop() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    plain_wall_s = timed_loop() if time_unprofiled else None
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        wall_s = timed_loop()
    summary = summarize_activity(kernel_intervals(prof), wall_s, steps, top)
    busy_ms = summary["gpu_busy_ms_per_step"]
    if plain_wall_s is None:
        summary["wall_ms_per_step_unprofiled"] = summary["gpu_idle_share_unprofiled"] = None
        return summary
    summary["wall_ms_per_step_unprofiled"] = 1e3 * plain_wall_s / steps
    summary["gpu_idle_share_unprofiled"] = max(0.0, 1.0 - busy_ms * steps / (1e3 * plain_wall_s))
    return summary


def _has_an_answer_token(engine: Any) -> bool:
    """Whether a running request holds a decoded token past its prompt."""
    mask = engine.mask_token_id
    answers = (req.token_ids[req.prompt_len : req.decode_limit] for req in engine.scheduler.running)
    return any(any(token != mask for token in answer) for answer in answers)


@contextlib.contextmanager
def profile_until_the_next_step(engine: Any, profiler: Any) -> Iterator[Callable[[], None]]:
    """Run ``profiler`` (a ``torch.profiler.profile``, started here) over the steps of a request alone in ``engine``
    up to its first token, and no further; yields the function that stops it (also called on leaving).

    The engine applies a step's result and launches the next step before `Engine.step` returns the token, so a
    profile stopped once the token is on the host would also hold the next step's first kernels (a decode step's,
    whose programmatic-dependent-launch waits count as their time). It stops when the engine is about to launch a
    step after the request holds an answer token, once the device has finished the steps before: that one
    synchronization is all it adds to the profiled span."""
    stopped = []

    def stop() -> None:
        if not stopped:
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            profiler.stop()
            stopped.append(True)

    launch = engine._launch

    def launch_after_the_token() -> Any:
        if _has_an_answer_token(engine):
            stop()
        return launch()

    engine._launch = launch_after_the_token
    profiler.start()
    try:
        yield stop
    finally:
        stop()
        del engine._launch  # the instance attribute: the method again
