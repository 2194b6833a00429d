"""``diffulex bench sweep``: the performance targets of the engine measured in one command, each against its floor.

Targets (``--targets``; all but ``dp`` by default): ``batch`` (large-batch decode steps against the step's floor and its
parts), ``prefill`` (time to first token of long prompts against the prompt forward's compute floor, decoders
beside a chunked prefill, a prefix-cache hit), ``strategies`` (every decoding strategy's step time against its
floor and against ``multi_bd``, and whether its steps replayed CUDA graphs), ``moe`` (mixture-of-experts decode
against the floor of the experts the rows select), ``start`` (engine ready time in a fresh process, cold and warm
kernel caches, with the build's phases), ``serving`` (the HTTP server under open-loop Poisson load against the
same engine offline), and, only when named, ``dp`` (``diffulex serve`` with one then two data-parallel replicas under
the same per-replica load: tokens/s of DP=2 over DP=1; it needs two devices).

Every target writes ``DIR/<target>.json`` and ``DIR/<target>.png`` (when matplotlib is installed), and one
markdown table per target goes to ``DIR/tables.md`` in the shape docs/benchmarks.md holds (machine, date,
command). Peaks (copy bandwidth, matmul throughput) are measured once per run, in the same run as the steps they
bound. Each target stops starting new configurations once its budget is spent (``--max-seconds``, or its share of
what is left of ``--total-seconds``); what it skipped is recorded as skipped. ``--quick`` runs every target on
tiny random checkpoints (the CPU path CI checks).

The decode measurements are `diffulex.bench.throughput.measure_decode` (warm-up excluded, region bracketed by
device synchronizations); the floors are `diffulex.bench.roofline`.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffulex.bench.sweep_common import (
    TARGETS,
    Budget,
    SweepContext,
    SweepSettings,
    device_for,
    device_info,
    engine_dtype,
    error_text,
    release,
)

TOOL = "diffulex bench sweep"


@dataclass(frozen=True)
class Target:
    """One target: what it measures (rows), how its rows read as a markdown table, and its plot."""

    run: Callable[[SweepContext], list[dict[str, Any]]]
    table: Callable[[Sequence[Mapping[str, Any]]], str]
    plot: Callable[[Sequence[Mapping[str, Any]], str, Path], None]
    title: str


def _targets() -> dict[str, Target]:
    from diffulex.bench import sweep_data_parallel, sweep_decode, sweep_prefill, sweep_serving, sweep_start

    return {
        "batch": Target(sweep_decode.run_batch, sweep_decode.batch_table, sweep_decode.plot_batch,
                        "Large-batch decode against the step's floor"),
        "prefill": Target(sweep_prefill.run_prefill, sweep_prefill.prefill_table, sweep_prefill.plot_prefill,
                          "Long prompts: time to first token, decoders beside a chunked prefill, prefix-cache hits"),
        "strategies": Target(sweep_decode.run_strategies, sweep_decode.strategies_table,
                             sweep_decode.plot_strategies, "Every strategy against its floor and multi_bd"),
        "moe": Target(sweep_decode.run_moe, sweep_decode.moe_table, sweep_decode.plot_moe,
                      "Mixture-of-experts decode against the selected experts' floor"),
        "start": Target(sweep_start.run_start, sweep_start.start_table, sweep_start.plot_start,
                        "Engine start in a fresh process"),
        "serving": Target(sweep_serving.run_serving, sweep_serving.serving_table, sweep_serving.plot_serving,
                          "The HTTP server under open-loop Poisson load against offline"),
        "dp": Target(sweep_data_parallel.run_data_parallel, sweep_data_parallel.dp_table, sweep_data_parallel.plot_dp,
                     "Data-parallel serving: DP=2 against DP=1 through the HTTP server"),
    }


def run(settings: SweepSettings, log: Callable[[str], None] = print, command: str | None = None) -> dict[str, Any]:
    """Measure the peaks, run each target within its budget, write its JSON, plot and table; returns
    ``{target: report}``."""
    from diffulex.bench.hardware import measure_peaks

    device = device_for(settings.engine_overrides)
    if device.type != "cuda" and not settings.quick:
        raise ValueError(
            "the sweep's geometries (SDAR-1.7B to SDAR-30B-A3B, random weights) need a CUDA device and none is "
            "available: run it on a GPU machine, or pass --quick for tiny checkpoints on this CPU"
        )
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = engine_dtype(device, settings.engine_overrides)
    command = command or shlex.join(["diffulex", *sys.argv[1:]])
    log(f"measuring peaks on {device} ({str(dtype).removeprefix('torch.')}) ...")
    peaks = measure_peaks(device, [dtype], settings.quick)
    log(f"copy bandwidth {peaks.copy_bandwidth_bps / 1e9:.0f} GB/s, matmul "
        + ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in peaks.matmul_flops_per_s.items()))
    date = time.strftime("%Y-%m-%d %H:%M")
    info = device_info(device)
    targets = _targets()
    reports: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="diffulex-sweep-") as tmp:
        ctx = SweepContext(settings, device, peaks, Path(tmp), log)
        for index, name in enumerate(settings.targets):
            target = targets[name]
            seconds = settings.target_seconds(time.perf_counter() - started, settings.targets[index:])
            ctx.budget = Budget(seconds)
            log(f"== {name}: {target.title} (budget {seconds:.0f} s)")
            try:
                rows = target.run(ctx)
                failure = None
            except Exception as err:  # a target that cannot run at all (no checkpoint data, say): the rest go on
                rows, failure = [], error_text(err)
                log(f"  {name} failed: {failure}")
            release(device)
            report = {
                "tool": TOOL, "target": name, "title": target.title, "date": date, "command": command,
                "device": info, "hardware": peaks.to_dict(), "quick": settings.quick,
                "max_seconds": settings.max_seconds, "total_seconds": settings.total_seconds,
                "budget_seconds": round(seconds, 2), "seconds": round(seconds - ctx.budget.left, 2),
                "engine_overrides": settings.engine_overrides, "error": failure, "rows": rows,
            }
            table = target.table(rows) if rows else f"(no rows: {failure})"
            report["table"] = (f"### {target.title}\n\n{info['name']}, {date}, `{command}` (raw: `{name}.json`)\n\n"
                               f"{table}\n")
            reports[name] = report
            (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
            log(report["table"])
            try:
                target.plot(rows, f"{target.title}, {info['name']} ({date})", out / f"{name}.png")
            except ImportError:
                log("  no plot: matplotlib is not installed (pip install matplotlib)")
            except Exception as err:  # the JSON is written: a plot that fails loses no measurement
                log(f"  no plot: {error_text(err)}")
            write_tables(out)  # after each target: a run stopped from outside keeps what it measured
    log(f"results: {out}/ ({', '.join(f'{t}.json' for t in settings.targets)}, tables.md)")
    return reports


def write_tables(out: Path) -> Path:
    """``DIR/tables.md``: the table of every target whose JSON is in `out` (targets run by separate commands into
    one directory add up), in target order."""
    sections = []
    for name in TARGETS:
        path = out / f"{name}.json"
        if path.is_file():
            sections.append(json.loads(path.read_text(encoding="utf-8")).get("table", ""))
    tables = out / "tables.md"
    tables.write_text("\n".join(sections), encoding="utf-8")
    return tables


