"""What a run leaves for people: ``report.md`` with a plot, and ``diffulex bench compare A B``.

Both read the run's ``metrics.json`` (written by `diffulex.bench.runner`), whose layout is::

    {"schema": 1, "created": ..., "tasks": [...], "config": {"engine": ..., "eval": ...},
     "engine_resolved": {...}, "environment": {...},
     "accuracy": {task: {"metric", "value", "stderr", "num_samples"}},
     "metrics": {RunMetrics fields}, "batches": [...]}
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffulex.bench.metrics import METRIC_LABELS, percentile, request_timings, step_clock, step_tokens

METRICS_FILE = "metrics.json"
REPORT_FILE = "report.md"
PLOT_FILE = "report.png"

# Throughput metrics compare as "higher is better"; latency-like ones as "lower is better".
HIGHER_IS_BETTER = {"aggregate_tps", "mean_request_tps", "decode_tps", "tpf"}
LOWER_IS_BETTER = {"mean_nfe", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "latency_mean_s", "latency_p50_s",
                   "latency_p99_s"}


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if value != 0 and abs(value) < 10 ** -(digits - 1):
            return f"{value:.3g}"
        return f"{value:.{digits}g}" if abs(value) >= 10**digits else f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return str(value)


# ----------------------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------------------


def write_plot(path: Path, batches: Sequence[Any], title: str = "") -> bool:
    """Two panels: request latency / TTFT distribution, and tokens per second of each engine step over time.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    latencies: list[float] = []
    ttfts: list[float] = []
    xs: list[float] = []
    ys: list[float] = []
    prefill_flags: list[bool] = []
    offset = 0.0
    for batch in batches:
        trajs = [t for t in batch.trajectories if getattr(t, "error", None) is None]
        timings = request_timings(trajs)
        latencies += [offset + t.latency_s for t in timings]
        ttfts += [offset + t.ttft_s for t in timings if t.ttft_s is not None]
        clock = step_clock(trajs)
        tokens = step_tokens(trajs)
        prefill_steps = {t.steps[0].step for t in trajs if t.steps}
        for step, (start, end) in sorted(clock.items()):
            if end > start:
                xs.append(offset + end)
                ys.append(tokens.get(step, 0) / (end - start))
                prefill_flags.append(step in prefill_steps)
        offset += max((end for _, end in clock.values()), default=0.0)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for values, label in ((latencies, "latency"), (ttfts, "time to first token")):
        if values:
            data = sorted(values)
            shares = [(i + 1) / len(data) for i in range(len(data))]
            ax1.step([data[0], *data], [0.0, *shares], where="post", label=label)
    for q, style in ((50, "--"), (99, ":")):
        p = percentile(latencies, q)
        if p is not None:
            ax1.axvline(p, color="gray", linestyle=style, linewidth=1, label=f"latency p{q} = {p:.3g} s")
    ax1.set_xlabel("seconds since submission (step clock)")
    ax1.set_ylabel("share of requests")
    ax1.set_ylim(0.0, 1.05)
    ax1.set_title("Request latency and TTFT (CDF)")
    ax1.legend(fontsize=8)
    decode = [(x, y) for x, y, p in zip(xs, ys, prefill_flags, strict=True) if not p]
    prefill = [(x, y) for x, y, p in zip(xs, ys, prefill_flags, strict=True) if p]
    if decode:
        ax2.plot(*zip(*decode, strict=True), ".", markersize=3, label="decode steps")
    if prefill:
        ax2.plot(*zip(*prefill, strict=True), "x", markersize=5, label="steps with a prefill")
    ax2.set_xlabel("seconds (step clock)")
    ax2.set_ylabel("generated tokens / step time (tok/s)")
    ax2.set_title("Throughput of each engine step")
    if decode or prefill:
        ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------------
# Markdown report
# ----------------------------------------------------------------------------------------------------------


def render_markdown(report: Mapping[str, Any], plot_file: str | None = PLOT_FILE) -> str:
    cfg = report.get("config", {})
    engine = cfg.get("engine", {})
    ev = cfg.get("eval", {})
    resolved = report.get("engine_resolved", {})
    env = report.get("environment", {})
    metrics = report.get("metrics", {})
    lines = [
        f"# Benchmark run {report.get('run_name', '')}".rstrip(),
        "",
        f"- created: {report.get('created', 'n/a')}",
        f"- model: `{engine.get('model_path', 'n/a')}` (family `{resolved.get('model_name', 'n/a')}`, "
        f"strategy `{resolved.get('decoding_strategy', 'n/a')}`, block {resolved.get('block_size', 'n/a')}, "
        f"buffer {resolved.get('buffer_size', 'n/a')})",
        f"- tasks: {', '.join(report.get('tasks', []))}; limit {ev.get('dataset_limit')}; temperature "
        f"{ev.get('temperature')}; max_tokens {ev.get('max_tokens')} (null = task's); max_nfe {ev.get('max_nfe')}; "
        f"chat template {ev.get('apply_chat_template')}",
        f"- device: {env.get('device', 'n/a')}; diffulex {env.get('diffulex', '?')}, torch {env.get('torch', '?')}, "
        f"lm-eval {env.get('lm_eval', '?')}",
        "",
        "## Accuracy",
        "",
        "| task | metric | value | stderr | samples |",
        "|---|---|---|---|---|",
    ]
    for task, acc in report.get("accuracy", {}).items():
        lines.append(
            f"| {task} | {acc.get('metric')} | {_fmt(acc.get('value'))} | {_fmt(acc.get('stderr'))} | "
            f"{acc.get('num_samples', 'n/a')} |"
        )
    lines += [
        "",
        "## Throughput and latency",
        "",
        "Definitions: docs/benchmarks.md (Metrics). Prompt tokens are never counted as generated tokens.",
        "",
        "| metric | value | unit |",
        "|---|---|---|",
    ]
    for key, (label, unit) in METRIC_LABELS.items():
        if key in metrics:
            lines.append(f"| {label} (`{key}`) | {_fmt(metrics[key])} | {unit} |")
    reasons = metrics.get("completion_reasons") or {}
    if reasons:
        lines += ["", "Completion reasons: " + ", ".join(f"{k} {v}" for k, v in reasons.items()) + "."]
    if plot_file:
        lines += ["", f"![latency and per-step throughput]({plot_file})"]
    lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# Compare
# ----------------------------------------------------------------------------------------------------------


def load_report(path: str | Path) -> dict[str, Any]:
    """A run's metrics.json, given the run directory or the file itself."""
    p = Path(path)
    file = p / METRICS_FILE if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"{str(path)!r} is not a benchmark run: no {METRICS_FILE} found")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{str(file)!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict) or "metrics" not in data:
        raise ValueError(f"{str(file)!r} is not a diffulex benchmark metrics file")
    return data


def _delta(a: Any, b: Any) -> tuple[float | None, float | None]:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or isinstance(a, bool):
        return None, None
    diff = float(b) - float(a)
    return diff, (diff / abs(a) * 100.0 if a else None)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def compare_reports(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Differences of B against A: accuracy per task, every metric, and the settings (config, resolved engine
    config, versions and device) that differ."""
    rows = []
    tasks = list(dict.fromkeys([*a.get("accuracy", {}), *b.get("accuracy", {})]))
    for task in tasks:
        ea, eb = a.get("accuracy", {}).get(task, {}), b.get("accuracy", {}).get(task, {})
        va, vb = ea.get("value"), eb.get("value")
        diff, rel = _delta(va, vb)
        rows.append({"key": f"accuracy/{task}", "label": f"{task} {ea.get('metric') or eb.get('metric')}",
                     "a": va, "b": vb, "diff": diff, "rel_pct": rel, "better": "higher"})
    ma, mb = a.get("metrics", {}), b.get("metrics", {})
    for key, (label, unit) in METRIC_LABELS.items():
        if key not in ma and key not in mb:
            continue
        diff, rel = _delta(ma.get(key), mb.get(key))
        better = "higher" if key in HIGHER_IS_BETTER else "lower" if key in LOWER_IS_BETTER else ""
        rows.append({"key": key, "label": f"{label} ({unit})" if unit else label, "a": ma.get(key),
                     "b": mb.get(key), "diff": diff, "rel_pct": rel, "better": better})
    settings = []
    sections = ("config", "engine_resolved", "environment")
    fa = _flatten({k: a.get(k, {}) for k in sections})
    fb = _flatten({k: b.get(k, {}) for k in sections})
    for key in sorted(set(fa) | set(fb)):
        if fa.get(key) != fb.get(key):
            settings.append({"key": key, "a": fa.get(key), "b": fb.get(key)})
    return {"a": a.get("run_dir"), "b": b.get("run_dir"), "rows": rows, "settings": settings}


def format_comparison(cmp: Mapping[str, Any]) -> str:
    """Plain-text table of `compare_reports`."""
    header = ("metric", "A", "B", "B - A", "change")
    body = []
    for row in cmp["rows"]:
        rel = row["rel_pct"]
        change = "" if rel is None else f"{rel:+.1f}%"
        if rel is not None and row["better"] and rel != 0:
            good = (rel > 0) == (row["better"] == "higher")
            change += " (better)" if good else " (worse)"
        diff = "" if row["diff"] is None else f"{row['diff']:+.4g}"
        body.append((row["label"], _fmt(row["a"]), _fmt(row["b"]), diff, change))
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [f"A: {cmp.get('a')}", f"B: {cmp.get('b')}", ""]
    for r in [header, tuple("-" * w for w in widths), *body]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    if cmp["settings"]:
        lines += ["", "settings that differ:"]
        for s in cmp["settings"]:
            lines.append(f"  {s['key']}: {s['a']!r} -> {s['b']!r}")
    else:
        lines += ["", "settings: identical"]
    return "\n".join(lines)
