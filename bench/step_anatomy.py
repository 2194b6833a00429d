"""Where one decode step's time goes: host phases and GPU kernels, for one model geometry and batch size.

    PYTHONPATH=. python bench/step_anatomy.py --model 1.7b --batch 1 64 --steps 40 [--micro-batches 2] [--out FILE]
    PYTHONPATH=. python bench/step_anatomy.py --model fdv2-7b --strategy fast_dllm_v2 --batch 1 [--block-size 8]
    PYTHONPATH=. python bench/step_anatomy.py --model llada2-mini --batch 1 8
    PYTHONPATH=. python bench/step_anatomy.py --model llada2-mini --batch 32 --sampling-mode edit [--strategy dmax]
    PYTHONPATH=. python bench/step_anatomy.py --model 1.7b --batch 64 --waiting 16 [--buffer-size 4]
    PYTHONPATH=. python bench/step_anatomy.py --model 1.7b --buffer-size 4 --by-predecessor [--attn-impl triton]

``--model`` is an SDAR size (``1.7b``, ``4b``, ``8b``, ``30b-a3b``), ``llada2-mini`` (LLaDA2.0-mini's geometry, blocks
of 32 by default) or ``fdv2-7b``.

``--model fdv2-7b`` is the Fast-dLLM v2 7B geometry (Qwen2.5-7B shapes); with ``--strategy fast_dllm_v2`` its native
strategy (sub-blocks of ``--block-size``, 8 by default there, in blocks of 4 of them), otherwise `multi_bd` on the
same weights, so that the two strategies' steps can be set side by side. ``--strategy`` takes any registered
strategy (the engine checks the name) and ``--sampling-mode`` the engine field (``edit``: LLaDA2.1's edit decoding;
with ``--strategy dmax`` DMax with token merge), so that their steps can be set beside ``multi_bd``'s: the report
says how many steps were continued on the device, and the host phases what the GPU waits for when they are not.

For each batch size it admits the requests, lets them settle into decode, then

* times the host phases of `steps` engine steps (schedule, collect, forward launch/replay, LM head launch,
  sampler launch, the wait for the step's result, finish/bookkeeping; with ``--micro-batches 2`` also the
  launch and completion of each engine step) with `perf_counter` around each phase;
* profiles `steps` more steps and lists the kernels by GPU time per step, with the busy/idle share.
  ``--by-predecessor`` lists each kernel by its name and the kernel that ran before it, which tells a library
  GEMM's projections apart (one cuBLAS kernel often runs several: after attention it is o_proj).

The phase times show what the GPU waits for: everything after a step's result reaches the host (bookkeeping,
the next schedule and collect) up to the next launch is idle GPU time, unless another micro-batch is in flight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import diffulex.sampler.rows as rows
from diffulex import Diffulex
from diffulex.bench.throughput import (
    LLADA2_SIZES,
    _admit_until_decoding,
    _greedy,
    random_prompts,
    write_fast_dllm_v2_checkpoint,
    write_llada2_checkpoint,
    write_sdar_checkpoint,
)
from diffulex.strategy.strategy import STRATEGIES
from diffulex.testing.distributed import free_port

FDV2_MODEL = "fdv2-7b"
FDV2_SUB_BLOCKS = 4  # sub-blocks per block: the checkpoints' blocks of 32 at sub-blocks of 8


def write_model(path: Path, model: str, data_dir: str) -> tuple[Path, int]:
    """The weightless checkpoint folder of ``model`` and its block size by default (the checkpoints' own)."""
    if model == FDV2_MODEL:
        return write_fast_dllm_v2_checkpoint(path, model, data_dir), 8
    if model in LLADA2_SIZES:
        return write_llada2_checkpoint(path, model), 32
    return write_sdar_checkpoint(path, model, data_dir), 4


def _wrap(obj, name: str, phases: dict[str, list[float]], label: str, saved: list) -> None:
    """Time every call of ``obj.name`` into ``phases[label]`` (an instance or a class attribute); `_unwrap`
    restores it."""
    fn = getattr(obj, name)
    saved.append((obj, name, vars(obj).get(name)))

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[label].append(time.perf_counter() - t0)

    setattr(obj, name, timed)


def _unwrap(saved: list) -> None:
    for obj, name, original in reversed(saved):
        if original is None:
            delattr(obj, name)
        else:
            setattr(obj, name, original)


def host_phases(engine, steps: int) -> dict[str, float]:
    """Milliseconds per engine step in each host phase (`_wrap`), and the step's total."""
    phases: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    saved: list = []
    _wrap(engine, "_launch", phases, "launch (all of it)", saved)
    _wrap(engine, "_apply", phases, "apply the result (all of it)", saved)
    _wrap(engine, "_report", phases, "report: records + updates (after the next launch)", saved)
    _wrap(engine.scheduler, "schedule", phases, "schedule", saved)
    _wrap(runner, "collect", phases, "collect", saved)
    if runner.graphs is not None:
        _wrap(runner.graphs, "run", phases, "forward (fill + replay)", saved)
        _wrap(runner.graphs, "_fill", phases, "  of which fill", saved)
    if runner.short_graphs is not None:  # a strategy's short steps (`Strategy.short_step_rows`)
        _wrap(runner.short_graphs, "run", phases, "short forward (fill + replay)", saved)
    _wrap(runner, "forward", phases, "forward (eager)", saved)
    _wrap(runner.model, "compute_logits", phases, "lm head launch", saved)
    _wrap(runner.sampler, "row_layout", phases, "sampler row layout", saved)
    _wrap(runner.sampler, "launch", phases, "sampler launch", saved)
    _wrap(rows.PendingWrites, "result", phases, "wait for the result (+ writes)", saved)
    _wrap(engine.scheduler, "finish_step", phases, "finish_step (all requests)", saved)
    # the GPU's wait between steps: from a result reaching the host to the next replay call
    result_done = [None]
    inner_result = rows.PendingWrites.result

    def result_marked(self, *args, **kwargs):
        try:
            return inner_result(self, *args, **kwargs)
        finally:
            result_done[0] = time.perf_counter()

    rows.PendingWrites.result = result_marked
    marked = [g for g in (runner.graphs, runner.short_graphs) if g is not None]
    inner_runs = [g.run for g in marked]

    def marking(inner_run):
        def run_marked(*args, **kwargs):
            if result_done[0] is not None:
                phases["host path: result -> next forward"].append(time.perf_counter() - result_done[0])
                result_done[0] = None
            return inner_run(*args, **kwargs)

        return run_marked

    for graphs, inner_run in zip(marked, inner_runs, strict=True):
        graphs.run = marking(inner_run)
    totals = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - t0)
    finally:
        rows.PendingWrites.result = inner_result
        for graphs, inner_run in zip(marked, inner_runs, strict=True):
            graphs.run = inner_run
        _unwrap(saved)
    out = {label: 1e3 * sum(v) / steps for label, v in phases.items()}
    out["step total"] = 1e3 * statistics.mean(totals)
    out["step p50"] = 1e3 * statistics.median(totals)
    return out


def sampler_cost(engine, steps: int) -> dict[str, float]:
    """The sampler alone: the device is synchronized before each call, so its time is its own host work plus its
    own kernels (top-1, acceptance, the copies), not the wait for the forward."""
    sampler = engine.runner.sampler
    launch = sampler.launch
    times: list[float] = []

    def timed(logits, work, *layout):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = launch(logits, work, *layout)
        pending.result()
        times.append(time.perf_counter() - t0)
        return pending

    sampler.launch = timed
    try:
        for _ in range(steps):
            engine.step()
    finally:
        del sampler.launch
    if not times:  # every step sampled inside its graph
        return {}
    return {"sampler alone (host + its kernels)": 1e3 * statistics.mean(times)}


def smallest_graph(engine) -> torch.cuda.CUDAGraph | None:
    """The captured forward graph of the smallest batch bucket, or None without graphs."""
    graphs = engine.runner.graphs
    if graphs is None or not graphs._graphs:
        return None
    return graphs._graphs[min(graphs._graphs)]


def replay_cost(engine, calls: int = 20) -> dict[str, float]:
    """Host time of one graph launch (``replay``) and its GPU time, for the smallest captured bucket."""
    graph = smallest_graph(engine)
    if graph is None:
        return {}
    host = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        ts = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - ts)
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        graph.replay()
    end.record()
    end.synchronize()
    return {
        "replay launch (host)": 1e3 * statistics.median(host),
        "replay + sync": 1e3 * total / calls,
        "replay GPU (back to back)": start.elapsed_time(end) / calls,
    }


def kernel_table(engine, steps: int, by_predecessor: bool = False) -> tuple[list[tuple[str, int, float]], float, float]:
    """Kernels by GPU time a step (name, launches a step, us a step), the profiled wall and busy ms a step; with
    ``by_predecessor`` each kernel is listed by its name and the kernel before it (`named_by_predecessor`)."""
    from torch.profiler import ProfilerActivity, profile

    from diffulex.bench.gpu_profile import (
        KernelInterval,
        kernel_intervals,
        longest_kernels,
        named_by_predecessor,
        union_length,
    )

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [KernelInterval(k.name[:90], k.start_us, k.end_us) for k in kernel_intervals(prof)]
    busy = union_length([(k.start_us, k.end_us) for k in kernels]) / 1e6
    if by_predecessor:
        kernels = named_by_predecessor(kernels)
    ranked = longest_kernels(((k.name, k.end_us - k.start_us) for k in kernels), len(kernels))
    rows = [(name, calls / steps, total / steps) for name, calls, total in ranked]
    return rows, 1e3 * wall / steps, 1e3 * busy / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--buffer-size", type=int, default=1)
    ap.add_argument("--strategy", default="multi_bd", help="a registered decoding strategy")
    ap.add_argument("--sampling-mode", default=None, help="the engine field (default: the strategy's)")
    ap.add_argument("--block-size", type=int, default=None, help="default: 4 (SDAR), 32 (llada2-mini), 8 (fdv2-7b)")
    ap.add_argument("--data-dir", default="tests/data/sdar-4b-chat")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks the model is sharded over (one GPU each); the profile is rank 0's")
    ap.add_argument("--waiting", type=int, default=0,
                    help="requests queued beyond the batch, whose slots are all taken (a saturated engine)")
    ap.add_argument("--attn-impl", default=None, help="the engine field (default: the engine's)")
    ap.add_argument("--by-predecessor", action="store_true",
                    help="list each kernel by its name and the kernel before it (which projection a GEMM ran)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.waiting and len(args.batch) > 1:
        ap.error("--waiting queues requests beyond one batch: give one --batch")
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        fdv2 = args.model == FDV2_MODEL
        if args.strategy == "fast_dllm_v2" and not fdv2:
            ap.error(f"--strategy fast_dllm_v2 runs on --model {FDV2_MODEL}")
        path, default_block = write_model(Path(tmp) / args.model, args.model, args.data_dir)
        block_size = args.block_size or default_block
        fields = dict(block_size=block_size, buffer_size=args.buffer_size, max_num_reqs=max(args.batch),
                      max_model_len=1024, load_format="dummy", enable_cudagraph_torch_compile=args.compile,
                      micro_batches=args.micro_batches, decoding_strategy=args.strategy)
        # the strategy's first sampling mode unless one is named (dmax runs only in edit mode)
        fields["sampling_mode"] = args.sampling_mode or STRATEGIES.get(args.strategy).sampling_modes[0]
        if args.strategy == "fast_dllm_v2":
            fields["buffer_size"] = FDV2_SUB_BLOCKS
        if args.attn_impl:
            fields["attn_impl"] = args.attn_impl
        if args.tensor_parallel_size > 1:
            fields |= dict(tensor_parallel_size=args.tensor_parallel_size, master_addr="127.0.0.1",
                           master_port=free_port())
        engine = Diffulex(str(path), **fields)
        for batch in args.batch:
            prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, batch, 128, 0)
            engine.generate(prompts, _greedy(16), use_tqdm=False)
            ids = [engine.add_request(p, _greedy(800)) for p in prompts]
            reqs = [r for r in engine.scheduler.waiting if r.req_id in set(ids)]
            _admit_until_decoding(engine, reqs, 4 * batch + 16)
            # with every slot taken, these wait: the steps measured run saturated (nothing finishes meanwhile)
            extra = random_prompts(engine.vocab_limit, engine.mask_token_id, args.waiting, 128, 1)
            ids += [engine.add_request(p, _greedy(800)) for p in extra]
            for _ in range(5):
                engine.step()
            counters = ("num_steps", "num_continuations", "num_dropped_continuations", "num_opened_blocks")
            counts = [getattr(engine, name) for name in counters]
            phases = host_phases(engine, args.steps)
            if args.tensor_parallel_size == 1:
                # a bare replay outside the engine's steps: with collectives in the graph, rank 0 would wait
                # forever for workers that were never told to follow
                phases.update(replay_cost(engine))
            phases.update(sampler_cost(engine, args.steps))
            rows, wall, busy = kernel_table(engine, args.steps, args.by_predecessor)
            # steps queued on the device before their predecessor's result, of those the ones dropped, and the blocks
            # they opened (a request's next block after the step that stored its last)
            steps, continued, dropped, opened = (
                getattr(engine, name) - before for name, before in zip(counters, counts, strict=True))
            for rid in ids:
                engine.abort_request(rid)
            mode = f" {args.sampling_mode}" if args.sampling_mode else ""
            waiting = f" ({args.waiting} waiting)" if args.waiting else ""
            print(f"\n=== {args.model} {args.strategy}{mode} block {block_size} batch {batch}{waiting} "
                  f"buffer {fields['buffer_size']} compile={args.compile}")
            print("host phases (ms/step):")
            for k, v in phases.items():
                print(f"  {k:32s} {v:8.3f}")
            print(f"profiled: wall {wall:.3f} ms/step, GPU busy {busy:.3f} ms/step ({100 * busy / wall:.0f}%)")
            print(f"continuation steps: {continued} of {steps} steps ({dropped} dropped, {opened} blocks opened)")
            print(f"  {'kernel':90s} {'n/step':>7s} {'us/step':>9s}")
            for name, n, us in rows[: args.top]:
                print(f"  {name:90s} {n:7.1f} {us:9.1f}")
            report.append({"batch": batch, "waiting": args.waiting, "phases": phases, "wall_ms": wall,
                           "busy_ms": busy, "steps": steps, "continued": continued, "dropped": dropped,
                           "opened_blocks": opened,
                           "kernels": [{"name": n, "per_step": c, "us_per_step": u} for n, c, u in rows]})
        engine.exit()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
