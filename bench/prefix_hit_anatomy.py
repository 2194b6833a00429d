"""Where a prefix-cache hit's time to first token goes, host phase by host phase, and how many steps it takes.

    PYTHONPATH=. python bench/prefix_hit_anatomy.py OUT_DIR                       # GPU: SDAR-1.7B geometry, bf16
    PYTHONPATH=. python bench/prefix_hit_anatomy.py OUT_DIR --model tiny [--graph-path] [--profile]  # CPU

The case is the sweep's prefix hit (`diffulex.bench.sweep_prefill`): a ``--cached``-token prompt is run once (its
pages enter the prefix cache), then the same prompt with a fresh ``--tail`` is timed from a device synchronization
and ``add_request`` to the return of the step that accepts its first token. Each timed hit has a tail of its own
(a repeated tail would be a hit too), after one untimed hit that warms the shapes.

Phases are exclusive (a phase nested in another is not counted twice): ``add_request`` (prompt check and
encoding, the request's state), the prefix lookup (the cache's dictionary, page by page), admission (shared
pages, the blocks marked cached, fresh pages), the rest of scheduling, input staging (the flat inputs, then the
tensors or graph buffers and their upload), the forward (its launch on a GPU; on a CPU the computation itself), the
LM head and sampler launch, the wait for the step's result, applying it (tokens, blocks, the pages registered for
the cache) and the step report; ``other`` is the rest of the span (the engine's own loop). A GPU run times each
hit twice: as is (``host``: the forward's device time shows up in the wait), then with the device synchronized
after every phase that queues device work (``synced``: each phase then holds its own device time; the sum is a
little above the real span).

Also: the steps before the first token (rows, whether they replayed graphs), the floor of those steps (the sweep's:
each step's larger floor from measured copy bandwidth and matmul rate) and, with ``--profile``, the functions of
one more hit under cProfile. Writes ``OUT_DIR/prefix_hit_anatomy.json``; fails at once, with the reason, when the
timed request does not hit the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.bench.gpu_profile import (
    kernel_intervals,
    longest_kernels,
    profile_until_the_next_step,
    summarize_activity,
)
from diffulex.bench.hardware import measure_peaks
from diffulex.bench.roofline import cost_model_from_module, step_floors
from diffulex.bench.sweep_prefill import BLOCK_SIZE, _context_before
from diffulex.bench.throughput import _step_work, random_prompts, write_sdar_checkpoint
from diffulex.engine.cuda_graph import DecodeGraphs
from diffulex.sampler.rows import PendingWrites
from diffulex.testing.checkpoints import write_tiny_checkpoint

MODELS = ("sdar-1.7b", "sdar-8b", "tiny")
# rows of one prefill chunk while the CPU caches the prompt: its naive attention holds a [heads, rows, keys] score
# tensor, which a 32k-row forward cannot (the GPU computes the prompt in one forward, as the sweep does)
CPU_CACHING_CHUNK = 1024
SPARE_POSITIONS = 16 * BLOCK_SIZE  # max_model_len past the prompt and its tail, as the sweep leaves


class PhaseClock:
    """Exclusive seconds per phase label, over wrapped callables; nothing is recorded while ``recording`` is off.
    With ``sync_device`` a phase that queues device work waits for it before its clock stops."""

    def __init__(self, sync_device: bool) -> None:
        self.sync_device = sync_device
        self.recording = False
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._nested: list[float] = []
        self._restore: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, label: str, device_work: bool = False) -> None:
        inner = getattr(owner, name)
        own = vars(owner).get(name) if not isinstance(owner, type) else getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.recording:
                return inner(*args, **kwargs)
            self._nested.append(0.0)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if device_work and self.sync_device:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                self.seconds[label] += elapsed - self._nested.pop()
                self.calls[label] += 1
                if self._nested:
                    self._nested[-1] += elapsed

        setattr(owner, name, timed)
        if own is None:
            self._restore.append(lambda: delattr(owner, name))
        else:
            self._restore.append(lambda: setattr(owner, name, own))

    def unwrap(self) -> None:
        while self._restore:
            self._restore.pop()()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class CollectorPauses:
    """The garbage collector's pauses while entered: how many of each generation and their milliseconds (a pause in
    the span is reported by the phase that triggered it; this says how much of it was the collector's)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        key = f"generation {info['generation']}"
        self.ms[key] += 1e3 * (time.perf_counter() - self._started)
        self.count[key] += 1

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict[str, dict[str, float]]:
        return {key: {"count": self.count[key], "ms": self.ms[key]} for key in sorted(self.ms)}


def instrument(engine: Any, clock: PhaseClock) -> None:
    runner, scheduler = engine.runner, engine.scheduler
    kv = scheduler.kv_cache
    clock.wrap(engine, "add_request", "add_request: prompt check (rest of add_request)")
    clock.wrap(engine, "_encode", "add_request: encode")
    clock.wrap(engine, "request_cls", "add_request: request state (tokens, blocks)")
    clock.wrap(kv, "lookup_prefix", "prefix lookup: the cache's dictionary by content key")
    clock.wrap(kv, "admit", "admit: shared pages, blocks marked cached, fresh pages")
    clock.wrap(scheduler, "schedule", "schedule (rest)")
    clock.wrap(runner, "collect", "stage: flat inputs (collect)")
    clock.wrap(runner, "collect_split", "stage: flat inputs (collect)")
    clock.wrap(runner, "_eager_inputs", "stage: tensors / graph buffers", device_work=True)
    clock.wrap(DecodeGraphs, "_fill", "stage: tensors / graph buffers")
    clock.wrap(DecodeGraphs, "_upload", "stage: tensors / graph buffers", device_work=True)
    clock.wrap(runner, "_eager_forward", "forward: eager", device_work=True)
    for graphs in (runner.graphs, runner.short_graphs):
        if graphs is not None:
            clock.wrap(graphs, "_execute", "forward: decode graph (running block, its sampling)", device_work=True)
    if runner.prefill_graphs is not None:
        for graphs in runner.prefill_graphs.graphs.values():
            clock.wrap(graphs, "_execute", "forward: prefill graph (the tail's prompt rows)", device_work=True)
    clock.wrap(runner, "_sample_logits", "LM head + sampler launch", device_work=True)
    clock.wrap(runner.sampler, "launch", "LM head + sampler launch", device_work=True)
    clock.wrap(PendingWrites, "result", "wait for the result")
    clock.wrap(scheduler, "finish_step", "apply: tokens, blocks")
    clock.wrap(kv, "register_cached_pages", "apply: pages registered for the cache")
    clock.wrap(engine, "_report", "report: step records, updates")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _waiting(engine: Any, req_id: int) -> Any:
    return next(r for r in engine.scheduler.waiting if r.req_id == req_id)


def timed_hit(
    engine: Any, prompt: list[int], clock: PhaseClock | None, max_steps: int, around: Any = None
) -> dict[str, Any]:
    """One request, alone in the engine, from ``add_request`` to its first token (as the sweep times it), then run
    to its end untimed. Returns its time to first token, its phases and the steps before the token. ``around``: a
    context manager entered for the timed span only (a profiler)."""
    with around if around is not None else contextlib.nullcontext():
        req, result = _until_first_token(engine, prompt, clock, max_steps)
    while not req.is_finished:
        engine.step()
    return result


def _until_first_token(
    engine: Any, prompt: list[int], clock: PhaseClock | None, max_steps: int
) -> tuple[Any, dict[str, Any]]:
    runner = engine.runner
    if clock is not None:
        clock.reset()
        clock.recording = True
    with CollectorPauses() as pauses:
        _sync(engine.device)
        t0 = time.perf_counter()
        req_id = engine.add_request(prompt, _greedy(BLOCK_SIZE))
        req = _waiting(engine, req_id)
        steps, ttft = [], None
        for _ in range(max_steps):
            before, eager = req.num_cached_tokens, runner.eager_steps
            prefill, graphed = runner.prefill_replays, runner.graph_replays
            step_start = time.perf_counter()
            updates = engine.step()
            step_end = time.perf_counter()
            mine = [u for u in updates if u.req_id == req_id]
            for u in mine:
                if u.record is not None:
                    steps.append({
                        "ms": 1e3 * (step_end - step_start), "rows": u.record.query_len,
                        "new_tokens": u.record.num_new_tokens, "eager_launches": runner.eager_steps - eager,
                        "prefill_replays": runner.prefill_replays - prefill,
                        "graph_replays": runner.graph_replays - graphed,
                        "work": (req, u.record, max(before, _context_before(req, u.record)), req.num_cached_tokens),
                    })
            if any(u.finished or (u.record is not None and u.record.num_new_tokens > 0) for u in mine):
                ttft = step_end - t0
                break
    if clock is not None:
        clock.recording = False
    if ttft is None:
        raise RuntimeError(f"the prefix-hit request had no token after {max_steps} steps")
    _sync(engine.device)  # the next step's launch may have queued device work: a profiler records it too
    phases = {}
    if clock is not None:
        phases = {label: 1e3 * s for label, s in clock.seconds.items()}
        phases["other (engine loop)"] = 1e3 * ttft - sum(phases.values())
    return req, {"ttft_ms": 1e3 * ttft, "phases_ms": phases, "steps": steps, "gc_pauses": pauses.summary(),
                 "cached_at_admission": steps[0]["work"][2] if steps else 0}


def kernel_times(engine: Any, prompt: list[int], max_steps: int, top: int) -> dict[str, Any]:
    """GPU kernel time of one hit's span by category (`diffulex.bench.gpu_profile`) and its longest kernels: what
    the device spends the time to first token on (only the steps before the token: the profile stops before the
    engine launches the next, `profile_until_the_next_step`)."""
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    result = timed_hit(engine, prompt, None, max_steps, around=profile_until_the_next_step(engine, profiler))
    kernels = kernel_intervals(profiler)
    longest = longest_kernels(((k.name, (k.end_us - k.start_us) / 1e3) for k in kernels), top)
    summary = summarize_activity(kernels, result["ttft_ms"] / 1e3, 1)
    return {"ttft_ms_profiled": result["ttft_ms"], "busy_ms": summary["gpu_busy_ms_per_step"],
            "kernel_ms": summary["kernel_ms_per_step"],
            "longest": [{"kernel": name[:120], "calls": calls, "ms": ms} for name, calls, ms in longest]}


def _median_phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    labels = sorted({label for run in runs for label in run["phases_ms"]})
    return {label: statistics.median(run["phases_ms"].get(label, 0.0) for run in runs) for label in labels}


def _floor(engine: Any, steps: list[dict[str, Any]], peaks: Any) -> dict[str, float]:
    cost = cost_model_from_module(engine.model, torch.empty((), dtype=engine.dtype).element_size())
    flops_per_s = peaks.matmul_flops_per_s[str(engine.dtype).removeprefix("torch.")]
    floors = [step_floors(cost, _step_work([s["work"]], BLOCK_SIZE, engine.mask_token_id),
                          peaks.copy_bandwidth_bps, flops_per_s) for s in steps]
    return {"floor_ms": 1e3 * sum(f.bound_s for f in floors),
            "compute_floor_ms": 1e3 * sum(f.compute_s for f in floors),
            "memory_floor_ms": 1e3 * sum(f.memory_s for f in floors)}


def _checkpoint(model: str, folder: Path, max_len: int) -> tuple[Path, str]:
    if model == "tiny":
        return write_tiny_checkpoint(folder, family="sdar", seed=0, max_position_embeddings=max_len), "safetensors"
    return write_sdar_checkpoint(folder, model.removeprefix("sdar-")), "dummy"


def build_engine(model: str, folder: Path, cached: int, tail: int, device: torch.device, graph_path: bool) -> Any:
    """The sweep's prefix-hit engine: ``multi_bd``, block 4, buffer 1, prefix caching, a budget that takes the
    whole prompt in one forward (on a CPU, chunks of `CPU_CACHING_CHUNK`: a hit's tail fits one). On a CPU,
    ``graph_path`` runs the steps through the graphs' static buffers, uncaptured (a GPU captures them)."""
    max_model_len = cached + tail + SPARE_POSITIONS
    path, load_format = _checkpoint(model, folder, max_model_len)
    fields: dict[str, Any] = {"decoding_strategy": "multi_bd", "block_size": BLOCK_SIZE, "buffer_size": 1,
                              "max_model_len": max_model_len, "load_format": load_format, "seed": 0,
                              "max_num_reqs": 4, "enable_prefix_caching": True,
                              "max_num_batched_tokens": max_model_len}
    if device.type != "cuda":
        fields |= {"enable_chunked_prefill": True, "max_num_batched_tokens": CPU_CACHING_CHUNK}
    engine = Diffulex(str(path), **fields)
    if device.type != "cuda" and graph_path:  # the graphs' padded buffers through the eager forward
        engine.enable_static_decode(capture=False)
    return engine


def profile_hit(engine: Any, prompt: list[int], max_steps: int, lines: int) -> str:
    """cProfile's cumulative table of one hit's span (to its first token)."""
    profiler = cProfile.Profile()

    @contextlib.contextmanager
    def profiled() -> Iterator[None]:
        profiler.enable()
        try:
            yield
        finally:
            profiler.disable()

    timed_hit(engine, prompt, None, max_steps, around=profiled())
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(lines)
    return text.getvalue()


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.model != "tiny" and device.type != "cuda":
        raise SystemExit(f"--model {args.model} needs a GPU; on a CPU use --model tiny")
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint folder lives as long as its engine
        started = time.perf_counter()
        engine = build_engine(args.model, Path(tmp) / args.model, args.cached, args.tail, device, args.graph_path)
        build_s = time.perf_counter() - started
        try:
            return measure(engine, args, device, build_s)
        finally:
            engine.exit()


def measure(engine: Any, args: argparse.Namespace, device: torch.device, build_s: float) -> dict[str, Any]:
    """Cache the prompt, time the hits in each mode, then the floor, the kernels (GPU) and the profile."""
    prompt = random_prompts(engine.vocab_limit, engine.mask_token_id, 1, args.cached, 0)[0]
    t0 = time.perf_counter()
    engine.generate([prompt], _greedy(BLOCK_SIZE), use_tqdm=False)
    _sync(engine.device)
    cache_s = time.perf_counter() - t0
    tails = random_prompts(engine.vocab_limit, engine.mask_token_id, 2 * args.repeats + 3, args.tail, 7)
    max_steps = 64
    first = timed_hit(engine, prompt + tails[0], None, max_steps)  # the sweep times a first hit like this
    if first["cached_at_admission"] < args.cached - engine.scheduler.kv_cache.page_size:
        raise SystemExit(f"no prefix-cache hit: {first['cached_at_admission']} of {args.cached} tokens cached")
    modes = ["host", "synced"] if device.type == "cuda" else ["host"]
    result: dict[str, Any] = {
        "model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(engine.dtype).removeprefix("torch."), "cached_tokens": args.cached, "tail_tokens": args.tail,
        "page_size": engine.scheduler.kv_cache.page_size, "build_s": build_s, "cache_the_prompt_s": cache_s,
        "first_hit_ttft_ms": first["ttft_ms"], "modes": {},
    }
    used = 1
    for mode in modes:
        clock = PhaseClock(sync_device=mode == "synced")
        instrument(engine, clock)
        try:
            runs = [timed_hit(engine, prompt + tails[used + i], clock, max_steps) for i in range(args.repeats)]
        finally:
            clock.unwrap()
        used += args.repeats
        missed = [r["cached_at_admission"] for r in runs if r["cached_at_admission"] < first["cached_at_admission"]]
        if missed:
            raise SystemExit(f"a timed request found less of its prefix cached: {missed} tokens")
        median = sorted(runs, key=lambda r: r["ttft_ms"])[len(runs) // 2]
        result["modes"][mode] = {
            "ttft_ms": [r["ttft_ms"] for r in runs], "ttft_median_ms": median["ttft_ms"],
            "gc_pauses": [r["gc_pauses"] for r in runs],
            "phases_median_ms": _median_phases(runs),
            "steps": [{k: v for k, v in s.items() if k != "work"} for s in median["steps"]],
        }
        result["steps_to_first_token"] = len(median["steps"])
        result["rows_computed"] = sum(s["rows"] for s in median["steps"])
        last_steps = median["steps"]
    peaks = measure_peaks(device, [engine.dtype], quick=device.type != "cuda")
    result["peaks"] = peaks.to_dict()
    result |= _floor(engine, last_steps, peaks)
    host_ttft = result["modes"]["host"]["ttft_median_ms"]
    result["ttft_vs_floor"] = host_ttft / result["floor_ms"]
    if device.type == "cuda":
        result["kernels"] = kernel_times(engine, prompt + tails[-2], max_steps, args.profile_lines)
    if args.profile:
        result["profile"] = profile_hit(engine, prompt + tails[-1], max_steps, args.profile_lines)
    return result


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} on {result['device']} ({result['dtype']}): {result['cached_tokens']} cached + "
             f"{result['tail_tokens']} tail tokens, page {result['page_size']}; built in {result['build_s']:.1f} s, "
             f"prompt cached in {result['cache_the_prompt_s']:.1f} s",
             f"first hit TTFT {result['first_hit_ttft_ms']:.2f} ms; {result['steps_to_first_token']} step(s) to the "
             f"first token, {result['rows_computed']} rows computed; floor {result['floor_ms']:.3f} ms (compute "
             f"{result['compute_floor_ms']:.3f}, memory {result['memory_floor_ms']:.3f}); median TTFT "
             f"{result['modes']['host']['ttft_median_ms']:.2f} ms = {result['ttft_vs_floor']:.2f}x the floor"]
    for mode, data in result["modes"].items():
        runs = ", ".join(f"{t:.2f}" for t in data["ttft_ms"])
        lines.append(f"\n[{mode}] TTFT ms: {runs} (median {data['ttft_median_ms']:.2f}); phases, median ms:")
        for label, ms in sorted(data["phases_median_ms"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {ms:9.3f}  {label}")
        pauses = [", ".join(f"{k}: {v['count']} ({v['ms']:.2f} ms)" for k, v in run.items()) or "none"
                  for run in data["gc_pauses"]]
        lines.append(f"  garbage collections in each hit's span: {'; '.join(pauses)}")
        for i, step in enumerate(data["steps"]):
            lines.append(f"  step {i}: {step['ms']:.2f} ms, {step['rows']} rows, {step['new_tokens']} new tokens, "
                         f"eager {step['eager_launches']}, prefill replays {step['prefill_replays']}, decode replays "
                         f"{step['graph_replays']}")
    if "kernels" in result:
        k = result["kernels"]
        parts = ", ".join(f"{name} {ms:.2f}" for name, ms in k["kernel_ms"].items())
        lines.append(f"\n[kernels] one profiled hit: TTFT {k['ttft_ms_profiled']:.2f} ms, GPU busy "
                     f"{k['busy_ms']:.2f} ms; kernel ms by category: {parts}; longest:")
        for row in k["longest"]:
            lines.append(f"  {row['ms']:9.3f}  x{row['calls']:<4d} {row['kernel']}")
    if "profile" in result:
        lines.append("\n" + result["profile"])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    default_model = "sdar-1.7b" if torch.cuda.is_available() else "tiny"
    parser.add_argument("--model", choices=MODELS, default=default_model)
    parser.add_argument("--cached", type=int, default=32000, help="prompt tokens cached before the timed hits")
    parser.add_argument("--tail", type=int, default=256, help="uncached tokens after them")
    parser.add_argument("--repeats", type=int, default=5, help="timed hits per mode")
    parser.add_argument("--graph-path", action="store_true",
                        help="CPU: run the steps through the graphs' static buffers, uncaptured (a GPU always does)")
    parser.add_argument("--profile", action="store_true", help="add cProfile's table of one more hit")
    parser.add_argument("--profile-lines", type=int, default=40)
    args = parser.parse_args()
    if args.cached < 1 or args.tail < 1 or args.repeats < 1:
        parser.error("--cached, --tail and --repeats must be >= 1")
    if torch.cuda.is_available() is False:
        torch.set_num_threads(1)
    result = run(args)
    print(report(result))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "prefix_hit_anatomy.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"wrote {args.out_dir / 'prefix_hit_anatomy.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
