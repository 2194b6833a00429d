"""The decode targets of ``diffulex bench sweep``: ``batch``, ``strategies`` and ``moe``.

Each configuration is one engine and `diffulex.bench.throughput.measure_decode` at each batch size (warm-up
``generate`` first, prompt steps untimed, the region bracketed by device synchronizations), so every number here
means what it means in ``diffulex bench throughput``. On top of it each row carries the floor's parts (every
weight, the LM head, the K/V the step reads and writes, the experts its rows select, the flops) and whether its
steps replayed CUDA graphs, read from the engine's runner (`ModelRunner.graph_replays`), not assumed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

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

BATCH_FLOOR_TARGET = 1.3  # ms per step <= 1.3x the step's floor (issue 31, targets 1 and 3)
STRATEGY_VS_MULTI_BD_TARGET = 1.2  # at batch 32, within 1.2x of multi_bd's step time
MOE_FLOOR_TARGET = 1.25
BASELINE = "multi_bd b1"  # the label each family's other strategies are compared with
TIMED_STEPS = 100  # decode steps timed per configuration on the GPU: a stable mean, a few seconds at most
STRATEGY_TIMED_STEPS = 64
PROFILE_STEPS = 8  # decode steps profiled where a target asks for the step's make-up
GRAPHED_SHARE = 0.95  # a configuration "runs in CUDA graphs" when at least this share of its steps replayed one


@dataclass(frozen=True)
class DecodeConfig:
    """One engine: a geometry, a strategy label, the fields that select it, its block and buffer sizes."""

    model: str
    label: str
    block_size: int
    buffer_size: int = 1
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DecodeShape:
    """What every configuration of a target decodes."""

    batches: list[int]
    prompt_len: int
    max_tokens: int
    max_steps: int | None
    seconds_per_batch: float
    warmup_tokens: int


def _shape(ctx: SweepContext, batches: list[int], quick_batches: list[int], max_steps: int | None) -> DecodeShape:
    if ctx.quick:
        return DecodeShape(quick_batches, prompt_len=8, max_tokens=24, max_steps=6, seconds_per_batch=10.0,
                           warmup_tokens=4)
    return DecodeShape(batches, prompt_len=128, max_tokens=256, max_steps=max_steps, seconds_per_batch=5.0,
                       warmup_tokens=16)


def floor_parts(cost: Any, row: Mapping[str, Any]) -> dict[str, Any]:
    """The floor's parts of a measured row: bytes every step reads whatever its rows (weights, of them the LM
    head), the experts its rows select (counted where the row counted them, else the uniform estimate), the
    embedding rows it gathers, the K/V it reads and writes (the rest of its bytes), and its flops."""
    query = row["query_tokens_per_step"]
    experts = row.get("experts_read_per_step", 0.0)
    expert_bytes = experts * cost.expert_params * cost.itemsize
    embedding_bytes = cost.embedding_row * query * cost.itemsize
    return {
        "weight_bytes": cost.weight_bytes,
        "lm_head_bytes": cost.lm_head_params * cost.itemsize,
        "expert_bytes_per_step": expert_bytes,
        "experts_per_moe_layer": experts / cost.moe_layers if cost.moe_layers else None,
        "uniform_experts_per_moe_layer": (
            row["uniform_experts_read_per_step"] / cost.moe_layers if cost.moe_layers else None
        ),
        "embedding_bytes_per_step": embedding_bytes,
        "kv_bytes_per_step": max(0.0, row["bytes_per_step"] - cost.weight_bytes - expert_bytes - embedding_bytes),
        "flops_per_step": row["flops_per_step"],
    }


def _graphed(row: Mapping[str, Any]) -> dict[str, Any]:
    replays, steps = row.get("graph_replays"), row.get("engine_steps") or 0
    if replays is None:
        return {"graphed_share": None, "graphed": False}
    share = replays / steps if steps else 0.0
    return {"graphed_share": share, "graphed": share >= GRAPHED_SHARE}


def measure_configs(
    ctx: SweepContext,
    configs: Sequence[DecodeConfig],
    shape: DecodeShape,
    count_experts: bool = False,
    profile_batch: int | None = None,
) -> list[dict[str, Any]]:
    """Every configuration at every batch size of `shape`; a failure is recorded with its error and the next
    configuration gets a fresh engine; once the budget is spent the rest are recorded as skipped.
    ``count_experts``: the MoE floor on the experts each step selected (`measure_decode`); ``profile_batch``: at
    that batch, where the budget allows, also where the step's GPU time goes (`profile_decode`)."""
    from diffulex import Diffulex
    from diffulex.bench.roofline import cost_model_from_module
    from diffulex.bench.throughput import STRATEGY_DEFAULTS, ModelEntry, ThroughputSettings, measure_decode

    rows: list[dict[str, Any]] = []
    for config in configs:
        base = {"model": config.model, "label": config.label, "block_size": config.block_size,
                "buffer_size": config.buffer_size, "fields": config.fields}
        if ctx.budget.spent:
            rows += [skipped({**base, "batch": b}) for b in shape.batches]
            continue
        engine = None
        try:
            path, load_format = ctx.checkpoint(config.model)
            overrides = dict(config.fields)
            strategy = overrides.get("decoding_strategy")
            strategy = overrides.pop("decoding_strategy") if strategy in STRATEGY_DEFAULTS else "multi_bd"
            settings = ThroughputSettings(
                batch_sizes=list(shape.batches), buffer_sizes=[config.buffer_size], prompt_len=shape.prompt_len,
                max_tokens=shape.max_tokens, block_size=config.block_size, max_seconds=shape.seconds_per_batch,
                max_steps=shape.max_steps, warmup_tokens=shape.warmup_tokens, quick=ctx.quick,
                strategy=strategy, engine_overrides=overrides,
            )
            fields = ctx.engine_fields(settings.engine_fields(ModelEntry(config.model, str(path), load_format),
                                                              config.buffer_size))
            ctx.log(f"  {config.model} {config.label}: building the engine ...")
            engine = Diffulex(str(path), **fields)
            itemsize = torch.empty((), dtype=engine.dtype).element_size()
            cost = cost_model_from_module(engine.model, itemsize)
            flops_per_s = ctx.flops_per_s(engine.dtype)
        except Exception as err:  # an engine that cannot be built: every batch of it fails alike
            failure = error_text(err)
            ctx.log(f"  failed: {failure}")
            rows += [{**base, "batch": b, "error": failure} for b in shape.batches]
            _close(engine)
            engine = None
            release(ctx.device)
            continue
        failed_at = None
        for batch in shape.batches:
            row: dict[str, Any] = {**base, "batch": batch, "dtype": str(engine.dtype).removeprefix("torch."),
                                   "error": None}
            if failed_at is not None:  # the engine may be half-way through a step: its other batches are not run
                rows.append({**row, "error": f"not run: the engine failed at batch {failed_at}"})
                continue
            if ctx.budget.spent:
                rows.append(skipped(row))
                continue
            try:
                settings.max_seconds = min(shape.seconds_per_batch, max(ctx.budget.left, 0.5))
                row.update(measure_decode(engine, batch, settings, cost, ctx.peaks, flops_per_s, count_experts))
                row.update(floor_parts(cost, row))
                row.update(_graphed(row))
                if batch == profile_batch and not ctx.budget.spent:
                    try:
                        row["profile"] = _profile(engine, batch, settings)
                    except Exception as err:  # the timed row stands; the profile's failure is reported beside it
                        row["profile_error"] = error_text(err)
                ctx.log(f"  {config.model} {config.label} batch {batch}: {row['ms_per_step_mean']:.3f} ms/step, "
                        f"floor {row['floor_ms']:.3f} ms ({row['bound']}), {row['floor_ratio']:.2f}x, "
                        f"graphed {row['graphed']}")
            except Exception as err:  # out of memory, a kernel failure: record it, go on
                row["error"] = error_text(err)
                ctx.log(f"  {config.model} {config.label} batch {batch} failed: {row['error']}")
            rows.append(row)
            if row["error"]:
                failed_at = batch
        _close(engine)
        engine = None
        release(ctx.device)
    return rows


def _profile(engine: Any, batch: int, settings: Any) -> dict[str, Any]:
    """`profile_decode` over a few steps of requests as long as the timed ones (the engine was sized for them)."""
    from diffulex.bench.throughput import profile_decode

    return profile_decode(engine, batch, replace(settings, profile_steps=PROFILE_STEPS), settings.max_tokens)


def _close(engine: Any) -> None:
    if engine is not None:
        with contextlib.suppress(Exception):
            engine.exit()


def _ok(row: Mapping[str, Any]) -> bool:
    return not row.get("error") and not row.get("skipped")


def _status(row: Mapping[str, Any]) -> str | None:
    if row.get("error"):
        return f"error: {row['error']}"
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    return None


def _gb(value: float | None) -> str:
    return fmt(None if value is None else value / 1e9, ".3g")


# ----- batch ---------------------------------------------------------------------------------------------------


def run_batch(ctx: SweepContext) -> list[dict[str, Any]]:
    """SDAR-1.7B and 8B geometries, block 4, buffers 1 and 2, batches 32/64/128: each step against its floor."""
    models = ["tiny-sdar"] if ctx.quick else ["sdar-1.7b", "sdar-8b"]
    configs = [DecodeConfig(m, f"multi_bd b{buffer}", 4, buffer) for m in models for buffer in (1, 2)]
    rows = measure_configs(ctx, configs, _shape(ctx, [32, 64, 128], [2, 4], TIMED_STEPS))
    for row in rows:
        if _ok(row):
            row["target_ratio"] = BATCH_FLOOR_TARGET
            row["x_target"] = row["floor_ratio"] / BATCH_FLOOR_TARGET
            row["met"] = row["floor_ratio"] <= BATCH_FLOOR_TARGET
    return rows


def batch_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ["model", "buffer", "batch", "ms/step (mean / p50)", "weights GB", "of it LM head GB", "K/V GB",
              "GFLOP", "memory floor ms", "compute floor ms", "x floor", "<= 1.3x?", "graphed"]
    body = []
    for r in rows:
        status = _status(r)
        if status:
            body.append([r["model"], r["buffer_size"], r["batch"], status, *["-"] * 9])
            continue
        body.append([
            r["model"], r["buffer_size"], r["batch"], f"{r['ms_per_step_mean']:.2f} / {r['ms_per_step_p50']:.2f}",
            _gb(r["weight_bytes"]), _gb(r["lm_head_bytes"]), _gb(r["kv_bytes_per_step"]),
            fmt(r["flops_per_step"] / 1e9, ".1f"), fmt(r["memory_floor_ms"], ".3f"), fmt(r["compute_floor_ms"], ".3f"),
            fmt(r["floor_ratio"]), "yes" if r["met"] else "no", "yes" if r["graphed"] else "no",
        ])
    return markdown(header, body)


def plot_batch(rows: Sequence[Mapping[str, Any]], title: str, path: Path) -> None:
    plt, fig, (ax_ms, ax_ratio) = plot_axes(2, title)
    lines: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for r in rows:
        if _ok(r):
            lines.setdefault((r["model"], r["buffer_size"]), []).append(r)
    for (model, buffer), points in sorted(lines.items()):
        points = sorted(points, key=lambda r: r["batch"])
        batches = [r["batch"] for r in points]
        line = ax_ms.plot(batches, [r["ms_per_step_mean"] for r in points], marker="o", label=f"{model} b{buffer}")
        ax_ms.plot(batches, [r["floor_ms"] for r in points], linestyle="--", color=line[0].get_color())
        ax_ratio.plot(batches, [r["floor_ratio"] for r in points], marker="o", label=f"{model} b{buffer}")
    ax_ms.set_ylabel("ms per step (dashed: floor)")
    ax_ratio.set_ylabel("x floor")
    ax_ratio.axhline(BATCH_FLOOR_TARGET, color="black", linewidth=0.8, linestyle=":")
    for ax in (ax_ms, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(plt, fig, path)


# ----- strategies ----------------------------------------------------------------------------------------------


def strategy_configs(quick: bool) -> list[DecodeConfig]:
    """multi_bd buffers 1/2/4 and d2f on SDAR; edit and DMax (token merge on) on LLaDA2 beside its multi_bd;
    fast_dllm_v2 beside its family's multi_bd; diffusion_gemma (its family runs nothing else)."""
    sdar, llada2 = ("tiny-sdar", "tiny-llada2") if quick else ("sdar-1.7b", "llada2-mini")
    fast, gemma = ("tiny-fast-dllm-v2", "tiny-diffusion-gemma") if quick else ("fast-dllm-v2-7b", "diffusion-gemma")
    llada2_block = 4 if quick else 32  # LLaDA2 is trained with 32-token blocks
    return [  # the strategies the issue names first: a spent budget skips the ones that landed since
        DecodeConfig(sdar, BASELINE, 4, 1),
        DecodeConfig(sdar, "multi_bd b2", 4, 2),
        DecodeConfig(sdar, "multi_bd b4", 4, 4),
        DecodeConfig(sdar, "d2f", 4, 1, {"decoding_strategy": "d2f"}),
        DecodeConfig(llada2, BASELINE, llada2_block, 1),
        DecodeConfig(llada2, "edit", llada2_block, 1, {"sampling_mode": "edit"}),
        DecodeConfig(llada2, "dmax (token merge)", llada2_block, 1,
                     {"decoding_strategy": "dmax", "sampling_mode": "edit", "token_merge_weight": 1.0}),
        DecodeConfig(fast, BASELINE, 8, 1, {"decoding_strategy": "multi_bd"}),
        DecodeConfig(fast, "fast_dllm_v2", 8, 4, {"decoding_strategy": "fast_dllm_v2"}),
        DecodeConfig(gemma, "diffusion_gemma", 16, 1, {"decoding_strategy": "diffusion_gemma"}),
    ]


def run_strategies(ctx: SweepContext) -> list[dict[str, Any]]:
    """Each strategy at batch 1 and 32 against its floor, and at each batch against its family's multi_bd."""
    shape = _shape(ctx, [1, 32], [1, 2], STRATEGY_TIMED_STEPS)
    rows = measure_configs(ctx, strategy_configs(ctx.quick), shape)
    baseline = {(r["model"], r["batch"]): r for r in rows if r["label"] == BASELINE and _ok(r)}
    for row in rows:
        if not _ok(row):
            continue
        base = baseline.get((row["model"], row["batch"]))
        row["vs_multi_bd"] = row["ms_per_step_mean"] / base["ms_per_step_mean"] if base else None
        row["floor_met"] = row["floor_ratio"] <= BATCH_FLOOR_TARGET
    return rows


def strategies_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ["model", "strategy", "block x buffer", "batch", "ms/step (mean / p50)", "floor ms", "x floor",
              "x multi_bd", "TPF", "graphed (share of steps)"]
    body = []
    for r in rows:
        status = _status(r)
        layout = f"{r['block_size']} x {r['buffer_size']}"
        if status:
            body.append([r["model"], r["label"], layout, r["batch"], status, *["-"] * 5])
            continue
        share = r["graphed_share"]
        graphed = "no graphs" if share is None else f"{'yes' if r['graphed'] else 'no'} ({share:.0%})"
        body.append([r["model"], r["label"], layout, r["batch"],
                     f"{r['ms_per_step_mean']:.2f} / {r['ms_per_step_p50']:.2f}", fmt(r["floor_ms"], ".3f"),
                     fmt(r["floor_ratio"]), fmt(r["vs_multi_bd"]), fmt(r["tpf"]), graphed])
    return markdown(header, body)


def plot_strategies(rows: Sequence[Mapping[str, Any]], title: str, path: Path) -> None:
    batches = sorted({r["batch"] for r in rows})
    plt, fig, axes = plot_axes(len(batches), title)
    for ax, batch in zip(axes, batches, strict=True):
        points = [r for r in rows if r["batch"] == batch and _ok(r)]
        labels = [f"{r['model']}\n{r['label']}" for r in points]
        x = range(len(points))
        ax.bar(x, [r["ms_per_step_mean"] for r in points], label="ms/step")
        ax.scatter(x, [r["floor_ms"] for r in points], color="black", marker="_", s=400, label="floor", zorder=3)
        ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("ms per step")
        ax.set_title(f"batch {batch}")
        ax.legend(fontsize=8)
    save_figure(plt, fig, path)


# ----- MoE -----------------------------------------------------------------------------------------------------


def run_moe(ctx: SweepContext) -> list[dict[str, Any]]:
    """SDAR-30B-A3B and LLaDA2.0-mini geometries at batch 1, 8 and 32 against the floor of the experts the rows
    select: counted step by step on an untimed eager re-run of the timed requests (`measure_decode`), the
    uniform-routing estimate beside it (`diffulex.bench.roofline`); at the largest batch, where the step's GPU
    time goes (`profile_decode`)."""
    batches, quick_batches = [1, 8, 32], [1, 2]
    if ctx.quick:
        configs = [DecodeConfig("tiny-sdar-moe", BASELINE, 4), DecodeConfig("tiny-llada2", BASELINE, 4)]
    else:
        configs = [DecodeConfig("sdar-30b-a3b", BASELINE, 4), DecodeConfig("llada2-mini", BASELINE, 32)]
    shape = _shape(ctx, batches, quick_batches, TIMED_STEPS)
    rows = measure_configs(ctx, configs, shape, count_experts=True, profile_batch=max(shape.batches))
    for row in rows:
        if _ok(row):
            row["target_ratio"] = MOE_FLOOR_TARGET
            row["met"] = row["floor_ratio"] <= MOE_FLOOR_TARGET
    return rows


def moe_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows against the counted floor (the uniform estimate after each slash), then where the profiled
    steps' GPU time went."""
    header = ["model", "block", "batch", "ms/step (mean / p50)", "experts read per layer (counted / uniform)",
              "expert GB", "other weights GB", "K/V GB", "floor ms (counted / uniform)",
              "x MoE floor (counted / uniform)", "<= 1.25x?", "graphed", "re-run rows / tokens agree"]
    body = []
    for r in rows:
        status = _status(r)
        if status:
            body.append([r["model"], r["block_size"], r["batch"], status, *["-"] * 9])
            continue
        counted = r.get("experts_counted", False)
        uniform_floor = r["uniform_floor_ms"] if counted else r["floor_ms"]
        uniform_ratio = r["uniform_floor_ratio"] if counted else r["floor_ratio"]
        agree = (f"{_yes(r['expert_rerun_rows_agree'])} / {_yes(r['expert_rerun_tokens_agree'])}" if counted
                 else f"not counted: {r.get('expert_count_error', '-')}")
        body.append([r["model"], r["block_size"], r["batch"],
                     f"{r['ms_per_step_mean']:.2f} / {r['ms_per_step_p50']:.2f}",
                     f"{_counted(r, 'experts_per_moe_layer', '.1f')} / "
                     f"{fmt(r['uniform_experts_per_moe_layer'], '.1f')}",
                     _gb(r["expert_bytes_per_step"]), _gb(r["weight_bytes"]), _gb(r["kv_bytes_per_step"]),
                     f"{_counted(r, 'floor_ms', '.3f')} / {fmt(uniform_floor, '.3f')}",
                     f"{_counted(r, 'floor_ratio', '.2f')} / {fmt(uniform_ratio)}",
                     "yes" if r["met"] else "no", "yes" if r["graphed"] else "no", agree])
    table = markdown(header, body)
    profiled = [r for r in rows if _ok(r) and r.get("profile")]
    if not profiled:
        return table
    labels = list(profiled[0]["profile"]["kernel_ms_per_step"])
    header = ["model", "batch", "profiled steps", "wall ms/step (unprofiled)", "GPU busy ms/step",
              *(f"{label} ms" for label in labels), "kernels/step"]
    body = []
    for r in profiled:
        p = r["profile"]
        body.append([r["model"], r["batch"], p["steps"], fmt(p["wall_ms_per_step_unprofiled"], ".2f"),
                     fmt(p["gpu_busy_ms_per_step"], ".2f"),
                     *(fmt(p["kernel_ms_per_step"][label], ".2f") for label in labels),
                     fmt(p["kernels_per_step"], ".0f")])
    title = "Where the profiled steps' GPU time went (kernel time by kind, `diffulex.bench.gpu_profile`):"
    return f"{table}\n\n{title}\n\n{markdown(header, body)}"


def _counted(row: Mapping[str, Any], key: str, spec: str) -> str:
    return fmt(row[key], spec) if row.get("experts_counted") else "-"


def _yes(value: Any) -> str:
    return "yes" if value else "no"


def plot_moe(rows: Sequence[Mapping[str, Any]], title: str, path: Path) -> None:
    plt, fig, (ax,) = plot_axes(1, title)
    lines: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if _ok(r):
            lines.setdefault(r["model"], []).append(r)
    for model, points in sorted(lines.items()):
        points = sorted(points, key=lambda r: r["batch"])
        batches = [r["batch"] for r in points]
        line = ax.plot(batches, [r["ms_per_step_mean"] for r in points], marker="o", label=model)
        ax.plot(batches, [r["floor_ms"] for r in points], linestyle="--", color=line[0].get_color())
        ax.plot(batches, [r.get("uniform_floor_ms", r["floor_ms"]) for r in points], linestyle=":",
                color=line[0].get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("ms per step (dashed: MoE floor, counted experts; dotted: uniform routing)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)
