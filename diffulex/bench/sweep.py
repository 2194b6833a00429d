"""``diffulex bench sweep``: the performance targets of the engine measured in one command, each against its floor.

Targets (``--targets``, all by default): ``batch`` (large-batch decode steps against the step's floor and its
parts), ``prefill`` (time to first token of long prompts against the prompt forward's compute floor, decoders
beside a chunked prefill, a prefix-cache hit), ``strategies`` (every decoding strategy's step time against its
floor and against ``multi_bd``, and whether its steps replayed CUDA graphs), ``moe`` (mixture-of-experts decode
against the floor of the experts the rows select), ``start`` (engine ready time in a fresh process, cold and warm
kernel caches, with the build's phases) and ``serving`` (the HTTP server under open-loop Poisson load against the
same engine offline).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TARGETS = ("batch", "prefill", "strategies", "moe", "start", "serving")
# Each target's share of ``--total-seconds``: about the engines it builds (builds dominate a short sweep): batch 4,
# prefill 4, strategies 10, moe 2 of the largest geometries (weighed as 4), start 2 fresh processes, serving 3.
TARGET_WEIGHTS = {"batch": 4.0, "prefill": 4.0, "strategies": 10.0, "moe": 4.0, "start": 3.0, "serving": 3.0}
DEFAULT_TARGET_SECONDS = 120.0
QUICK_TARGET_SECONDS = 60.0
TOOL = "diffulex bench sweep"


class Budget:
    """The seconds one target may spend: configurations start only while some are left."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.perf_counter()

    @property
    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    @property
    def spent(self) -> bool:
        return self.left <= 0


@dataclass
class SweepSettings:
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    out: str = "sweep"
    quick: bool = False
    max_seconds: float = DEFAULT_TARGET_SECONDS  # per target
    total_seconds: float | None = None  # the whole sweep: each target gets at most its share of what is left
    data_dir: str | None = None  # SDAR-4B-Chat config and tokenizer (the GPU geometries)
    engine_overrides: dict[str, Any] = field(default_factory=dict)  # applied to every engine the sweep builds

    def __post_init__(self) -> None:
        from diffulex.validation import check_number

        if not self.targets:
            raise ValueError(f"targets is empty: give at least one of {', '.join(TARGETS)}")
        for target in self.targets:
            if target not in TARGETS:
                raise ValueError(f"targets: {target!r} is invalid: must be one of {', '.join(TARGETS)}")
        self.targets = [t for t in TARGETS if t in self.targets]  # one order, each once
        check_number("max_seconds", self.max_seconds, low=0.0, low_open=True)
        if self.total_seconds is not None:
            check_number("total_seconds", self.total_seconds, low=0.0, low_open=True)

    def target_seconds(self, elapsed: float, targets_left: Sequence[str]) -> float:
        """The budget of the next target (the first of `targets_left`): ``max_seconds``, or less with
        ``total_seconds``: its share (`TARGET_WEIGHTS`) of the time left among the targets left, so time a target
        did not use, or overran, moves to the others."""
        if self.total_seconds is None:
            return self.max_seconds
        share = TARGET_WEIGHTS[targets_left[0]] / sum(TARGET_WEIGHTS[t] for t in targets_left)
        return min(self.max_seconds, max(self.total_seconds - elapsed, 0.0) * share)


@dataclass
class SweepContext:
    """What every target shares: the device, its measured peaks, the checkpoint folders, the log."""

    settings: SweepSettings
    device: torch.device
    peaks: Any  # diffulex.bench.hardware.HardwarePeaks
    workdir: Path
    log: Callable[[str], None] = print
    budget: Budget = field(default_factory=lambda: Budget(DEFAULT_TARGET_SECONDS))
    _folders: dict[str, Path] = field(default_factory=dict)

    @property
    def quick(self) -> bool:
        return self.settings.quick

    def checkpoint(self, name: str) -> tuple[Path, str]:
        """The folder of geometry `name` (`diffulex.bench.sweep_models.MODELS`), written once per run, and the
        load format to build it with."""
        from diffulex.bench.sweep_models import write_model

        if name not in self._folders:
            self._folders[name] = write_model(name, self.workdir / name, self.settings.data_dir)
        folder = self._folders[name]
        return folder, "safetensors" if any(folder.glob("*.safetensors")) else "dummy"

    def flops_per_s(self, dtype: torch.dtype) -> float:
        from diffulex.bench.hardware import add_matmul_peak

        return add_matmul_peak(self.peaks, self.device, dtype, self.quick)

    def engine_fields(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        return {**fields, **self.settings.engine_overrides}


@dataclass(frozen=True)
class Target:
    """One target: what it measures (rows), how its rows read as a markdown table, and its plot."""

    run: Callable[[SweepContext], list[dict[str, Any]]]
    table: Callable[[Sequence[Mapping[str, Any]]], str]
    plot: Callable[[Sequence[Mapping[str, Any]], str, Path], None]
    title: str


def _targets() -> dict[str, Target]:
    from diffulex.bench import sweep_decode, sweep_prefill, sweep_serving, sweep_start

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
    }


def device_for(overrides: Mapping[str, Any]) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    ids = overrides.get("device_ids") or []
    return torch.device("cuda", ids[0] if ids else overrides.get("device_start", 0))


def engine_dtype(device: torch.device, overrides: Mapping[str, Any]) -> torch.dtype:
    """bfloat16 on CUDA, float32 on CPU (the engine's own default for these checkpoints), unless ``dtype`` says."""
    dtype = overrides.get("dtype", "auto")
    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give freed memory back once an engine is gone (outside any ``except`` block)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def skipped(row: dict[str, Any]) -> dict[str, Any]:
    """A configuration not started because its target's budget was spent."""
    return {**row, "error": None, "skipped": "budget (--max-seconds) spent"}


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def device_info(device: torch.device) -> dict[str, Any]:
    import platform

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return {"name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpu_threads": torch.get_num_threads()}


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


def plot_axes(ncols: int, title: str) -> tuple[Any, Any, list[Any]]:
    """A figure of `ncols` panels (matplotlib, Agg); raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5), squeeze=False)
    fig.suptitle(title)
    return plt, fig, list(axes[0])


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
