"""The ``start`` target of ``diffulex bench sweep``: how long a fresh process takes until its engine is ready.

The engine is built (default settings, random weights of the SDAR-1.7B geometry) in a new Python process, twice:
``cold`` with an empty Triton (and Inductor) cache directory, ``warm`` with the directory the cold run filled.
Each run reports the wall time from the process's start to the engine being ready, split into the imports, the
engine's build phases (`diffulex.engine.build_phases.BuildPhases`: from the imports ``Diffulex(...)`` makes and the
config to the device's initialisation, weights, tokenizer, memory plan, kernels, graphs, ...; they cover the whole
call, so what the build spends outside them is only the call itself, a few milliseconds), the work done beside them
in background threads (the tokenizer's import) and the first request after it (one short generation: any kernel the
build left to compile shows up here).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffulex.bench.sweep_common import SweepContext, error_text, fmt, markdown, plot_axes, save_figure, skipped

RESULT_PREFIX = "DIFFULEX_SWEEP_START "
CHILD = "import sys; from diffulex.bench.sweep_start import child_main; child_main(sys.argv[1])"
MAX_CHILD_SECONDS = 300.0
# a started run may outlive its target's budget by this much: a warm run cut short would measure nothing
CHILD_GRACE_SECONDS = 60.0
# the build's log lines a row keeps: where the attention kernels were compiled, and the phases' own line
BUILD_LOG_PREFIXES = ("kernels:", "engine ready in")


def child_main(spec_json: str) -> None:
    """Run in the fresh process: build the engine, generate once, print the time stamps as one JSON line."""
    imported = time.time()
    spec = json.loads(spec_json)
    from diffulex import Diffulex
    from diffulex.sampling_params import SamplingParams

    build_log = _BuildLog()
    logging.getLogger("diffulex").addHandler(build_log)
    logging.getLogger("diffulex").setLevel(logging.INFO)
    engine = Diffulex(spec["model"], **spec["fields"])
    built = time.time()
    engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    first = time.time()
    result = {"imported": imported, "built": built, "first_request": first, "build_seconds": engine.build_seconds,
              "device": str(engine.device),
              "dtype": str(engine.dtype), "build_log": build_log.lines}
    engine.exit()
    print(RESULT_PREFIX + json.dumps(result), flush=True)


class _BuildLog(logging.Handler):
    """The engine's log lines of the build that say what was compiled where (kept in the row's JSON)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(BUILD_LOG_PREFIXES):
            self.lines.append(message)


def start_once(model: Path, fields: Mapping[str, Any], cache_dir: Path, timeout_s: float) -> dict[str, Any]:
    """One fresh process with `cache_dir` as its kernel caches; the time stamps as seconds from its spawn."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor")}
    spec = json.dumps({"model": str(model), "fields": dict(fields)})
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, cwd=os.getcwd(), capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"the engine process exited with {proc.returncode}: {' | '.join(tail)}")
    stamps = json.loads(lines[-1][len(RESULT_PREFIX):])
    return {
        "ready_s": stamps["built"] - spawned,
        "imports_s": stamps["imported"] - spawned,
        "build_s": stamps["built"] - stamps["imported"],
        "build_phases_s": stamps["build_seconds"],
        "build_log": stamps["build_log"],
        "first_request_s": stamps["first_request"] - stamps["built"],
        "device": stamps["device"],
        "dtype": stamps["dtype"],
    }


def run_start(ctx: SweepContext) -> list[dict[str, Any]]:
    model = "tiny-sdar" if ctx.quick else "sdar-1.7b"
    path, load_format = ctx.checkpoint(model)
    fields = ctx.engine_fields({"load_format": load_format})
    cache = ctx.workdir / "start-caches"  # empty until the cold run fills it
    rows = []
    for case in ("cold", "warm"):
        row: dict[str, Any] = {"model": model, "case": case, "fields": fields, "error": None}
        if ctx.budget.spent:
            rows.append(skipped(row))
            continue
        try:
            timeout = min(MAX_CHILD_SECONDS, max(ctx.budget.left, 0.0) + CHILD_GRACE_SECONDS)
            row.update(start_once(path, fields, cache, timeout))
            ctx.log(f"  {case}: ready in {row['ready_s']:.1f} s (imports {row['imports_s']:.1f} s, engine build "
                    f"{row['build_s']:.1f} s), first request {row['first_request_s']:.2f} s")
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            row["error"] = error_text(err)
            ctx.log(f"  {case} failed: {row['error']}")
        rows.append(row)
    return rows


def _unlogged(row: Mapping[str, Any]) -> float:
    """Seconds of ``Diffulex(...)`` outside its `BuildPhases`: the phases cover the whole call, so this is only the
    call itself (milliseconds); more would be a part of the build the phases miss."""
    return max(0.0, row["build_s"] - sum(row["build_phases_s"].values()))


def _named_seconds(seconds: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {value:.2f}" for name, value in seconds.items()) or "-"


def start_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ["model", "kernel caches", "ready (s)", "imports", "engine build", "its phases (s)", "outside them",
              "first request"]
    body = []
    for r in rows:
        if r.get("error") or r.get("skipped"):
            body.append([r["model"], r["case"], r.get("error") or r.get("skipped"), *["-"] * 5])
            continue
        body.append([r["model"], r["case"], fmt(r["ready_s"], ".1f"), fmt(r["imports_s"], ".1f"),
                     fmt(r["build_s"], ".1f"), _named_seconds(r["build_phases_s"]), fmt(_unlogged(r), ".2f"),
                     fmt(r["first_request_s"], ".2f")])
    return markdown(header, body)


def plot_start(rows: Sequence[Mapping[str, Any]], title: str, path: Path) -> None:
    plt, fig, (ax,) = plot_axes(1, title)
    done = [r for r in rows if not r.get("error") and not r.get("skipped")]
    for i, r in enumerate(done):
        parts = [("imports", r["imports_s"]), *r["build_phases_s"].items()]
        parts.append(("build outside its phases", _unlogged(r)))
        parts.append(("first request", r["first_request_s"]))
        bottom = 0.0
        for j, (name, seconds) in enumerate(parts):
            ax.bar(i, seconds, bottom=bottom, color=f"C{j % 10}", label=name if i == 0 else None)
            bottom += seconds
    ax.set_xticks(range(len(done)), [r["case"] for r in done])
    ax.set_ylabel("seconds from process start")
    ax.legend(fontsize=7)
    save_figure(plt, fig, path)
