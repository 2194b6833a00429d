"""The ``prefill`` target of ``diffulex bench sweep``: long prompts.

* Time to first token of a 2k, 8k and 32k-token prompt (SDAR-1.7B and 8B geometries), one request, the whole
  prompt in one forward: from a device synchronization and ``add_request`` to the return of the step that
  accepts its first token (the token is then on the host), after an untimed warm-up prompt of the same length
  (other tokens, so no prefix-cache hit).
  Its floor is the sum over those steps of each step's larger floor, from the steps' own records: the compute
  floor counts the prompt's linear flops, the LM head over the sampled rows and attention's (query, key) pairs
  under the block-causal mask (`diffulex.bench.roofline.block_causal_pairs`).
* Decoders beside a chunked prefill (``enable_chunked_prefill``): 32 decoding requests, their step times alone,
  then while one 32k-token prompt is prefilled a chunk per step beside them; p50/p99 of each phase.
* A prefix-cache hit: the 32k prompt again with a fresh tail; its time to first token against the floor of the
  rows it computed (the uncached tail, attending to the cached prefix) and against the cold prompt's.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
    sync,
)

TTFT_FLOOR_TARGET = 1.3  # time to first token <= 1.3x the compute floor of the prompt's forward
BESIDE_PREFILL_TARGET = 2.0  # decoders' p99 step beside a chunked prefill <= 2x their step alone
BLOCK_SIZE = 4


@dataclass(frozen=True)
class PrefillShape:
    models: list[str]
    prompt_lens: list[int]
    tail_len: int  # tokens after the cached prompt in the prefix-hit request
    decoders: int
    decoder_prompt_len: int
    # the step's token budgets with chunked prefill, each measured: a smaller one keeps the decoders' steps short
    # and makes the prompt take more steps (its time to first token against the decoders' p99)
    chunk_tokens: tuple[int, ...]
    alone_steps: int
    max_step_count: int  # steps one measurement may take at most

    @property
    def max_model_len(self) -> int:
        return max(self.prompt_lens) + self.tail_len + 16 * BLOCK_SIZE


def _shape(quick: bool) -> PrefillShape:
    if quick:
        return PrefillShape(["tiny-sdar"], [32, 64, 128], tail_len=8, decoders=3, decoder_prompt_len=8,
                            chunk_tokens=(32,), alone_steps=4, max_step_count=256)
    # 32,000 tokens: with the tail and a block of answer it stays inside SDAR's 32,768 positions
    return PrefillShape(["sdar-1.7b", "sdar-8b"], [2048, 8192, 32000], tail_len=256, decoders=32,
                        decoder_prompt_len=128, chunk_tokens=(512, 256, 128, 64), alone_steps=32, max_step_count=4096)


def _greedy(max_tokens: int) -> Any:
    from diffulex.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompt(engine: Any, length: int, seed: int) -> list[int]:
    from diffulex.bench.throughput import random_prompts

    return random_prompts(engine.vocab_limit, engine.mask_token_id, 1, length, seed)[0]


def _waiting(engine: Any, req_id: int) -> Any:
    return next(r for r in engine.scheduler.waiting if r.req_id == req_id)


def _context_before(req: Any, record: Any) -> int:
    """Tokens cached before the step, from where its query rows end: a prefix-cache hit is only matched while the
    step is scheduled, so the request's count read before ``step()`` misses it."""
    ids = record.running_block_ids
    if not ids:
        return 0
    return req.blocks[ids[0]].start + len(record.running_token_ids) - record.query_len


def time_to_first_token(
    engine: Any, prompt: list[int], max_tokens: int, max_steps: int, on_first_token: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Seconds from adding `prompt` (alone in the engine) to the step that accepts its first token, with the
    work of those steps; the request is then run to its end (`max_tokens`), so its blocks enter the prefix cache.
    ``on_first_token`` is called once the first token is on the host, before the steps that finish the request
    (a profiler stops there)."""
    from diffulex.bench.throughput import _step_work

    device = engine.device
    sync(device)
    t0 = time.perf_counter()
    req_id = engine.add_request(prompt, _greedy(max_tokens))
    req = _waiting(engine, req_id)
    records = []
    first = None
    for _ in range(max_steps):
        before = req.num_cached_tokens
        updates = engine.step()
        mine = [u for u in updates if u.req_id == req_id]
        records += [(req, u.record, max(before, _context_before(req, u.record)), req.num_cached_tokens)
                    for u in mine if u.record is not None]
        if any(u.finished or (u.record is not None and u.record.num_new_tokens > 0) for u in mine):
            first = time.perf_counter() - t0  # the token is on the host: what follows is not its wait
            break
    if on_first_token is not None:
        on_first_token()
    if first is None:
        engine.abort_request(req_id)
        raise RuntimeError(f"no token after {max_steps} steps")
    for _ in range(max_steps):  # to its end: its prompt's pages are kept for the prefix cache
        if req.is_finished:
            break
        engine.step()
    works = [_step_work([record], BLOCK_SIZE, engine.mask_token_id) for record in records]
    return {"ttft_s": first, "steps": len(records), "works": works}


def _floors(ctx: SweepContext, engine: Any, works: Sequence[Any]) -> dict[str, Any]:
    """Sums over the steps before the first token: floors, bytes, flops, rows computed."""
    from diffulex.bench.roofline import cost_model_from_module, step_bytes, step_floors, step_flops

    cost = cost_model_from_module(engine.model, torch.empty((), dtype=engine.dtype).element_size())
    flops_per_s = ctx.flops_per_s(engine.dtype)
    floors = [step_floors(cost, w, ctx.peaks.copy_bandwidth_bps, flops_per_s) for w in works]
    return {
        "query_tokens": sum(w.query_tokens for w in works),
        "attn_pairs": sum(w.attn_pairs for w in works),
        "flops": sum(step_flops(cost, w) for w in works),
        "bytes": sum(step_bytes(cost, w) for w in works),
        "compute_floor_ms": 1e3 * sum(f.compute_s for f in floors),
        "memory_floor_ms": 1e3 * sum(f.memory_s for f in floors),
        "floor_ms": 1e3 * sum(f.bound_s for f in floors),
    }


def _engine(ctx: SweepContext, model: str, shape: PrefillShape, **fields: Any) -> Any:
    from diffulex import Diffulex

    path, load_format = ctx.checkpoint(model)
    base = {"decoding_strategy": "multi_bd", "block_size": BLOCK_SIZE, "buffer_size": 1,
            "max_model_len": shape.max_model_len, "load_format": load_format, "seed": 0}
    return Diffulex(str(path), **ctx.engine_fields({**base, **fields}))


def _close(engine: Any) -> None:
    if engine is not None:
        with contextlib.suppress(Exception):
            engine.exit()


def measure_ttft(ctx: SweepContext, model: str, shape: PrefillShape) -> list[dict[str, Any]]:
    """Cold time to first token at each prompt length, then the prefix-cache hit on the longest prompt."""
    rows: list[dict[str, Any]] = []
    lengths = shape.prompt_lens
    engine = None
    try:
        engine = _engine(ctx, model, shape, max_num_reqs=4, max_num_batched_tokens=shape.max_model_len,
                         enable_prefix_caching=True)
    except Exception as err:
        failure = error_text(err)
        ctx.log(f"  {model}: engine failed: {failure}")
        _close(engine)
        return [{"model": model, "case": "cold", "prompt_len": n, "error": failure} for n in lengths]
    longest = None
    for k, n in enumerate(lengths):
        row: dict[str, Any] = {"model": model, "case": "cold", "prompt_len": n, "error": None}
        if ctx.budget.spent:
            rows.append(skipped(row))
            continue
        try:
            # warm-up: the same length, other tokens (no prefix hit); kernels for these shapes are then ready
            time_to_first_token(engine, _prompt(engine, n, 1000 + k), BLOCK_SIZE, shape.max_step_count)
            prompt = _prompt(engine, n, k)
            measured = time_to_first_token(engine, prompt, BLOCK_SIZE, shape.max_step_count)
            row |= {"ttft_ms": 1e3 * measured["ttft_s"], "steps": measured["steps"],
                    **_floors(ctx, engine, measured["works"])}
            row["x_compute_floor"] = row["ttft_ms"] / row["compute_floor_ms"]
            row["met"] = row["x_compute_floor"] <= TTFT_FLOOR_TARGET
            longest = (prompt, row) if n == max(lengths) else longest
            ctx.log(f"  {model} prompt {n}: TTFT {row['ttft_ms']:.1f} ms, compute floor "
                    f"{row['compute_floor_ms']:.1f} ms ({row['x_compute_floor']:.2f}x)")
        except Exception as err:
            row["error"] = error_text(err)
            ctx.log(f"  {model} prompt {n} failed: {row['error']}")
        rows.append(row)
    hit: dict[str, Any] = {"model": model, "case": "prefix hit", "prompt_len": max(lengths) + shape.tail_len,
                           "cached_len": max(lengths), "error": None}
    if longest is None or ctx.budget.spent:
        rows.append(skipped(hit) if longest is not None else {**hit, "error": "the cold run of the prompt failed"})
    else:
        try:
            prompt, cold = longest
            tail = _prompt(engine, shape.tail_len, 7)
            measured = time_to_first_token(engine, prompt + tail, BLOCK_SIZE, shape.max_step_count)
            hit |= {"ttft_ms": 1e3 * measured["ttft_s"], "steps": measured["steps"],
                    **_floors(ctx, engine, measured["works"])}
            # the rows computed say whether the prefix was a hit: the tail and its answer block, not the prompt
            hit["hit"] = hit["query_tokens"] < max(lengths)
            hit["x_tail_floor"] = hit["ttft_ms"] / hit["floor_ms"]
            hit["vs_cold"] = hit["ttft_ms"] / cold["ttft_ms"]
            ctx.log(f"  {model} prefix hit: TTFT {hit['ttft_ms']:.1f} ms ({hit['query_tokens']} rows computed), "
                    f"tail floor {hit['floor_ms']:.2f} ms, cold {cold['ttft_ms']:.1f} ms")
        except Exception as err:
            hit["error"] = error_text(err)
        rows.append(hit)
    _close(engine)
    return rows


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_beside_prefill(ctx: SweepContext, model: str, shape: PrefillShape, chunk_tokens: int) -> dict[str, Any]:
    """Decoders' step times alone, then beside a chunked prefill of the longest prompt (until its first token)."""
    from diffulex.bench.throughput import _admit_until_decoding, graphed_share, random_prompts, step_paths

    n = max(shape.prompt_lens)
    row: dict[str, Any] = {"model": model, "case": "beside chunked prefill", "prompt_len": n,
                           "decoders": shape.decoders, "chunk_tokens": chunk_tokens, "error": None}
    if ctx.budget.spent:
        return skipped(row)
    engine = None
    try:
        engine = _engine(ctx, model, shape, max_num_reqs=shape.decoders + 1, enable_chunked_prefill=True,
                         max_num_batched_tokens=chunk_tokens)
        prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, shape.decoders, shape.decoder_prompt_len,
                                 3)
        engine.generate(prompts, _greedy(2 * BLOCK_SIZE), use_tqdm=False)  # warm-up at this batch
        answer = shape.max_model_len - shape.decoder_prompt_len - BLOCK_SIZE
        ids = [engine.add_request(p, _greedy(answer)) for p in prompts]
        decoders = [_waiting(engine, i) for i in ids]
        _admit_until_decoding(engine, decoders, step_limit=4 * shape.decoders + 16)
        for _ in range(3):  # settle
            engine.step()

        def timed_step() -> tuple[float, list[Any]]:
            t = time.perf_counter()
            updates = engine.step()  # ends in the copy of its sampled tokens to the host: host time is device time
            return time.perf_counter() - t, updates

        sync(engine.device)
        paths = step_paths(engine)
        alone = [timed_step()[0] for _ in range(shape.alone_steps)]
        alone_paths = step_paths(engine)
        long_id = engine.add_request(_prompt(engine, n, 11), _greedy(BLOCK_SIZE))
        beside: list[float] = []
        for _ in range(shape.max_step_count):
            seconds, updates = timed_step()
            beside.append(seconds)
            if any(u.req_id == long_id and (u.finished or (u.record is not None and u.record.num_new_tokens > 0))
                   for u in updates):
                break
            if any(u.finished for u in updates):
                raise RuntimeError("a decoder finished during the measurement: raise max_model_len")
        else:
            raise RuntimeError(f"the long prompt had no token after {shape.max_step_count} steps")
        sync(engine.device)
        beside_share = graphed_share(alone_paths, step_paths(engine))
        for rid in [*ids, long_id]:
            engine.abort_request(rid)
        row |= {
            "alone_p50_ms": 1e3 * statistics.median(alone), "alone_p99_ms": 1e3 * _percentile(alone, 0.99),
            "beside_steps": len(beside), "beside_p50_ms": 1e3 * statistics.median(beside),
            "beside_p99_ms": 1e3 * _percentile(beside, 0.99), "beside_max_ms": 1e3 * max(beside),
            "prompt_ttft_ms": 1e3 * sum(beside),  # the long prompt's first token, taken in those steps
            # the share of the steps on the graph path (prefill graphs for the prompt's chunks, decode graphs)
            "alone_graphed_share": graphed_share(paths, alone_paths), "beside_graphed_share": beside_share,
        }
        row["p99_vs_alone"] = row["beside_p99_ms"] / row["alone_p50_ms"]
        row["met"] = row["p99_vs_alone"] <= BESIDE_PREFILL_TARGET
        ctx.log(f"  {model}: {shape.decoders} decoders alone p50 {row['alone_p50_ms']:.2f} ms; beside a {n}-token "
                f"chunked prefill ({len(beside)} steps) p50 {row['beside_p50_ms']:.2f}, p99 "
                f"{row['beside_p99_ms']:.2f} ms ({row['p99_vs_alone']:.2f}x)")
    except Exception as err:
        row["error"] = error_text(err)
        ctx.log(f"  {model} beside chunked prefill failed: {row['error']}")
    _close(engine)
    return row


def run_prefill(ctx: SweepContext) -> list[dict[str, Any]]:
    shape = _shape(ctx.quick)
    rows: list[dict[str, Any]] = []
    for model in shape.models:
        rows += measure_ttft(ctx, model, shape)
        release(ctx.device)
        for chunk_tokens in shape.chunk_tokens:
            rows.append(measure_beside_prefill(ctx, model, shape, chunk_tokens))
            release(ctx.device)
    return rows


def _status(row: Mapping[str, Any]) -> str | None:
    if row.get("error"):
        return f"error: {row['error']}"
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    return None


def prefill_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ["model", "case", "prompt tokens", "TTFT ms", "rows computed", "compute floor ms", "memory floor ms",
              "vs target", "met?"]
    body = []
    for r in rows:
        status = _status(r)
        if status:
            body.append([r["model"], r["case"], r["prompt_len"], status, *["-"] * 5])
        elif r["case"] == "cold":
            body.append([r["model"], "cold", r["prompt_len"], fmt(r["ttft_ms"], ".1f"), r["query_tokens"],
                         fmt(r["compute_floor_ms"], ".1f"), fmt(r["memory_floor_ms"], ".2f"),
                         f"{r['x_compute_floor']:.2f}x compute floor (<= 1.3x)", "yes" if r["met"] else "no"])
        elif r["case"] == "prefix hit":
            body.append([r["model"], f"prefix hit ({r['cached_len']} cached)", r["prompt_len"],
                         fmt(r["ttft_ms"], ".1f"), r["query_tokens"], fmt(r["compute_floor_ms"], ".2f"),
                         fmt(r["memory_floor_ms"], ".2f"),
                         f"{r['x_tail_floor']:.2f}x the uncached tail's floor; {r['vs_cold']:.3f}x cold",
                         "yes" if r["hit"] else "no hit"])
        else:
            body.append([r["model"], f"{r['decoders']} decoders beside a chunked prefill ({r['chunk_tokens']}-token "
                         "budget)", r["prompt_len"],
                         f"step p50/p99: alone {r['alone_p50_ms']:.2f} / {r['alone_p99_ms']:.2f}, beside "
                         f"{r['beside_p50_ms']:.2f} / {r['beside_p99_ms']:.2f}; the prompt's TTFT "
                         f"{r['prompt_ttft_ms']:.0f}; graphed {fmt(r.get('beside_graphed_share'), '.0%')}",
                         f"{r['beside_steps']} steps", "-",
                         "-", f"p99 {r['p99_vs_alone']:.2f}x alone (<= 2x)", "yes" if r["met"] else "no"])
    return markdown(header, body)


def plot_prefill(rows: Sequence[Mapping[str, Any]], title: str, path: Path) -> None:
    plt, fig, (ax_ttft, ax_beside) = plot_axes(2, title)
    for model in sorted({r["model"] for r in rows}):
        cold = sorted((r for r in rows if r["model"] == model and r["case"] == "cold" and not _status(r)),
                      key=lambda r: r["prompt_len"])
        if cold:
            x = [r["prompt_len"] for r in cold]
            line = ax_ttft.plot(x, [r["ttft_ms"] for r in cold], marker="o", label=f"{model} TTFT")
            ax_ttft.plot(x, [r["compute_floor_ms"] for r in cold], linestyle="--", color=line[0].get_color(),
                         label=f"{model} compute floor")
            for hit in (r for r in rows if r["model"] == model and r["case"] == "prefix hit" and not _status(r)):
                ax_ttft.scatter([hit["prompt_len"]], [hit["ttft_ms"]], marker="x", s=80, color=line[0].get_color(),
                                label=f"{model} prefix hit ({hit['cached_len']} cached)")
    ax_ttft.set_xscale("log", base=2)
    ax_ttft.set_yscale("log")
    ax_ttft.set_xlabel("prompt tokens")
    ax_ttft.set_ylabel("ms")
    ax_ttft.grid(True, alpha=0.3)
    ax_ttft.legend(fontsize=8)
    beside = [r for r in rows if r["case"] == "beside chunked prefill" and not _status(r)]
    labels = [r["model"] for r in beside]
    x = range(len(beside))
    for offset, (key, name) in enumerate([("alone_p50_ms", "alone p50"), ("alone_p99_ms", "alone p99"),
                                          ("beside_p50_ms", "beside p50"), ("beside_p99_ms", "beside p99")]):
        ax_beside.bar([i + 0.2 * offset for i in x], [r[key] for r in beside], width=0.2, label=name)
    ax_beside.set_xticks([i + 0.3 for i in x], labels)
    ax_beside.set_ylabel("decoders' step ms")
    ax_beside.legend(fontsize=8)
    save_figure(plt, fig, path)
