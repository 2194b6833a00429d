"""Engine steps per second alone against under the HTTP server with N streaming clients (CPU; no GPU needed).

    CUDA_VISIBLE_DEVICES= python bench/server_step_rate.py [--clients 64 128] [--step-ms 2] [--seconds 8]
        [--placements thread process] [--json FILE]

Why: on a GPU the engine steps at ~2.7 ms at batch 64 offline, but under the server its streamed chunks came 2.5x
further apart than the steps explain. A step is mostly waiting for the GPU (the GIL released) plus a share of
Python (scheduling, inputs, the sampler's results); a server thread that holds the GIL meanwhile (64-128 streams:
updates, detokenization, JSON, socket writes) delays every point where the engine thread takes the GIL back.
This harness reproduces that on a CPU: a tiny SDAR engine whose model forward is replaced by a ``--step-ms`` sleep
that releases the GIL (the GPU's share of a step) and returns zeros, so the host work is the real engine's. It
prints the engine's steps per second generating a full batch offline, then under the server with ``--clients``
closed-loop streaming clients (their own process, so the load generator does not hold the server's GIL), once
per placement of the engine: ``thread`` (a thread of the server process) and ``process`` (a process of its own,
its updates sent per step over a pipe).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from diffulex import SamplingParams
from diffulex.bench.load import RequestSpec, closed_loop, make_prompt, summarize
from diffulex.testing.checkpoints import write_tiny_checkpoint

PROMPT_WORDS = 24
MAX_TOKENS = 256
SERVER_START_TIMEOUT_S = 120.0
WARMUP_S = 2.0


def engine_fields(clients: int, step_ms: float) -> dict[str, Any]:
    return {"block_size": 4, "page_size": 32, "buffer_size": 1, "max_num_reqs": clients, "max_model_len": 512,
            "max_num_batched_tokens": 8192, "sleeping_forward_ms": step_ms}


def build_sleeping_engine(model: str, kwargs: dict[str, Any]) -> Any:
    """A tiny engine whose forward sleeps (GIL released, like a wait for the GPU) and returns zeros."""
    from diffulex import Diffulex

    kwargs = dict(kwargs)
    sleep_s = kwargs.pop("sleeping_forward_ms") / 1e3
    torch.set_num_threads(1)
    engine = Diffulex(model, **kwargs)
    hidden = engine.runner.token_embedding().embedding_dim

    def forward(ids: torch.Tensor, positions: torch.Tensor, meta: Any, **_: Any) -> torch.Tensor:
        time.sleep(sleep_s)
        return torch.zeros(ids.shape[0], hidden)

    engine.runner.forward = forward
    return engine


def offline_steps_per_s(model: str, fields: dict[str, Any], clients: int, seconds: float) -> float:
    engine = build_sleeping_engine(model, fields)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        def refill() -> None:
            while engine.load().running + engine.load().waiting < clients:
                engine.add_request(make_prompt(engine.num_steps, PROMPT_WORDS), params)

        refill()
        for _ in range(10):
            engine.step()
        start, t0 = engine.num_steps, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            refill()
            engine.step()
        return (engine.num_steps - start) / (time.perf_counter() - t0)
    finally:
        engine.exit()


def _client_process(url: str, clients: int, seconds: float, out: Any) -> None:
    spec = RequestSpec("", MAX_TOKENS, ignore_eos=True)
    samples, elapsed = asyncio.run(closed_loop(
        url, "completions", None, clients, seconds, 10**9,
        lambda i: RequestSpec(make_prompt(i, PROMPT_WORDS), spec.max_tokens, ignore_eos=True), 300.0,
    ))
    out.put(summarize(samples, elapsed))


def task_times(pid: int, tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of one thread, from the kernel's schedstat."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
    except OSError:  # a kernel without scheduler statistics: the steps per second are still measured
        return math.nan, math.nan
    return int(fields[0]) / 1e9, int(fields[1]) / 1e9


def per_step_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], wall_s: float,
                steps: int, sleep_ms: float) -> dict[str, float]:
    """Each watched thread's CPU and run-queue milliseconds per engine step; for the stepping thread also the
    rest of the step's wall time, off a CPU and not runnable, and that less the forward's sleep: what it waited
    for besides the "GPU" (the GIL on a thread of the server; on its own process, the pipe)."""
    out = {}
    for name in after:
        out[f"{name}_cpu"] = 1e3 * (after[name][0] - before[name][0]) / steps
        out[f"{name}_runq"] = 1e3 * (after[name][1] - before[name][1]) / steps
    out["step_wall"] = 1e3 * wall_s / steps
    out["engine_blocked"] = out["step_wall"] - out["engine_cpu"] - out["engine_runq"]
    out["engine_waits_beyond_sleep"] = out["engine_blocked"] - sleep_ms
    return out


def served_steps_per_s(model: str, fields: dict[str, Any], clients: int, seconds: float,
                       placement: str, profile: str | None = None) -> dict[str, Any]:
    import uvicorn

    from diffulex.config import Config
    from diffulex.engine.data_parallel import DataParallelEngine
    from diffulex.server.app import create_app
    from diffulex.server.engine_loop import EngineLoop

    if placement == "process":
        config_fields = {k: v for k, v in fields.items() if k != "sleeping_forward_ms"}
        engine = DataParallelEngine(model, fields, Config.from_kwargs(model, **config_fields),
                                    build_engine=build_sleeping_engine)
    else:
        engine = build_sleeping_engine(model, fields)
    loop = EngineLoop(engine, max_waiting=clients)
    app = create_app(loop, "bench", shutdown_grace_s=5.0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.02)
    context = mp.get_context("spawn")
    results = context.Queue()
    client = context.Process(target=_client_process, args=(url, clients, seconds + 2 * WARMUP_S, results))
    try:
        client.start()
        time.sleep(WARMUP_S)
        here = os.getpid()
        engine_task = (engine.replica_pids[0],) * 2 if placement == "process" else (here, loop._thread.native_id)
        watched = {"engine": engine_task, "engine_loop": (here, loop._thread.native_id),
                   "server": (here, thread.native_id)}
        before = {name: task_times(*task) for name, task in watched.items()}
        profiler = cProfile.Profile()
        if profile:  # cProfile sees the thread that enables it: the server's event loop
            loop._loop.call_soon_threadsafe(profiler.enable)
        start, t0 = engine.num_steps, time.perf_counter()
        time.sleep(seconds)
        wall, steps = time.perf_counter() - t0, engine.num_steps - start
        after = {name: task_times(*task) for name, task in watched.items()}
        if profile:
            loop._loop.call_soon_threadsafe(profiler.disable)
            time.sleep(0.5)
            profiler.dump_stats(profile)
        rate = steps / wall
        load = results.get(timeout=seconds + 120)
        client.join(30)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    per_step = per_step_ms(before, after, wall, steps, fields["sleeping_forward_ms"])
    return {"steps_per_s": rate, "ms_per_step": per_step, "client": {k: load[k] for k in
            ("requests", "errors", "tokens_per_s", "ttft_p50_ms", "chunk_gap_p50_ms", "chunk_gap_p99_ms")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--step-ms", type=float, default=2.0, help="the forward's GIL-free sleep (the GPU's share)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window of each run")
    parser.add_argument("--placements", nargs="+", default=["thread", "process"], choices=["thread", "process"])
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval in this (the server's) process (default: Python's, 5 ms)")
    parser.add_argument("--profile-server", default=None, metavar="FILE",
                        help="cProfile the server's event loop over the window of the last run into FILE")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(Path(tmp) / "tiny", family="sdar", seed=0))
        for clients in args.clients:
            fields = engine_fields(clients, args.step_ms)
            row: dict[str, Any] = {"clients": clients, "step_ms": args.step_ms,
                                   "offline_steps_per_s": offline_steps_per_s(model, fields, clients, args.seconds)}
            print(f"{clients} requests offline: {row['offline_steps_per_s']:.0f} steps/s", flush=True)
            for placement in args.placements:
                served = served_steps_per_s(model, fields, clients, args.seconds, placement, args.profile_server)
                row[placement] = served
                ratio = served["steps_per_s"] / row["offline_steps_per_s"]
                c = served["client"]
                print(f"{clients} streaming clients, engine in a {placement}: {served['steps_per_s']:.0f} steps/s "
                      f"({ratio:.2f}x offline), {c['tokens_per_s']:.0f} tok/s, chunk gap p50/p99 "
                      f"{c['chunk_gap_p50_ms']:.1f}/{c['chunk_gap_p99_ms']:.1f} ms, {c['errors']} errors", flush=True)
                print("   ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in served["ms_per_step"].items()),
                      flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
