"""The ``dp`` target of ``diffulex bench sweep``: data-parallel serving, DP=2 against DP=1 through the HTTP server.

For each data-parallel size (1, then 2) it starts ``diffulex serve`` in a process of its own (SDAR-1.7B geometry,
random weights, ``max_num_reqs`` per replica), waits for ``/health``, and loads it with ``per-replica batch x DP``
closed-loop streaming clients (fixed prompt and answer lengths, ``ignore_eos``), each sending requests back to back
until each has run its shape's ``requests_per_client``, after an untimed warm-up round of one each. Reported per size:
tokens/s (completion tokens over the first send to the last completion), time to first token and the gap between
streamed chunks (inter-token latency; a chunk may carry several tokens of a block), p50 and p99; DP=2's row adds
its tokens/s over DP=1's against `DP_SCALING_TARGET` (the issue's ">= 1.9x").

The server is a separate process because that is what is measured (its replicas are its own processes): the wait
for it to start and every load run stop at once when it exits, and nothing outlasts the target's budget. Its log is
``OUT/dp<N>-server.log``. Not among the sweep's default targets: it needs as many devices as replicas.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from diffulex.bench.sweep_common import (
    SweepContext,
    error_text,
    fmt,
    markdown,
    plot_axes,
    release,
    save_figure,
    skipped,
)
from diffulex.testing.distributed import free_port

DP_SCALING_TARGET = 1.9
DATA_PARALLEL_SIZES = (1, 2)
SERVER_START_TIMEOUT_S = 900.0  # a GPU replica's build: weights, memory profile, CUDA-graph capture
SERVER_STOP_WAIT_S = 30.0
HEALTH_POLL_S = 0.5
WATCH_POLL_S = 0.25  # how often a load run checks that the server still runs and the budget is not spent
REQUEST_TIMEOUT_S = 300.0
LOG_TAIL_LINES = 20

T = TypeVar("T")


@dataclass(frozen=True)
class DataParallelShape:
    model: str
    per_replica: int  # concurrent requests per replica, and each replica's max_num_reqs
    prompt_words: int
    max_tokens: int
    max_model_len: int
    requests_per_client: int  # rounds of the measured load: the first's prefill and the last's drain are in it


def dp_shape(quick: bool) -> DataParallelShape:
    if quick:
        return DataParallelShape("tiny-sdar", per_replica=4, prompt_words=8, max_tokens=16, max_model_len=256,
                                 requests_per_client=2)
    return DataParallelShape("sdar-1.7b", per_replica=64, prompt_words=64, max_tokens=256, max_model_len=1024,
                             requests_per_client=4)


class ServerDiedError(RuntimeError):
    """The measured server's process exited."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def engine_flags(fields: Mapping[str, Any]) -> list[str]:
    """``diffulex serve`` flags setting engine `fields` (booleans as ``--x`` / ``--no-x``, lists as JSON)."""
    flags = []
    for name, value in fields.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list | tuple | dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def serve_command(model: Path, port: int, max_waiting: int, fields: Mapping[str, Any]) -> list[str]:
    """The server's command line: ``diffulex serve`` (as ``python -m diffulex.server``) on 127.0.0.1:`port`."""
    return [sys.executable, "-m", "diffulex.server", "--model", str(model), "--host", "127.0.0.1", "--port",
            str(port), "--max-waiting-requests", str(max_waiting), "--log-level", "warning", *engine_flags(fields)]


def server_log_name(size: int) -> str:
    return f"dp{size}-server.log"


class ServerProcess:
    """``diffulex serve`` started from `command` with its output in `log`, ready once ``/health`` answers 200;
    stopped (SIGTERM, then SIGKILL to its whole process group) on exit."""

    def __init__(self, command: Sequence[str], url: str, log: Path) -> None:
        self.command, self.url, self.log = list(command), url, log
        self.process: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0

    def __enter__(self) -> ServerProcess:
        import diffulex

        package_root = str(Path(diffulex.__file__).resolve().parents[1])  # the server runs this same package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                            if p)}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        return self

    def died(self) -> str | None:
        """Why the server is gone (its exit code and the end of its log), or None while it runs."""
        assert self.process is not None
        code = self.process.poll()
        if code is None:
            return None
        tail = log_tail(self.log)
        last = tail.splitlines()[-1] if tail else "(empty)"
        return f"the server exited with code {code}; its log ({self.log}) ends: {last}\n{tail}"

    def wait_ready(self, timeout_s: float) -> float:
        """Wait for ``/health`` to answer 200; returns the seconds it took. Raises as soon as the server exits,
        or after `timeout_s`."""
        import httpx

        started = time.monotonic()
        while True:
            death = self.died()
            if death is not None:
                raise ServerDiedError(death)
            try:
                if httpx.get(f"{self.url}/health", timeout=HEALTH_POLL_S * 4).status_code == 200:
                    self.started_s = time.monotonic() - started
                    return self.started_s
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"the server did not answer /health within {timeout_s:.0f} s; its log: {self.log}")
            time.sleep(HEALTH_POLL_S)

    def __exit__(self, *exc: object) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)  # a graceful stop: the server ends its replicas
        try:
            process.wait(SERVER_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its session: the replicas too
            process.wait(SERVER_STOP_WAIT_S)


async def while_alive(server: ServerProcess, work: Awaitable[T], deadline: float) -> T:
    """`work`'s result, unless the server exits first (`ServerDiedError`) or `deadline` (``time.monotonic``)
    passes (`TimeoutError`): the work is then cancelled, so a dead server never holds the sweep until the requests'
    own timeouts."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_POLL_S)
            if done:
                return task.result()
            death = server.died()
            if death is not None:
                raise ServerDiedError(death)
            if time.monotonic() > deadline:
                raise TimeoutError("the load did not finish within the target's budget")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def measure_size(ctx: SweepContext, shape: DataParallelShape, size: int) -> dict[str, Any]:
    """One server of `size` replicas, warmed up then loaded with ``per_replica x size`` clients."""
    from diffulex.bench.load import RequestSpec, closed_loop, make_prompt, summarize

    clients = shape.per_replica * size
    requests = shape.requests_per_client * clients
    row: dict[str, Any] = {"model": shape.model, "data_parallel_size": size, "concurrency": clients, "error": None}
    path, load_format = ctx.checkpoint(shape.model)
    fields = ctx.engine_fields({"max_num_reqs": shape.per_replica, "max_model_len": shape.max_model_len,
                                "load_format": load_format, "seed": 0})
    fields["data_parallel_size"] = size
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(ctx.settings.out) / server_log_name(size)
    row["command"] = serve_command(path, port, requests, fields)

    def spec_for(i: int) -> RequestSpec:
        return RequestSpec(make_prompt(i, shape.prompt_words), shape.max_tokens, ignore_eos=True)

    deadline = time.monotonic() + ctx.budget.left
    with ServerProcess(row["command"], url, log) as server:
        row["server_start_s"] = server.wait_ready(min(SERVER_START_TIMEOUT_S, max(ctx.budget.left, 0.0)))
        for count in (clients, requests):  # an untimed warm-up round, then the measured load
            load = closed_loop(url, "completions", None, clients, max(deadline - time.monotonic(), 0.0), count,
                               spec_for, REQUEST_TIMEOUT_S)
            samples, elapsed = asyncio.run(while_alive(server, load, deadline))
    stats = summarize(samples, elapsed)
    row |= {k: stats[k] for k in ("requests", "errors", "elapsed_s", "completion_tokens", "tokens_per_s", "tpf",
                                  "ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms", "latency_p99_ms",
                                  "error_examples")}
    row["itl_p50_ms"], row["itl_p99_ms"] = stats["chunk_gap_p50_ms"], stats["chunk_gap_p99_ms"]
    return row


def devices_missing(ctx: SweepContext, size: int) -> str | None:
    """Why `size` replicas cannot get a device each here (None: they can; on the CPU they share it)."""
    import torch

    if ctx.device.type != "cuda" or torch.cuda.device_count() >= size:
        return None
    return f"not run: {size} replicas need {size} CUDA devices and this machine has {torch.cuda.device_count()}"


def run_data_parallel(ctx: SweepContext) -> list[dict[str, Any]]:
    shape = dp_shape(ctx.quick)
    release(ctx.device)  # the servers' replicas share these devices with this process: hold no cached memory
    rows: list[dict[str, Any]] = []
    for size in DATA_PARALLEL_SIZES:
        base = {"model": shape.model, "data_parallel_size": size, "concurrency": shape.per_replica * size}
        missing = devices_missing(ctx, size)
        if missing is not None:
            rows.append({**base, "error": None, "skipped": missing})
            ctx.log(f"  DP={size}: {missing}")
            continue
        if ctx.budget.spent:
            rows.append(skipped(base))
            continue
        try:
            row = measure_size(ctx, shape, size)
            ctx.log(f"  DP={size}, {row['concurrency']} concurrent: {row['tokens_per_s']:.0f} tok/s, TTFT p50/p99 "
                    f"{fmt(row['ttft_p50_ms'], '.1f')}/{fmt(row['ttft_p99_ms'], '.1f')} ms, ITL p50/p99 "
                    f"{fmt(row['itl_p50_ms'], '.1f')}/{fmt(row['itl_p99_ms'], '.1f')} ms, {row['errors']} errors "
                    f"(server ready in {row['server_start_s']:.1f} s)")
        except Exception as err:
            row = {**base, "error": error_text(err),
                   "server_log_tail": log_tail(Path(ctx.settings.out) / server_log_name(size))}
            ctx.log(f"  DP={size} failed: {row['error']}")
        rows.append(row)
    add_scaling(rows)
    return rows


def add_scaling(rows: list[dict[str, Any]]) -> None:
    """Each measured size's tokens/s over DP=1's, and whether it reaches `DP_SCALING_TARGET` (for DP=2; a size
    N > 2 is held to the same share of linear: N x 0.95) with no failed request."""
    done = {r["data_parallel_size"]: r for r in rows if not r.get("error") and not r.get("skipped")}
    one = done.get(1)
    if one is None or not one["tokens_per_s"]:
        return
    for size, row in done.items():
        if size == 1:
            continue
        row["vs_dp1"] = row["tokens_per_s"] / one["tokens_per_s"]
        target = DP_SCALING_TARGET * size / 2
        row["target_vs_dp1"] = target
        row["met"] = row["vs_dp1"] >= target and not row["errors"] and not one["errors"]


def dp_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ["model", "DP", "concurrent", "requests (errors)", "tok/s", "x DP=1", f">= {DP_SCALING_TARGET}x?",
              "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "server ready s"]
    body = []
    for r in rows:
        if r.get("error") or r.get("skipped"):
            body.append([r["model"], r["data_parallel_size"], r["concurrency"], r.get("error") or r.get("skipped"),
                         *["-"] * 6])
            continue
        body.append([r["model"], r["data_parallel_size"], r["concurrency"], f"{r['requests']} ({r['errors']})",
                     fmt(r["tokens_per_s"], ",.0f"), fmt(r.get("vs_dp1")) if "vs_dp1" in r else "-",
                     ("yes" if r["met"] else "no") if "met" in r else "-",
                     f"{fmt(r['ttft_p50_ms'], '.1f')} / {fmt(r['ttft_p99_ms'], '.1f')}",
                     f"{fmt(r['itl_p50_ms'], '.1f')} / {fmt(r['itl_p99_ms'], '.1f')}", fmt(r["server_start_s"], ".1f")])
    return markdown(header, body)


def plot_dp(rows: Sequence[Mapping[str, Any]], title: str, path: Path) -> None:
    plt, fig, (ax_tps, ax_lat) = plot_axes(2, title)
    done = sorted((r for r in rows if not r.get("error") and not r.get("skipped")),
                  key=lambda r: r["data_parallel_size"])
    x = [r["data_parallel_size"] for r in done]
    ax_tps.bar([str(s) for s in x], [r["tokens_per_s"] for r in done])
    ax_tps.set_ylabel("tokens/s")
    for key, name in [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "ITL p50"),
                      ("itl_p99_ms", "ITL p99")]:
        ax_lat.plot([str(s) for s in x], [r[key] for r in done], marker="o", label=name)
    ax_lat.set_ylabel("ms")
    ax_lat.legend(fontsize=8)
    for ax in (ax_tps, ax_lat):
        ax.set_xlabel("data-parallel replicas")
        ax.grid(True, alpha=0.3)
    save_figure(plt, fig, path)
