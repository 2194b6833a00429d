"""The ``serving`` target of ``diffulex bench sweep``: the HTTP server under open-loop load against offline.

For each concurrency (16, 64, 128 requests; the engine's ``max_num_reqs``) one engine (SDAR-1.7B geometry, random
weights) first generates a fixed mixed set of requests offline (prompt and answer lengths drawn from a few values,
``ignore_eos``): its tokens/s is the offline rate at that batch. The same engine then serves the same requests over
HTTP (`diffulex.bench.load`), the engine rebuilt where the server puts it (a process of its own, as `diffulex
serve` does): streaming completions sent at Poisson arrival times, at `ARRIVAL_RATE_FACTOR` times the offline
request rate, so the server runs as full as the offline batch did and the excess waits in its queue; the clients
run in a process of their own, as real clients would.
Reported: tokens/s online against offline while each held the batch (`saturated_rate`: from the moment every
request slot is taken to the last moment a request is queued; the target's figure), and over the whole run
(completion tokens from the first send to the last completion, offline from the call to its return); time to first
token and the time between streamed chunks, p50 and p99; the steps each run took and their mean time; and the
share of the engine's steps continued on the device (`diffulex.engine.continuation`; requests that arrive at their
own times leave fewer steps a continuation suits all of them than a batch that starts together). Both runs follow
an untimed warm-up.

Why the target reads the saturated window: the whole run also holds the arrivals filling the slots (an open-loop
run starts empty; offline starts full) and the end, where the queue is empty and the batch drains to the longest
answers admitted last, which falls differently for requests that arrived at random times. Neither is the server at
that batch; both are reported beside it.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

ONLINE_VS_OFFLINE_TARGET = 0.9
OCCUPANCY_INTERVAL_S = 0.005  # how often the online run's occupancy is read (a step takes 4-10 ms on a GPU)
ARRIVAL_RATE_FACTOR = 2.0
REQUEST_TIMEOUT_S = 300.0
# Requests sent per unit of concurrency: the batch is held while requests wait, from the slots' filling to the last
# admission; with 2 per slot that lasted about a second online at 128 streams (some 100 steps) and two runs of one
# tree differed by 0.08 in the held-batch ratio (H200, 2026-11-29)
REQUESTS_PER_SLOT = 4


@dataclass(frozen=True)
class ServingShape:
    model: str
    concurrencies: list[int]
    prompt_words: list[int]
    max_tokens: list[int]
    max_model_len: int


def serving_shape(quick: bool) -> ServingShape:
    """The serving target's model, concurrencies and request lengths: tiny ones on the CPU (``--quick``)."""
    if quick:
        return ServingShape("tiny-sdar", [2, 4], [4, 8], [4, 8, 16], max_model_len=256)
    return ServingShape("sdar-1.7b", [16, 64, 128], [32, 64, 128, 256], [32, 64, 128, 256], max_model_len=1024)


def request_mix(shape: ServingShape, count: int, seed: int) -> list[Any]:
    """`count` requests with prompt and answer lengths drawn (seeded) from the shape's values."""
    from diffulex.bench.load import RequestSpec, make_prompt

    draw = random.Random(seed)
    return [RequestSpec(make_prompt(i, draw.choice(shape.prompt_words)), draw.choice(shape.max_tokens),
                        ignore_eos=True) for i in range(count)]


def continued_share(before: Any, after: Any) -> float | None:
    """The share of the steps between two `EngineLoad` readings that the engine continued on the device."""
    steps = after.steps - before.steps
    return (after.continued_steps - before.continued_steps) / steps if steps > 0 else None


def refused_continuations(before: Any, after: Any) -> dict[str, int]:
    """The steps between two `EngineLoad` readings that the host launched itself, by why the device could not
    continue (`diffulex.engine.continuation.ContinuationRefusal`)."""
    counts = {reason: n - before.refused_continuations.get(reason, 0)
              for reason, n in after.refused_continuations.items()}
    return {reason: n for reason, n in sorted(counts.items()) if n}


def continuation_counts(run: str, before: Any, after: Any) -> dict[str, Any]:
    """What the engine's steps between two `EngineLoad` readings were, under ``run``'s keys: how many, how many
    continuations it dropped, the share it continued and the others by reason, and the seconds it waited for the
    device's results (the rest of the span its host worked)."""
    return {f"{run}_steps": after.steps - before.steps,
            f"{run}_device_wait_s": after.device_wait_s - before.device_wait_s,
            f"{run}_dropped_continuations": after.dropped_continuations - before.dropped_continuations,
            f"{run}_continued_share": continued_share(before, after),
            f"{run}_refused_continuations": refused_continuations(before, after)}


def _refusal_text(counts: Mapping[str, int] | None) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in (counts or {}).items()) or "none"


@dataclass(frozen=True)
class Occupancy:
    """The engine at one moment of a run: requests running and queued, and the tokens decoded and steps applied
    since it began."""

    seconds: float
    running: int
    waiting: int
    tokens: int
    steps: int


def saturated_rate(samples: Sequence[Occupancy], concurrency: int) -> dict[str, Any]:
    """Tokens/s while the engine held the batch: from the first sample with every request slot taken to the last
    with a request queued (until then a freed slot has a request to take it, so a slot left empty is the engine's
    own doing), with the window's length, its time-weighted mean of running requests, and its steps' mean time and
    tokens. None where the run has no such window (the queue emptied before the slots filled)."""
    start = next((i for i, s in enumerate(samples) if s.running >= concurrency), None)
    end = max((i for i, s in enumerate(samples) if s.waiting > 0), default=None)
    if start is None or end is None or end <= start or samples[end].seconds <= samples[start].seconds:
        return {"tokens_per_s": None, "seconds": 0.0, "mean_running": None, "ms_per_step": None,
                "tokens_per_step": None}
    window = samples[start : end + 1]
    first, last = window[0], window[-1]
    seconds, tokens, steps = last.seconds - first.seconds, last.tokens - first.tokens, last.steps - first.steps
    held = sum(a.running * (b.seconds - a.seconds) for a, b in itertools.pairwise(window))
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "mean_running": held / seconds,
            "ms_per_step": 1e3 * seconds / steps if steps else None,
            "tokens_per_step": tokens / steps if steps else None}


class OccupancySampler:
    """Reads a server's `diffulex.server.metrics.ServerMetrics.occupancy` every `OCCUPANCY_INTERVAL_S` in a thread of
    its own while the block runs; `samples` then holds what it read."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self.samples: list[Occupancy] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="occupancy-sampler")

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.samples.append(Occupancy(time.monotonic() - t0, *self.metrics.occupancy()))
            self._stop.wait(OCCUPANCY_INTERVAL_S)

    def __enter__(self) -> OccupancySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def offline_rate(engine: Any, specs: Sequence[Any]) -> tuple[dict[str, Any], list[Occupancy]]:
    """The engine's tokens/s and requests/s generating `specs` as one offline batch (every request queued at
    once, then steps until all are finished, as `generate` runs them), and its occupancy after each step."""
    t0 = time.perf_counter()
    for spec in specs:
        engine.add_request(spec.prompt, spec.sampling_params())
    steps = engine.load().steps
    samples = [Occupancy(0.0, 0, len(specs), 0, 0)]
    decoded = tokens = 0
    while not engine.is_finished():
        for update in engine.step():
            decoded += update.record.num_new_tokens if update.record is not None else 0
            tokens += update.trajectory.num_generated_tokens if update.finished else 0
        load = engine.load()
        samples.append(Occupancy(time.perf_counter() - t0, load.running, load.waiting, decoded, load.steps - steps))
    elapsed = time.perf_counter() - t0
    return {"offline_s": elapsed, "offline_tokens": tokens, "offline_tokens_per_s": tokens / elapsed,
            "offline_requests_per_s": len(specs) / elapsed}, samples


def measure_offline(path: str, fields: dict[str, Any], shape: ServingShape, specs: Sequence[Any],
                    concurrency: int) -> dict[str, Any]:
    """`offline_rate` of `specs` after a warm-up batch, on an engine built and closed here (so that nothing of it
    is referenced once this returns), with the share of its steps on the graph path."""
    from diffulex import Diffulex
    from diffulex.bench.throughput import graphed_share, step_paths

    engine = Diffulex(path, **fields)
    try:
        offline_rate(engine, request_mix(shape, concurrency, seed=10_000 + concurrency))  # warm-up
        paths, load = step_paths(engine), engine.load()
        out, samples = offline_rate(engine, specs)
        out["offline_graphed_share"] = graphed_share(paths, step_paths(engine))
        after = engine.load()
        out |= {f"offline_saturated_{k}": v for k, v in saturated_rate(samples, concurrency).items()}
        out |= continuation_counts("offline", load, after)
        return out
    finally:
        engine.exit()


def measure_concurrency(ctx: SweepContext, shape: ServingShape, concurrency: int) -> dict[str, Any]:
    from diffulex.bench.load import InProcessServer, open_loop_in_process, summarize
    from diffulex.bench.throughput import graphed_share, step_paths
    from diffulex.server.engine_placement import build_served_engine

    row: dict[str, Any] = {"model": shape.model, "concurrency": concurrency, "error": None}
    path, load_format = ctx.checkpoint(shape.model)
    fields = ctx.engine_fields({"max_num_reqs": concurrency, "max_model_len": shape.max_model_len,
                                "load_format": load_format, "seed": 0})
    specs = request_mix(shape, REQUESTS_PER_SLOT * concurrency, seed=concurrency)
    row |= measure_offline(str(path), fields, shape, specs, concurrency)
    release(ctx.device)  # the offline engine is gone: the server's engine gets its memory
    rate = ARRIVAL_RATE_FACTOR * row["offline_requests_per_s"]
    row["arrival_rate_per_s"] = rate
    # The server's own placement: the engine in a process of its own where it can be (docs/serving.md).
    engine = build_served_engine(str(path), fields)
    row["engine_placement"] = "process" if hasattr(engine, "replica_pids") else "thread"
    try:
        with InProcessServer(engine=engine, max_waiting=len(specs)) as server:
            open_loop_in_process(server.url, "completions", request_mix(shape, concurrency, seed=1), 100 * rate, 1,
                                 REQUEST_TIMEOUT_S)  # warm-up of the HTTP path and of the engine at this batch
            paths = step_paths(engine) if row["engine_placement"] == "thread" else None
            load = engine.load()
            with OccupancySampler(server.loop.metrics) as sampler:
                samples, elapsed = open_loop_in_process(server.url, "completions", specs, rate, concurrency,
                                                        REQUEST_TIMEOUT_S)
            after = engine.load()
            row |= {f"online_saturated_{k}": v for k, v in saturated_rate(sampler.samples, concurrency).items()}
            row |= continuation_counts("online", load, after)
            # an engine process's step paths stay in that process
            row["online_graphed_share"] = graphed_share(paths, step_paths(engine)) if paths is not None else None
    finally:
        engine.exit()
    stats = summarize(samples, elapsed)
    row |= {f"online_{k}" if k in ("tokens_per_s", "requests_per_s", "elapsed_s") else k: v for k, v in stats.items()}
    row["online_vs_offline"] = row["online_tokens_per_s"] / row["offline_tokens_per_s"]
    online, offline = row["online_saturated_tokens_per_s"], row["offline_saturated_tokens_per_s"]
    row["saturated_online_vs_offline"] = online / offline if online and offline else None
    for run, seconds in (("online", row["online_elapsed_s"]), ("offline", row["offline_s"])):
        steps = row[f"{run}_steps"]
        row[f"{run}_ms_per_step"] = 1e3 * seconds / steps if steps else None
    ratio = row["saturated_online_vs_offline"]
    row["met"] = ratio is not None and ratio >= ONLINE_VS_OFFLINE_TARGET and not stats["errors"]
    return row


def run_serving(ctx: SweepContext) -> list[dict[str, Any]]:
    shape = serving_shape(ctx.quick)
    rows = []
    for concurrency in shape.concurrencies:
        if ctx.budget.spent:
            rows.append(skipped({"model": shape.model, "concurrency": concurrency}))
            continue
        try:
            row = measure_concurrency(ctx, shape, concurrency)
            ctx.log(f"  {concurrency} concurrent: holding the batch online "
                    f"{fmt(row['online_saturated_tokens_per_s'], '.0f')} tok/s vs offline "
                    f"{fmt(row['offline_saturated_tokens_per_s'], '.0f')} "
                    f"({fmt(row['saturated_online_vs_offline'])}x), whole run {row['online_tokens_per_s']:.0f} vs "
                    f"{row['offline_tokens_per_s']:.0f} ({row['online_vs_offline']:.2f}x), steps "
                    f"{row['online_steps']} / {row['offline_steps']} (holding the batch: "
                    f"{fmt(row['online_saturated_ms_per_step'], '.2f')} / "
                    f"{fmt(row['offline_saturated_ms_per_step'], '.2f')} ms, "
                    f"{fmt(row['online_saturated_tokens_per_step'], '.1f')} / "
                    f"{fmt(row['offline_saturated_tokens_per_step'], '.1f')} tokens each), continuations dropped "
                    f"{row['online_dropped_continuations']} / {row['offline_dropped_continuations']}, TTFT p50/p99 "
                    f"{fmt(row['ttft_p50_ms'], '.1f')}/{fmt(row['ttft_p99_ms'], '.1f')} ms, chunk gap p50/p99 "
                    f"{fmt(row['chunk_gap_p50_ms'], '.1f')}/{fmt(row['chunk_gap_p99_ms'], '.1f')} ms, steps "
                    f"continued {fmt(row.get('online_continued_share'), '.0%')}/"
                    f"{fmt(row.get('offline_continued_share'), '.0%')}, {row['errors']} errors; host-launched "
                    f"steps online: {_refusal_text(row.get('online_refused_continuations'))}, offline: "
                    f"{_refusal_text(row.get('offline_refused_continuations'))}")
        except Exception as err:
            row = {"model": shape.model, "concurrency": concurrency, "error": error_text(err)}
            ctx.log(f"  {concurrency} concurrent failed: {row['error']}")
        rows.append(row)
        release(ctx.device)
    return rows


def serving_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ["model", "concurrent", "requests (errors)", "holding the batch: online / offline tok/s (x)",
              ">= 0.9?", "whole run: online / offline tok/s (x)", "steps online / offline (ms each)",
              "TTFT p50 / p99 ms", "chunk gap p50 / p99 ms", "steps graphed online / offline",
              "steps continued online / offline"]
    body = []
    for r in rows:
        if r.get("error") or r.get("skipped"):
            body.append([r["model"], r["concurrency"], r.get("error") or r.get("skipped"), *["-"] * 8])
            continue
        body.append([r["model"], r["concurrency"], f"{r['requests']} ({r['errors']})",
                     f"{fmt(r['online_saturated_tokens_per_s'], ',.0f')} / "
                     f"{fmt(r['offline_saturated_tokens_per_s'], ',.0f')} ({fmt(r['saturated_online_vs_offline'])})",
                     "yes" if r["met"] else "no",
                     f"{fmt(r['online_tokens_per_s'], ',.0f')} / {fmt(r['offline_tokens_per_s'], ',.0f')} "
                     f"({fmt(r['online_vs_offline'])})",
                     f"{r['online_steps']} / {r['offline_steps']} ({fmt(r['online_ms_per_step'], '.1f')} / "
                     f"{fmt(r['offline_ms_per_step'], '.1f')})",
                     f"{fmt(r['ttft_p50_ms'], '.1f')} / {fmt(r['ttft_p99_ms'], '.1f')}",
                     f"{fmt(r['chunk_gap_p50_ms'], '.1f')} / {fmt(r['chunk_gap_p99_ms'], '.1f')}",
                     f"{fmt(r.get('online_graphed_share'), '.0%')} / {fmt(r.get('offline_graphed_share'), '.0%')}",
                     f"{fmt(r.get('online_continued_share'), '.0%')} / "
                     f"{fmt(r.get('offline_continued_share'), '.0%')}"])
    return markdown(header, body)


def plot_serving(rows: Sequence[Mapping[str, Any]], title: str, path: Path) -> None:
    plt, fig, (ax_tps, ax_lat) = plot_axes(2, title)
    done = sorted((r for r in rows if not r.get("error") and not r.get("skipped")), key=lambda r: r["concurrency"])
    x = [r["concurrency"] for r in done]
    for key, marker, style, label in [
        ("online_saturated_tokens_per_s", "o", "-", "online, holding the batch"),
        ("offline_saturated_tokens_per_s", "s", "-", "offline, holding the batch"),
        ("online_tokens_per_s", "o", ":", "online, whole run"),
        ("offline_tokens_per_s", "s", ":", "offline, whole run"),
    ]:
        ax_tps.plot(x, [float("nan") if r[key] is None else r[key] for r in done], marker=marker, linestyle=style,
                    label=label)
    ax_tps.set_ylabel("tokens/s")
    for key, name in [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                      ("chunk_gap_p50_ms", "chunk gap p50"), ("chunk_gap_p99_ms", "chunk gap p99")]:
        ax_lat.plot(x, [r[key] for r in done], marker="o", label=name)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("ms")
    for ax in (ax_tps, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests (max_num_reqs)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(plt, fig, path)
