"""Engine steps per second alone against under the HTTP server with N streaming clients (CPU; no GPU needed).

    CUDA_VISIBLE_DEVICES= python bench/server_step_rate.py [--clients 64 128] [--step-ms 2] [--seconds 8]
        [--placements thread process] [--profile DIR] [--json FILE]

Why: on a GPU the engine steps at ~2.7 ms at batch 64 offline, but under the server its streamed chunks came 2.5x
further apart than the steps explain. A step is mostly waiting for the GPU (the GIL released) plus a share of
Python (scheduling, inputs, the sampler's results); a server thread that holds the GIL meanwhile (64-128 streams:
updates, detokenization, JSON, socket writes) delays every point where the engine thread takes the GIL back.
This harness reproduces that on a CPU: a tiny SDAR engine whose model forward is replaced by a ``--step-ms`` sleep
that releases the GIL (the GPU's share of a step) and returns zeros, so the host work is the real engine's. It
prints the engine's steps per second generating a full batch offline, then under the server with ``--clients``
closed-loop streaming clients (their own process, so the load generator does not hold the server's GIL), once
per placement of the engine: ``thread`` (a thread of the server process) and ``process`` (a process of its own,
its updates sent per step over a pipe). Per engine step: each party's CPU and run-queue milliseconds (engine,
the server's engine loop thread and event loop, the clients), the engine's waits beyond its sleep, the garbage
collector's share of the server process; per run, each phase's seconds (the window starts once every client has
its stream open, and at its end the clients drop their streams rather than read them out).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import itertools
import json
import logging
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
from diffulex.bench.load import RequestSpec, make_prompt, one_request, served_model, summarize
from diffulex.testing.checkpoints import write_tiny_checkpoint

PROMPT_WORDS = 24
MAX_TOKENS = 256
SERVER_START_TIMEOUT_S = 120.0
WARMUP_S = 2.0  # after every client has its first request in the server
STOP_POLL_S = 0.05


def engine_fields(clients: int, step_ms: float) -> dict[str, Any]:
    return {"block_size": 4, "page_size": 32, "buffer_size": 1, "max_num_reqs": clients, "max_model_len": 512,
            "max_num_batched_tokens": 8192, "sleeping_forward_ms": step_ms}


def build_sleeping_engine(model: str, kwargs: dict[str, Any]) -> Any:
    """A tiny engine whose forward sleeps (GIL released, like a wait for the GPU) and returns zeros. With
    ``profile_engine`` (a path) its thread is profiled from here until ``exit()``, which writes the profile."""
    from diffulex import Diffulex

    kwargs = dict(kwargs)
    sleep_s = kwargs.pop("sleeping_forward_ms") / 1e3
    profile_path = kwargs.pop("profile_engine", None)
    torch.set_num_threads(1)
    engine = Diffulex(model, **kwargs)
    hidden = engine.runner.token_embedding().embedding_dim

    def forward(ids: torch.Tensor, positions: torch.Tensor, meta: Any, **_: Any) -> torch.Tensor:
        time.sleep(sleep_s)
        return torch.zeros(ids.shape[0], hidden)

    engine.runner.forward = forward
    if profile_path:
        profiler = cProfile.Profile()
        close = engine.exit

        def exit_and_save() -> None:
            profiler.disable()
            profiler.dump_stats(profile_path)
            close()

        engine.exit = exit_and_save
        profiler.enable()
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


async def _clients_until(url: str, clients: int, stop: Any) -> tuple[list[Any], float]:
    """``clients`` closed-loop streaming clients until ``stop`` is set; then every request still streaming is dropped
    (its connection closed: the server aborts it) instead of read to its end, which at 128 streams of 256 tokens
    took longer than the measured window. Only requests read to their end are samples."""
    import httpx

    samples = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(300.0)) as http:
        model = await served_model(http)

        async def client(first: int) -> None:
            for i in itertools.count(first, clients):
                spec = RequestSpec(make_prompt(i, PROMPT_WORDS), MAX_TOKENS, ignore_eos=True)
                samples.append(await one_request(http, "completions", model, spec))

        tasks = [asyncio.create_task(client(c)) for c in range(clients)]
        t0 = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(STOP_POLL_S)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return samples, time.perf_counter() - t0


def _client_process(url: str, clients: int, stop: Any, out: Any) -> None:
    samples, elapsed = asyncio.run(_clients_until(url, clients, stop))
    out.put(summarize(samples, elapsed))


def task_times(pid: int, tid: int | None) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for a CPU) of one thread, or with ``tid`` None of all the
    process's threads together, from the kernel's schedstat."""
    if not Path(f"/proc/{pid}/task/{tid or pid}/schedstat").exists():
        return math.nan, math.nan  # a kernel without scheduler statistics: the steps per second are still measured
    tids = [tid] if tid is not None else [t.name for t in Path(f"/proc/{pid}/task").iterdir()]
    cpu = runq = 0.0
    for t in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{t}/schedstat").read_text().split()
        except OSError:  # a thread that ended meanwhile
            continue
        cpu, runq = cpu + int(fields[0]) / 1e9, runq + int(fields[1]) / 1e9
    return cpu, runq


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


class GcPauses:
    """The garbage collector's pauses in this (the server's) process from now until `stop`, which every thread of
    the process waits out: their CPU seconds, and the longest in wall time (a collection preempted by the OS on a
    busy machine lasts longer than its CPU time)."""

    def __init__(self) -> None:
        self.seconds = self.longest = 0.0
        self._started: tuple[float, float] | None = None  # None: no collection seen starting (one under way now)
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = (time.thread_time(), time.perf_counter())
        elif self._started is not None:
            self.seconds += time.thread_time() - self._started[0]
            self.longest = max(self.longest, time.perf_counter() - self._started[1])
            self._started = None

    def stop(self) -> None:
        gc.callbacks.remove(self._observe)


BENCH_FIELDS = ("sleeping_forward_ms", "profile_engine")  # read by `build_sleeping_engine`, not engine fields


def profiled_engine_loop(profiling: threading.Event, profiler: cProfile.Profile) -> type:
    """An `EngineLoop` whose thread profiles its steps into ``profiler`` while ``profiling`` is set (cProfile sees
    only the thread that enables it)."""
    from diffulex.server.engine_loop import EngineLoop

    class ProfiledEngineLoop(EngineLoop):
        _on = False

        def _step(self) -> None:
            if profiling.is_set() != self._on:
                self._on = profiling.is_set()
                profiler.enable() if self._on else profiler.disable()
            super()._step()

    return ProfiledEngineLoop


def served_steps_per_s(model: str, fields: dict[str, Any], clients: int, seconds: float,
                       placement: str, profile_dir: str | None = None) -> dict[str, Any]:
    import uvicorn

    from diffulex.config import Config
    from diffulex.engine.data_parallel import DataParallelEngine
    from diffulex.server.app import create_app

    phases: dict[str, float] = {}
    t_phase = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t_phase
        now = time.perf_counter()
        phases[name] = now - t_phase
        t_phase = now

    prefix = str(Path(profile_dir) / f"{clients}_{placement}_") if profile_dir else None
    if placement == "process":
        config_fields = {k: v for k, v in fields.items() if k not in BENCH_FIELDS}
        replica_fields = {**fields, "profile_engine": prefix + "engine.prof"} if prefix else fields
        engine = DataParallelEngine(model, replica_fields, Config.from_kwargs(model, **config_fields),
                                    build_engine=build_sleeping_engine)
    else:
        engine = build_sleeping_engine(model, fields)
    phase("engine_build_s")
    profiling, loop_profiler = threading.Event(), cProfile.Profile()
    loop = profiled_engine_loop(profiling, loop_profiler)(engine, max_waiting=clients)
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
    phase("server_start_s")
    context = mp.get_context("spawn")
    results, stop = context.Queue(), context.Event()
    client = context.Process(target=_client_process, args=(url, clients, stop, results))
    try:
        client.start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while loop.in_flight < clients:
            if time.monotonic() > deadline or not client.is_alive():
                raise SystemExit(f"the clients did not open {clients} streams within {SERVER_START_TIMEOUT_S:.0f} s "
                                 f"({loop.in_flight} open)")
            time.sleep(STOP_POLL_S)
        phase("clients_start_s")
        time.sleep(WARMUP_S)
        phase("warmup_s")
        here = os.getpid()
        engine_task = (engine.replica_pids[0],) * 2 if placement == "process" else (here, loop._thread.native_id)
        watched = {"engine": engine_task, "engine_loop": (here, loop._thread.native_id),
                   "server": (here, thread.native_id), "clients": (client.pid, None)}
        if placement == "process":  # its stepping thread above; here with the thread that writes its messages
            watched["engine_process"] = (engine.replica_pids[0], None)
        pauses = GcPauses()
        before = {name: task_times(*task) for name, task in watched.items()}
        event_loop_profiler = cProfile.Profile()
        if prefix:  # cProfile sees the thread that enables it: the server's event loop here, the engine loop's own
            loop._loop.call_soon_threadsafe(event_loop_profiler.enable)
            profiling.set()
        start, t0 = engine.num_steps, time.perf_counter()
        time.sleep(seconds)
        wall, steps = time.perf_counter() - t0, engine.num_steps - start
        after = {name: task_times(*task) for name, task in watched.items()}
        pauses.stop()
        if prefix:
            loop._loop.call_soon_threadsafe(event_loop_profiler.disable)
            profiling.clear()
            time.sleep(0.5)
            event_loop_profiler.dump_stats(prefix + "event_loop.prof")
            loop_profiler.dump_stats(prefix + "engine_loop.prof")
        phase("window_s")
        rate = steps / wall
        stop.set()
        load = results.get(timeout=SERVER_START_TIMEOUT_S)
        client.join(30)
        phase("clients_drain_s")
    finally:
        if client.is_alive():
            client.kill()
        server.should_exit = True
        thread.join(30)
        sock.close()
    phase("server_stop_s")
    per_step = per_step_ms(before, after, wall, steps, fields["sleeping_forward_ms"])
    per_step["server_gc"] = 1e3 * pauses.seconds / steps
    per_step["server_gc_longest"] = 1e3 * pauses.longest
    return {"steps_per_s": rate, "ms_per_step": per_step, "phases_s": phases, "client": {k: load[k] for k in
            ("requests", "errors", "tokens_per_s", "ttft_p50_ms", "chunk_gap_p50_ms", "chunk_gap_p99_ms")}}


def _ms(value: float | None) -> str:
    """A latency, or "-" where no request was read to its end within the window."""
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--step-ms", type=float, default=2.0, help="the forward's GIL-free sleep (the GPU's share)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window of each run")
    parser.add_argument("--placements", nargs="+", default=["thread", "process"], choices=["thread", "process"])
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval in this (the server's) process (default: Python's, 5 ms)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="cProfile each run into DIR: the server's event loop and its engine loop thread over the "
                        "measured window, the engine process (placement process) over its whole life")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # the clients close their streams at the window's end; asyncio then logs each write the server had under way
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(Path(tmp) / "tiny", family="sdar", seed=0))
        for clients in args.clients:
            fields = engine_fields(clients, args.step_ms)
            t0 = time.perf_counter()
            row: dict[str, Any] = {"clients": clients, "step_ms": args.step_ms,
                                   "offline_steps_per_s": offline_steps_per_s(model, fields, clients, args.seconds)}
            row["offline_s"] = time.perf_counter() - t0
            print(f"{clients} requests offline: {row['offline_steps_per_s']:.0f} steps/s ({row['offline_s']:.1f} s)",
                  flush=True)
            for placement in args.placements:
                served = served_steps_per_s(model, fields, clients, args.seconds, placement, args.profile)
                row[placement] = served
                ratio = served["steps_per_s"] / row["offline_steps_per_s"]
                c = served["client"]
                print(f"{clients} streaming clients, engine in a {placement}: {served['steps_per_s']:.0f} steps/s "
                      f"({ratio:.2f}x offline), {c['tokens_per_s']:.0f} tok/s, chunk gap p50/p99 "
                      f"{_ms(c['chunk_gap_p50_ms'])}/{_ms(c['chunk_gap_p99_ms'])} ms, {c['errors']} errors", flush=True)
                print("   ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in served["ms_per_step"].items()),
                      flush=True)
                phases = served["phases_s"]
                print("   seconds: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in phases.items()),
                      flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
