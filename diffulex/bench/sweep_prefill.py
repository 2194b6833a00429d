"""The ``prefill`` target of ``diffulex bench sweep``: long prompts.

* Time to first token of a 2k, 8k and 32k-token prompt (SDAR-1.7B and 8B geometries), one request, the whole
  prompt in one forward: from a device synchronization and ``add_request`` to the return of the step that
  accepts its first token (the token is then on the host), after an untimed warm-up prompt of the same length
  (other tokens, so no prefix-cache hit).
  Its floor is the sum over those steps of each step's larger floor, from the steps' own records: the compute
  floor counts the prompt's linear flops, the LM head over the sampled rows and attention's (query, key) pairs
  under the block-causal mask (`diffulex.bench.roofline.block_causal_pairs`).
* Decoders beside a chunked prefill (``enable_chunked_prefill``): 32 decoding requests, their step times alone,
  then while one 32k-token prompt is prefilled a chunk per step beside them, then alone again; p50/p99 of each
  phase and the prompt's time to first token, for each chunk setting: a fixed step token budget (the prompt takes
  the rows the decoders leave), or a cost budget (``max_prefill_chunk_cost``: the rows whose cost in row
  equivalents fits, fewer as the prompt's context grows, `diffulex.engine.prefill_cost`). One engine per model
  serves every setting, each with fresh decoders. The chunk steps' extra time is fitted to the cost model, which
  gives the parity context the hardware shows beside the one the model's sizes give.
* A prefix-cache hit: the 32k prompt again with a fresh tail; its time to first token against the floor of the
  rows it computed (the uncached tail, attending to the cached prefix) and against the cold prompt's. It meets
  the target ("no more than the uncached tail's cost") within the allowance a cold prompt has over its floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from diffulex.engine.prefill_cost import PrefillCostModel

TTFT_FLOOR_TARGET = 1.3  # time to first token <= 1.3x the compute floor of the prompt's forward
BESIDE_PREFILL_TARGET = 2.0  # decoders' p99 step beside a chunked prefill <= 2x their step alone
BLOCK_SIZE = 4
LONG_PROMPT_SEED_OFFSET = 1000  # the long prompt's seed beside the decoders', so that they share no prefix
# the long prompt's answer: it decodes among the decoders for a few blocks once it has its first token
LONG_ANSWER_TOKENS = 16 * BLOCK_SIZE


@dataclass(frozen=True)
class ChunkSetting:
    """How a long prompt beside decoders is cut: the step's token budget (``max_num_batched_tokens``: the prompt
    takes the rows the decoders leave, within the largest prefill graph), and a cost budget in row equivalents
    (``max_prefill_chunk_cost``; 0: none)."""

    token_budget: int
    cost_budget: int = 0

    @property
    def label(self) -> str:
        if self.cost_budget:
            return f"cost budget {self.cost_budget} row equivalents"
        return f"{self.token_budget}-token budget"


@dataclass(frozen=True)
class PrefillShape:
    models: list[str]
    prompt_lens: list[int]
    tail_len: int  # tokens after the cached prompt in the prefix-hit request
    decoders: int
    decoder_prompt_len: int
    # the chunk settings measured beside the decoders: a smaller budget keeps their steps short and makes the
    # prompt take more steps (its time to first token against the decoders' p99)
    chunk_settings: tuple[ChunkSetting, ...]
    alone_steps: int
    max_step_count: int  # steps one measurement may take at most
    # timed prompts per cold length and prefix hits, each with tokens of its own: the median is reported. One timing
    # alone is not a number: on an H100 one 2,048-token prompt after its warm-up took 27, 83, 29, 24, 24 ms in turn
    ttft_repeats: int = 5

    @property
    def max_model_len(self) -> int:
        return max(self.prompt_lens) + self.tail_len + 16 * BLOCK_SIZE


def _shape(quick: bool) -> PrefillShape:
    if quick:
        return PrefillShape(["tiny-sdar"], [32, 64, 128], tail_len=8, decoders=3, decoder_prompt_len=8,
                            chunk_settings=(ChunkSetting(32), ChunkSetting(64, 24)), alone_steps=4,
                            max_step_count=256, ttft_repeats=2)
    # 32,000 tokens: with the tail and a block of answer it stays inside SDAR's 32,768 positions. The decoders take
    # 128 to 256 rows a step (a block each, and the block they finished): a 256-token budget leaves the prompt up to
    # 128 rows (the last measured fixed budget, 6.45x alone at 1.7B); the cost budgets leave it up to 512 (the
    # largest prefill graph) at the start of the prompt and what its cost allows later.
    settings = (ChunkSetting(256), ChunkSetting(1024, 128), ChunkSetting(1024, 64), ChunkSetting(1024, 256),
                ChunkSetting(1024, 32))
    return PrefillShape(["sdar-1.7b", "sdar-8b"], [2048, 8192, 32000], tail_len=256, decoders=32,
                        decoder_prompt_len=128, chunk_settings=settings, alone_steps=32, max_step_count=4096)


def _greedy(max_tokens: int) -> Any:
    from diffulex.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompt(engine: Any, length: int, seed: int) -> list[int]:
    from diffulex.bench.throughput import random_prompts

    return random_prompts(engine.vocab_limit, engine.mask_token_id, 1, length, seed)[0]


def median_time_to_first_token(
    engine: Any, prompts: Sequence[list[int]], max_tokens: int, max_steps: int
) -> tuple[dict[str, Any], list[float]]:
    """`time_to_first_token` of each prompt in turn: the measurement whose time is the median (the lower middle one
    of an even count), and every time in seconds, in order."""
    runs = [time_to_first_token(engine, prompt, max_tokens, max_steps) for prompt in prompts]
    ordered = sorted(runs, key=lambda run: run["ttft_s"])
    return ordered[(len(ordered) - 1) // 2], [run["ttft_s"] for run in runs]


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
            prompts = [_prompt(engine, n, k + 100 * r) for r in range(shape.ttft_repeats)]
            measured, times = median_time_to_first_token(engine, prompts, BLOCK_SIZE, shape.max_step_count)
            prompt = prompts[-1]  # the latest cached: the prefix hit below reuses it
            row |= {"ttft_ms": 1e3 * measured["ttft_s"], "ttft_runs_ms": [1e3 * t for t in times],
                    "steps": measured["steps"], **_floors(ctx, engine, measured["works"])}
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
            hits = [prompt + _prompt(engine, shape.tail_len, 7 + r) for r in range(shape.ttft_repeats)]
            measured, times = median_time_to_first_token(engine, hits, BLOCK_SIZE, shape.max_step_count)
            hit |= {"ttft_ms": 1e3 * measured["ttft_s"], "ttft_runs_ms": [1e3 * t for t in times],
                    "steps": measured["steps"], **_floors(ctx, engine, measured["works"])}
            # the rows computed say whether the prefix was a hit: the tail and its answer block, not the prompt
            hit["hit"] = hit["query_tokens"] < max(lengths)
            hit["x_tail_floor"] = hit["ttft_ms"] / hit["floor_ms"]
            # the uncached tail's cost: its forward's floor with a cold prompt's allowance (`TTFT_FLOOR_TARGET`)
            hit["met"] = hit["hit"] and hit["x_tail_floor"] <= TTFT_FLOOR_TARGET
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


def _beside_row(model: str, shape: PrefillShape, setting: ChunkSetting) -> dict[str, Any]:
    return {"model": model, "case": "beside chunked prefill", "prompt_len": max(shape.prompt_lens),
            "decoders": shape.decoders, "chunk_tokens": setting.token_budget, "chunk_cost": setting.cost_budget,
            "error": None}


def measure_beside_prefill(ctx: SweepContext, model: str, shape: PrefillShape) -> list[dict[str, Any]]:
    """One engine, one row per chunk setting (`PrefillShape.chunk_settings`): the decoders' steps alone, beside a
    chunked prefill of the longest prompt (until its first token), and alone again."""
    rows = [_beside_row(model, shape, setting) for setting in shape.chunk_settings]
    if ctx.budget.spent:
        return [skipped(row) for row in rows]
    engine = None
    try:
        # the largest token budget, and a cost budget so that the engine prices rows: each setting then sets the
        # scheduler's limits as those two engine fields would (the memory plan is max_model_len's either way)
        engine = _engine(ctx, model, shape, max_num_reqs=shape.decoders + 1, enable_chunked_prefill=True,
                         max_num_batched_tokens=max(s.token_budget for s in shape.chunk_settings),
                         max_prefill_chunk_cost=max(max(s.cost_budget for s in shape.chunk_settings), 1))
        cost_model = engine.scheduler.limits.prefill_cost_model  # None where an engine flag turned the cost off
        parity = None if cost_model is None else cost_model.parity_context
        warm_up = random_decoder_prompts(engine, shape, 3)
        engine.generate(warm_up, _greedy(2 * BLOCK_SIZE), use_tqdm=False)  # warm-up at this batch
    except Exception as err:
        failure = error_text(err)
        ctx.log(f"  {model} beside chunked prefill: engine failed: {failure}")
        _close(engine)
        return [{**row, "error": failure} for row in rows]
    for k, (setting, row) in enumerate(zip(shape.chunk_settings, rows, strict=True)):
        if ctx.budget.spent:
            rows[k] = skipped(row)
            continue
        try:
            row |= _beside_one_setting(engine, shape, setting, seed=100 + k)
            row["parity_context"] = parity
            row["met"] = row["p99_vs_alone"] <= BESIDE_PREFILL_TARGET
            fit = row["chunk_cost_fit"]
            ctx.log(f"  {model} {setting.label}: {shape.decoders} decoders alone p50 {row['alone_p50_ms']:.2f} ms; "
                    f"beside a {row['prompt_len']}-token chunked prefill ({row['beside_steps']} steps, chunks "
                    f"{row['first_chunk_rows']} -> {row['last_chunk_rows']} rows) p50 {row['beside_p50_ms']:.2f}, "
                    f"p99 {row['beside_p99_ms']:.2f} ms ({row['p99_vs_alone']:.2f}x alone at the same point); "
                    f"the prompt's TTFT {row['prompt_ttft_ms']:.0f} ms; fitted parity "
                    f"{fmt(fit.get('parity_context'), '.0f')} (config {fmt(parity, '.0f')})")
        except Exception as err:
            row["error"] = error_text(err)
            ctx.log(f"  {model} {setting.label} failed: {row['error']}")
    _close(engine)
    return rows


def random_decoder_prompts(engine: Any, shape: PrefillShape, seed: int) -> list[list[int]]:
    from diffulex.bench.throughput import random_prompts

    return random_prompts(engine.vocab_limit, engine.mask_token_id, shape.decoders, shape.decoder_prompt_len, seed)


def _beside_one_setting(engine: Any, shape: PrefillShape, setting: ChunkSetting, seed: int) -> dict[str, Any]:
    """Fresh decoders (so that every setting starts from the same contexts), alone, beside the long prompt, joined
    by it (its answer decoding among them, up to ``alone_steps`` steps), alone again. Each beside step is compared
    with the alone step time at the same point, interpolated between the two alone phases: the decoders' contexts
    grow by about a token a step, which over a long prefill slows their steps by itself."""
    from diffulex.bench.throughput import _admit_until_decoding, graphed_share, step_paths

    limits = engine.scheduler.limits
    engine.scheduler.limits = dataclasses.replace(limits, max_num_batched_tokens=setting.token_budget,
                                                  max_prefill_chunk_cost=setting.cost_budget)
    answer = shape.max_model_len - shape.decoder_prompt_len - BLOCK_SIZE
    ids = [engine.add_request(p, _greedy(answer)) for p in random_decoder_prompts(engine, shape, seed)]
    long_id = None
    try:
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
        before = [timed_step()[0] for _ in range(shape.alone_steps)]
        alone_paths = step_paths(engine)
        # another seed than the decoders': the same one would start the prompt with the first decoder's tokens
        long_id = engine.add_request(_prompt(engine, max(shape.prompt_lens), seed + LONG_PROMPT_SEED_OFFSET),
                                     _greedy(LONG_ANSWER_TOKENS))
        long = _waiting(engine, long_id)
        beside: list[float] = []
        chunks: list[tuple[int, int]] = []  # (context before, prompt rows) of each beside step
        for _ in range(shape.max_step_count):
            cached = long.num_cached_tokens
            seconds, updates = timed_step()
            beside.append(seconds)
            chunks.append((cached, max(long.num_cached_tokens - cached, 0)))
            if any(u.finished for u in updates if u.req_id != long_id):
                raise RuntimeError("a decoder finished during the measurement: raise max_model_len")
            long_finished = any(u.finished for u in updates if u.req_id == long_id)
            if long_finished or any(u.req_id == long_id and u.record is not None and u.record.num_new_tokens > 0
                                    for u in updates):
                break
        else:
            raise RuntimeError(f"the long prompt had no token after {shape.max_step_count} steps")
        beside_paths = step_paths(engine)
        joined: list[float] = []
        while not long_finished and len(joined) < shape.alone_steps:
            seconds, updates = timed_step()
            joined.append(seconds)
            long_finished = any(u.finished for u in updates if u.req_id == long_id)
        joined_paths = step_paths(engine)
        engine.abort_request(long_id)
        after = [timed_step()[0] for _ in range(shape.alone_steps)]
        sync(engine.device)
    finally:
        for rid in ids if long_id is None else [*ids, long_id]:
            engine.abort_request(rid)
        engine.scheduler.limits = limits
    return beside_summary(before, beside, after, chunks, engine.scheduler.limits.prefill_cost_model, joined) | {
        "alone_graphed_share": graphed_share(paths, alone_paths),
        "beside_graphed_share": graphed_share(alone_paths, beside_paths),
        "joined_graphed_share": graphed_share(beside_paths, joined_paths),
    }


def beside_summary(before: Sequence[float], beside: Sequence[float], after: Sequence[float],
                   chunks: Sequence[tuple[int, int]], cost_model: PrefillCostModel | None,
                   joined: Sequence[float] = ()) -> dict[str, Any]:
    """The decoders' step times (seconds) alone before, beside the prefill, joined by the prompt's decoding
    (``joined``) and alone after, as milliseconds: each beside step against the alone p50 at its point
    (interpolated between the two alone phases), the joined steps' p50 against the alone p50 after, the prompt's
    time to first token, its chunk rows, and the fit of the chunk steps' extra time to the cost model."""
    alone_before, alone_after = statistics.median(before), statistics.median(after)
    n = len(beside)
    reference = [alone_before + (alone_after - alone_before) * (i + 0.5) / n for i in range(n)]
    ratios = [t / ref for t, ref in zip(beside, reference, strict=True)]
    computed = [rows for _, rows in chunks if rows > 0]
    summary = {
        "alone_p50_ms": 1e3 * alone_before, "alone_p99_ms": 1e3 * _percentile(before, 0.99),
        "alone_after_p50_ms": 1e3 * alone_after, "alone_after_p99_ms": 1e3 * _percentile(after, 0.99),
        "beside_steps": n, "beside_p50_ms": 1e3 * statistics.median(beside),
        "beside_p99_ms": 1e3 * _percentile(beside, 0.99), "beside_max_ms": 1e3 * max(beside),
        "prompt_ttft_ms": 1e3 * sum(beside),  # the long prompt's first token, taken in those steps
        "joined_steps": len(joined),
        "joined_p50_ms": 1e3 * statistics.median(joined) if joined else None,
        "joined_p99_ms": 1e3 * _percentile(joined, 0.99) if joined else None,
        "joined_vs_alone": statistics.median(joined) / alone_after if joined else None,
        "p99_vs_alone": _percentile(ratios, 0.99),
        "first_chunk_rows": computed[0] if computed else 0, "last_chunk_rows": computed[-1] if computed else 0,
        "chunks": [[context, rows] for context, rows in chunks if rows > 0],  # (context before, prompt rows)
        "chunk_cost_fit": fit_chunk_cost(
            [(c, r, t - ref) for (c, r), t, ref in zip(chunks, beside, reference, strict=True) if r > 0], cost_model
        ),
    }
    return summary


def fit_chunk_cost(points: Sequence[tuple[int, int, float]], cost_model: PrefillCostModel | None) -> dict[str, Any]:
    """Least squares of a chunk step's extra seconds over ``fixed + per_row * R + per_row_key * R * (C + R / 2)``
    for its ``R`` prompt rows after ``C`` cached tokens: ``fixed`` is what carrying a chunk costs whatever its size
    (the prompt rows' own forward reads every weight once), and ``per_row / per_row_key`` the parity context the
    hardware shows, beside the model's (`diffulex.engine.prefill_cost`). Also the extra time per row equivalent
    in the first and the last third of the prompt: equal when the cost model prices late rows right."""
    if len(points) < 4:
        return {"points": len(points)}
    design = torch.tensor([[1.0, r, r * (c + r / 2)] for c, r, _ in points], dtype=torch.float64)
    extra = torch.tensor([[t] for _, _, t in points], dtype=torch.float64)
    fixed, per_row, per_row_key = torch.linalg.lstsq(design, extra).solution.flatten().tolist()
    fit: dict[str, Any] = {"points": len(points), "fixed_ms": 1e3 * fixed, "per_row_us": 1e6 * per_row,
                           "per_row_key_ns": 1e9 * per_row_key,
                           "parity_context": per_row / per_row_key if per_row > 0 and per_row_key > 0 else None}
    if cost_model is not None:
        third = max(len(points) // 3, 1)
        for name, part in (("early", points[:third]), ("late", points[-third:])):
            cost = sum(cost_model.rows_cost(r, c) for c, r, _ in part)
            fit[f"{name}_us_per_row_equivalent"] = 1e6 * sum(t for _, _, t in part) / cost
    return fit


def run_prefill(ctx: SweepContext) -> list[dict[str, Any]]:
    shape = _shape(ctx.quick)
    rows: list[dict[str, Any]] = []
    parts = ctx.settings.prefill_parts
    for model in shape.models:
        if "ttft" in parts:
            rows += measure_ttft(ctx, model, shape)
            release(ctx.device)
        if "beside" in parts:
            rows += measure_beside_prefill(ctx, model, shape)
            release(ctx.device)
    return rows


def _status(row: Mapping[str, Any]) -> str | None:
    if row.get("error"):
        return f"error: {row['error']}"
    if row.get("skipped"):
        return f"skipped: {row['skipped']}"
    return None


def _beside_case(row: Mapping[str, Any]) -> str:
    setting = ChunkSetting(row["chunk_tokens"], row.get("chunk_cost", 0))
    return f"{row['decoders']} decoders beside a chunked prefill ({setting.label})"


def prefill_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ["model", "case", "prompt tokens", "TTFT ms", "rows computed", "compute floor ms", "memory floor ms",
              "vs target", "met?"]
    body = []
    for r in rows:
        status = _status(r)
        if status:
            case = _beside_case(r) if r["case"] == "beside chunked prefill" else r["case"]
            body.append([r["model"], case, r["prompt_len"], status, *["-"] * 5])
        elif r["case"] == "cold":
            body.append([r["model"], "cold", r["prompt_len"], fmt(r["ttft_ms"], ".1f"), r["query_tokens"],
                         fmt(r["compute_floor_ms"], ".1f"), fmt(r["memory_floor_ms"], ".2f"),
                         f"{r['x_compute_floor']:.2f}x compute floor (<= 1.3x)", "yes" if r["met"] else "no"])
        elif r["case"] == "prefix hit":
            body.append([r["model"], f"prefix hit ({r['cached_len']} cached)", r["prompt_len"],
                         fmt(r["ttft_ms"], ".1f"), r["query_tokens"], fmt(r["compute_floor_ms"], ".2f"),
                         fmt(r["memory_floor_ms"], ".2f"),
                         f"{r['x_tail_floor']:.2f}x the uncached tail's floor; {r['vs_cold']:.3f}x cold",
                         ("yes" if r["met"] else "no") if r["hit"] else "no hit"])
        else:
            fit = r.get("chunk_cost_fit") or {}
            body.append([r["model"], _beside_case(r), r["prompt_len"],
                         f"step p50/p99: alone {r['alone_p50_ms']:.2f} / {r['alone_p99_ms']:.2f} (after: "
                         f"{r['alone_after_p50_ms']:.2f} / {r['alone_after_p99_ms']:.2f}), beside "
                         f"{r['beside_p50_ms']:.2f} / {r['beside_p99_ms']:.2f}, joined by the prompt's decoding "
                         f"{fmt(r.get('joined_p50_ms'))} / {fmt(r.get('joined_p99_ms'))} "
                         f"({fmt(r.get('joined_vs_alone'))}x alone after); the prompt's TTFT "
                         f"{r['prompt_ttft_ms']:.0f}; chunks {r['first_chunk_rows']} -> {r['last_chunk_rows']} rows; "
                         f"chunk steps' extra time: {fmt(fit.get('fixed_ms'))} ms each + parity "
                         f"{fmt(fit.get('parity_context'), '.0f')} (config {fmt(r['parity_context'], '.0f')}); graphed "
                         f"{fmt(r.get('beside_graphed_share'), '.0%')}",
                         f"{r['beside_steps']} steps", "-",
                         "-", f"p99 {r['p99_vs_alone']:.2f}x alone at the same point (<= 2x)",
                         "yes" if r["met"] else "no"])
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
    labels = [f"{r['model']}\n{ChunkSetting(r['chunk_tokens'], r.get('chunk_cost', 0)).label}" for r in beside]
    x = range(len(beside))
    for offset, (key, name) in enumerate([("alone_p50_ms", "alone p50"), ("alone_p99_ms", "alone p99"),
                                          ("beside_p50_ms", "beside p50"), ("beside_p99_ms", "beside p99")]):
        ax_beside.bar([i + 0.2 * offset for i in x], [r[key] for r in beside], width=0.2, label=name)
    ax_beside.set_xticks([i + 0.3 for i in x], labels)
    ax_beside.set_ylabel("decoders' step ms")
    ax_beside.legend(fontsize=8)
    save_figure(plt, fig, path)
