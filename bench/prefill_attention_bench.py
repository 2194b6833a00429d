"""A prompt's attention alone: the long-query tile class against the 64-row class it replaces, and candidate shapes
of the long class, against the flops floor.

    PYTHONPATH=. python bench/prefill_attention_bench.py OUT_DIR [--lengths 2048 8192 32000] [--chunks 30000:2048]
        [--page-size 32] [--quick]

For the SDAR-1.7B (16 query heads, 8 KV heads) and SDAR-8B (32, 8) head layouts, head_dim 128, bf16, block 4: one
cold prompt of each length and a chunk of a prompt after a cached prefix (``CACHED:ROWS``, keys read through
shuffled pages of 32 (the engine's default page size; `--page-size`), as a chunked prefill's), one launch of one
layer's paged attention (block-causal), timed replayed from a CUDA graph after a warm-up launch that compiles the
variant. Its floor is the block-causal (query, key) pairs' flops (``4 x heads x head_dim`` per pair, cached keys
included, as `diffulex.bench.roofline` counts them) over the measured bf16 matmul rate. Every configuration's output
is checked on the first case against the PyTorch reference (`diffulex.attention.torch_paged`, float32); one that
fails it or fails to launch is reported and not kept.

Writes ``OUT_DIR/prefill_attention.json`` and prints a table and the configuration to keep: the lowest geometric
mean of time over floor across the cases. ``--quick`` runs tiny shapes (on the CPU under the Triton interpreter),
to check the script itself; its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

if "--quick" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

BLOCK_SIZE = 4
HEAD_LAYOUTS = {"sdar-1.7b": (16, 8), "sdar-8b": (32, 8)}
QUICK_HEAD_LAYOUTS = {"tiny 4/2": (4, 2)}
HEAD_DIM, QUICK_HEAD_DIM = 128, 16
LENGTHS, QUICK_LENGTHS = (2048, 8192, 32000), (160, 300)
CHUNKS, QUICK_CHUNKS = ("30000:2048", "32000:260"), ("200:130",)  # CACHED:ROWS (the second: a prefix hit's tail)
PAGE_SIZE = 32  # the engine's default (`page_size`); --page-size for another
BEFORE = "64-row class (before)"
TOLERANCE = 2e-2  # bf16 outputs against the float32 reference


def candidates() -> dict[str, object]:
    """Name -> the long class's tiles (None: the long class off, every long query in 64-row tiles)."""
    from diffulex.kernels.paged_attention import LongQueryTiles

    # compiled for sm_90 (triton's ptxas): 128x64 in 8 warps uses ~220 registers and no spill at 2-4 stages,
    # 128x128 spills a little, 128 rows in 4 warps spill heavily (not tried); 256 rows in 16 warps: a program holds
    # twice the positions, so a short tail over a long cached context (a prefix hit) reads the cached keys half as
    # often
    shapes = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2),
              (256, 64, 16, 2)]  # fmt: skip
    out: dict[str, object] = {BEFORE: None}
    for rows, block_n, warps, stages in shapes:
        out[f"long {rows}x{block_n}, {warps} warps, {stages} stages"] = LongQueryTiles(rows, block_n, warps, stages)
    return out


@contextlib.contextmanager
def long_class(tiles) -> Iterator[None]:
    """Launches inside take `tiles` as the long-query class (None: no long-query class)."""
    from diffulex.kernels import paged_attention as pa

    saved = pa._LONG_QUERY_TILES, pa._LONG_QUERY_MIN
    if tiles is None:
        pa._LONG_QUERY_MIN = sys.maxsize
    else:
        pa._LONG_QUERY_TILES = tiles
    try:
        yield
    finally:
        pa._LONG_QUERY_TILES, pa._LONG_QUERY_MIN = saved


def prompt_inputs(cached: int, length: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device, page_size: int = PAGE_SIZE):  # fmt: skip
    """q/k/v of `length` prompt rows after `cached` cached positions (in shuffled pages of a random cache), and
    their metadata (block-causal). As in the engine, q and k are tensors of their own (the rotary kernel writes
    them) and v is a view of the fused q/k/v projection's output, its rows as far apart as every head's."""
    from diffulex.attention.metadata import PagedAttentionMetadata

    gen = torch.Generator(device=device).manual_seed(cached + length)
    q = torch.randn(length, heads, head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(length, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    fused = torch.randn(length, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype, generator=gen)
    v = fused[:, (heads + kv_heads) * head_dim :].unflatten(1, (kv_heads, head_dim))
    pages = max(1, -(-(cached + length) // page_size))
    cache = torch.randn(pages, page_size, kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
    table = torch.randperm(pages, device=device, generator=gen).to(torch.int32)[None]
    slots = table[0].long().repeat_interleave(page_size) * page_size + torch.arange(page_size, device=device).repeat(
        pages
    )
    meta = PagedAttentionMetadata(
        cu_seqlens_q=torch.tensor([0, length], dtype=torch.int32, device=device),
        context_lens=torch.full((1,), cached, dtype=torch.int32, device=device),
        prefix_lens=torch.full((1,), cached + length, dtype=torch.int32, device=device),
        page_tables=table,
        slot_mapping=slots[cached : cached + length],
        block_size=BLOCK_SIZE,
        page_size=page_size,
        prefix_full=False,
        query_lens_cpu=[length],
        context_lens_cpu=[cached],
        prefix_lens_cpu=[cached + length],
    )
    return q, k, v, cache, meta


def seconds_per_launch(fn, device: torch.device, length: int) -> float:
    """Seconds per launch after one that compiles the variant: on a GPU, up to 20 launches captured in a CUDA graph
    and replayed (the kernel's time, as a prefill graph launches it: at 2,048 tokens an eager launch's host work
    would be timed instead); elsewhere one launch (the interpreter is slow, and its time means nothing)."""
    from diffulex.bench.hardware import time_graph_calls, time_per_call

    if device.type == "cuda":
        return time_graph_calls(lambda i: fn(), max(2, min(20, 40_000 // length)), warmup=1) / 1e6
    return time_per_call(fn, device, 1, warmup=1)


def measure_case(layout: str, heads: int, kv_heads: int, head_dim: int, cached: int, length: int, check: bool,
                 configs, dtype: torch.dtype, device: torch.device, flops_per_s: float, log=print,
                 page_size: int = PAGE_SIZE) -> list[dict[str, object]]:  # fmt: skip
    """Every configuration on one prompt (`length` rows after `cached` positions); with `check`, each output
    against the float32 reference."""
    from diffulex.attention.torch_paged import paged_attention
    from diffulex.bench.hardware import time_checked_config
    from diffulex.bench.roofline import block_causal_pairs
    from diffulex.kernels.paged_attention import triton_paged_attention

    q, k, v, cache, meta = prompt_inputs(cached, length, heads, kv_heads, head_dim, dtype, device, page_size)
    scale = head_dim**-0.5
    flops = 4 * heads * head_dim * block_causal_pairs(cached, cached + length, BLOCK_SIZE)
    expected = None
    if check:
        expected = paged_attention(q.float(), k.float(), v.float(), cache.float(), cache.float(), meta, scale)
    out = torch.empty_like(q)
    launch = functools.partial(triton_paged_attention, q, k, v, cache, cache, meta, scale, out=out)
    rows: list[dict[str, object]] = []
    for name, tiles in configs.items():
        case = f"{length}" if cached == 0 else f"{length} after {cached}"
        row: dict[str, object] = {"heads": layout, "case": case, "cached": cached, "rows": length, "config": name,
                                  "error": None}  # fmt: skip
        try:
            with long_class(tiles):
                row |= time_checked_config(lambda: seconds_per_launch(launch, device, length), out, expected, flops,
                                           flops_per_s, TOLERANCE)  # fmt: skip
            log(f"  {layout:10s} {case:>16s} {name:36s} {row['ms']:9.3f} ms  {row['tflops']:6.1f} TFLOP/s  "
                f"{row['x_floor']:5.2f}x floor")
        except Exception as err:  # noqa: BLE001  (a config that cannot launch is reported, not kept)
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            log(f"  {layout:10s} {case:>16s} {name:36s} failed: {row['error']}")
        rows.append(row)
    return rows


def measure(quick: bool, cases: list[tuple[int, int]], log=print, page_size: int = PAGE_SIZE) -> dict[str, object]:
    from diffulex.bench.hardware import measure_matmul_throughput

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layouts = QUICK_HEAD_LAYOUTS if quick else HEAD_LAYOUTS
    head_dim = QUICK_HEAD_DIM if quick else HEAD_DIM
    flops_per_s = measure_matmul_throughput(device, dtype, 512 if quick else 8192, 3 if quick else 20)
    log(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}: {dtype} matmul "
        f"{flops_per_s / 1e12:.1f} TFLOP/s")
    configs = candidates()
    rows: list[dict[str, object]] = []
    for layout, (heads, kv_heads) in layouts.items():
        for i, (cached, length) in enumerate(cases):
            rows += measure_case(layout, heads, kv_heads, head_dim, cached, length, i == 0, configs, dtype, device,
                                 flops_per_s, log, page_size)  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"device": str(device), "dtype": str(dtype), "matmul_TFLOPs": flops_per_s / 1e12, "head_dim": head_dim,
            "block_size": BLOCK_SIZE, "page_size": page_size, "rows": rows, **choose(rows, list(configs))}


def choose(rows: list[dict[str, object]], names: list[str]) -> dict[str, object]:
    """The configuration with the lowest geometric mean of time over floor, among those that ran every case."""
    cases = {(r["heads"], r["case"]) for r in rows}
    score: dict[str, float] = {}
    for name in names:
        mine = [r for r in rows if r["config"] == name and not r["error"]]
        if len(mine) == len(cases):
            score[name] = math.exp(sum(math.log(r["x_floor"]) for r in mine) / len(mine))
    if not score:
        raise RuntimeError("no configuration ran every case")
    keep = min(score, key=score.__getitem__)
    best = {}
    for heads, case in sorted(cases):
        ran = [r for r in rows if (r["heads"], r["case"]) == (heads, case) and not r["error"]]
        if ran:
            best[f"{heads} {case}"] = min(ran, key=lambda r: r["x_floor"])["config"]
    return {"geomean_x_floor": score, "keep": keep, "speedup_vs_before": score.get(BEFORE, math.nan) / score[keep],
            "fastest_per_case": best}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="cold prompts")
    ap.add_argument("--chunks", nargs="*", default=None, help="CACHED:ROWS prompt chunks after a cached prefix")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, any device: checks the script, not speed")
    ap.add_argument("--page-size", type=int, default=PAGE_SIZE, help="tokens a cache page holds (the cached keys' "
                    "gather)")
    args = ap.parse_args()
    if not args.quick and not torch.cuda.is_available():
        print("prefill_attention_bench: no CUDA device (the timings need a GPU; --quick checks the script on a CPU)",
              file=sys.stderr)
        return 2
    lengths = args.lengths or list(QUICK_LENGTHS if args.quick else LENGTHS)
    chunks = args.chunks if args.chunks is not None else list(QUICK_CHUNKS if args.quick else CHUNKS)
    try:
        cases = [(0, n) for n in lengths] + [tuple(int(x) for x in c.split(":")) for c in chunks]
    except ValueError:
        ap.error(f"--chunks {' '.join(chunks)} is invalid: each must be CACHED:ROWS, two integers")
    if any(len(c) != 2 or c[0] < 0 or c[1] < 1 for c in cases):
        ap.error(f"--lengths / --chunks {cases} are invalid: rows must be >= 1 and cached positions >= 0")
    t0 = time.perf_counter()
    report = measure(args.quick, cases, page_size=args.page_size)
    report["seconds"] = time.perf_counter() - t0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "prefill_attention.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print("geometric mean of time / floor:")
    for name, value in sorted(report["geomean_x_floor"].items(), key=lambda kv: kv[1]):
        print(f"  {value:6.3f}x  {name}")
    for case, name in report["fastest_per_case"].items():
        print(f"  fastest at {case}: {name}")
    print(f"keep: {report['keep']} ({report['speedup_vs_before']:.2f}x faster than the {BEFORE}); wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
