"""Paged attention with DiffusionGemma's wide heads alone: the long-query class's wide-head tiles against the
decode-sized tiles they replace, and candidate shapes, against the flops floor.

    PYTHONPATH=. python bench/wide_head_attention_bench.py OUT_DIR [--batch-sizes 1 8] [--context 512]
        [--prompt 2048] [--quick]

For DiffusionGemma-26B-A4B's two layer kinds (sliding: 16 query heads over 8 KV heads of 256, a window of 1,024; full:
16 over 2 KV heads of 512), bf16, pages of one canvas (256 positions, as the engine's): the decoder's launch
(`--batch-sizes` canvases of 256 rows, each after `--context` cached positions, every row seeing the whole canvas and
the last ``window - 1`` cached positions) and the encoder's (one causal prompt of `--prompt` positions, its K/V in the
step's new keys), one launch of one layer, timed replayed from a CUDA graph after a warm-up launch that compiles the
variant. Launches are split as the engine makes them (a canvas's keys unsplit, `DECODER_SPLITS` of
`diffulex.strategy.diffusion_gemma.runner`; a prompt's as the kernel chooses), and the decode-sized tiles also with
2-4 forced splits. Its floor is the visible (query, key) pairs' flops (``4 x heads x head_dim`` per pair) over the
measured bf16 matmul rate. Every configuration's output is checked against the PyTorch reference
(`diffulex.attention.torch_paged`, float32) on each layer kind's first case; one that fails it or fails to launch
(shared memory, registers) is reported and not kept.

Writes ``OUT_DIR/wide_head_attention.json`` and prints a table and, per head width, the configuration with the
lowest geometric mean of time over floor across its cases (`kernels.paged_attention._WIDE_LONG_QUERY_TILES` holds
the kept ones). ``--quick`` runs tiny shapes (on the CPU under the Triton interpreter) to check the script itself;
its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

if "--quick" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

TOLERANCE = 2e-2  # bf16 outputs against the float32 reference
BEFORE = "decode-sized tiles (before)"


@dataclass(frozen=True)
class LayerKind:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int  # 0: full attention


LAYERS = (LayerKind("sliding", 16, 8, 256, 1024), LayerKind("full", 16, 2, 512, 0))
QUICK_LAYERS = (LayerKind("sliding", 2, 1, 256, 48), LayerKind("full", 2, 1, 512, 0))
CANVAS, QUICK_CANVAS = 256, 128
# (rows, block_n, warps, stages) per head width; the first of each is the kept default's neighbourhood
SHAPES = {
    256: [(64, 64, 8, 2), (64, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (32, 64, 4, 2)],
    512: [(64, 32, 8, 2), (64, 32, 8, 3), (32, 64, 8, 2), (32, 32, 4, 2), (64, 16, 8, 2)],
}  # fmt: skip
QUICK_SHAPES = {256: [(64, 64, 8, 2)], 512: [(32, 32, 8, 2)]}


# split counts forced on the decode-sized tiles, against the engine's unsplit canvases
SPLITS, QUICK_SPLITS = (2, 3, 4), (2,)


@dataclass(frozen=True)
class Config:
    tiles: object | None  # the long class's tiles for the head width; None: none (the decode-sized classes)
    num_splits: int | None  # None: the launch's as the engine makes it (canvases unsplit, prompts the kernel's)


def candidates(head_dim: int, quick: bool) -> dict[str, Config]:
    """Name -> configuration: the decode-sized tiles as before, with forced split counts, and candidate long
    tiles for heads of ``head_dim``."""
    from diffulex.kernels.paged_attention import LongQueryTiles

    out = {BEFORE: Config(None, None)}
    for splits in QUICK_SPLITS if quick else SPLITS:
        out[f"decode-sized tiles, {splits} splits"] = Config(None, splits)
    for rows, block_n, warps, stages in (QUICK_SHAPES if quick else SHAPES)[head_dim]:
        tiles = LongQueryTiles(rows, block_n, warps, stages, split_keys=False)
        out[f"long {rows}x{block_n}, {warps} warps, {stages} stages"] = Config(tiles, None)
    return out


@contextlib.contextmanager
def wide_tiles(head_dim: int, tiles) -> Iterator[None]:
    """Launches inside take `tiles` as the long-query class of heads of ``head_dim`` (None: none for them), in any
    dtype (the quick run's float32 included, which the rule keeps out of the wide tiles)."""
    from diffulex.kernels import paged_attention as pa

    rule = pa.long_query_tiles_for
    pa.long_query_tiles_for = lambda width, elem_size=2: tiles if width == head_dim else rule(width, elem_size)
    try:
        yield
    finally:
        pa.long_query_tiles_for = rule


def launch_inputs(kind: LayerKind, contexts: list[int], rows: int, canvas: bool, dtype: torch.dtype,
                  device: torch.device, page_size: int):  # fmt: skip
    """q/k/v of ``rows`` rows per request after each of `contexts` cached positions (shuffled pages of a random
    cache) and their metadata: a canvas (``canvas``: block and prefix are the rows, the window anchored at the
    context) or a causal prompt (block 1)."""
    from diffulex.attention.metadata import PagedAttentionMetadata

    gen = torch.Generator(device=device).manual_seed(sum(contexts) + rows + kind.head_dim)
    n = len(contexts)
    q = torch.randn(n * rows, kind.heads, kind.head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(n * rows, kind.kv_heads, kind.head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(n * rows, kind.kv_heads, kind.head_dim, device=device, dtype=dtype, generator=gen)
    per_request = max(1, -(-(max(contexts) + rows) // page_size))
    pages = n * per_request
    cache = torch.randn(pages, page_size, kind.kv_heads, kind.head_dim, device=device, dtype=dtype, generator=gen)
    table = torch.randperm(pages, device=device, generator=gen).to(torch.int32).view(n, per_request)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    meta = PagedAttentionMetadata(
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device) * rows,
        context_lens=ctx,
        prefix_lens=ctx + (rows if canvas else 0),
        page_tables=table,
        slot_mapping=torch.full((n * rows,), -1, dtype=torch.int64, device=device),
        block_size=rows if canvas else 1,
        page_size=page_size,
        prefix_full=canvas,
        query_lens_cpu=[rows] * n,
        context_lens_cpu=list(contexts),
        prefix_lens_cpu=[c + (rows if canvas else 0) for c in contexts],
    )
    return q, k, v, cache, meta


def visible_pairs(kind: LayerKind, contexts: list[int], rows: int, canvas: bool) -> int:
    """(query, key) pairs the mask lets through, per query head."""
    total = 0
    for ctx in contexts:
        if canvas:
            cached = min(ctx, kind.window - 1) if kind.window else ctx
            total += rows * (cached + rows)
        else:
            total += sum(min(ctx + i + 1, kind.window) if kind.window else ctx + i + 1 for i in range(rows))
    return total


def seconds_per_launch(fn, device: torch.device) -> float:
    """Seconds per launch: on a GPU, 10 launches captured in a CUDA graph and replayed; elsewhere one launch."""
    from diffulex.bench.hardware import time_graph_calls, time_per_call

    if device.type == "cuda":
        return time_graph_calls(lambda i: fn(), 10, warmup=1) / 1e6
    return time_per_call(fn, device, 1, warmup=1)


def measure_case(kind: LayerKind, case: str, contexts: list[int], rows: int, canvas: bool, check: bool, quick: bool,
                 dtype: torch.dtype, device: torch.device, flops_per_s: float, page_size: int,
                 log=print) -> list[dict[str, object]]:  # fmt: skip
    """Every configuration of ``kind``'s head width on one launch; with ``check`` each output against the float32
    reference."""
    from diffulex.attention.torch_paged import paged_attention
    from diffulex.bench.hardware import time_checked_config
    from diffulex.kernels.paged_attention import triton_paged_attention
    from diffulex.strategy.diffusion_gemma.runner import DECODER_SPLITS

    q, k, v, cache, meta = launch_inputs(kind, contexts, rows, canvas, dtype, device, page_size)
    window = {"window": kind.window, "window_from_context": canvas and kind.window > 0}
    flops = 4 * kind.heads * kind.head_dim * visible_pairs(kind, contexts, rows, canvas)
    expected = None
    if check:
        expected = paged_attention(q.float(), k.float(), v.float(), cache.float(), cache.float(), meta, 1.0, **window)
    out = torch.empty_like(q)
    results: list[dict[str, object]] = []
    for name, config in candidates(kind.head_dim, quick).items():
        splits = config.num_splits or (DECODER_SPLITS if canvas else None)
        launch = functools.partial(triton_paged_attention, q, k, v, cache, cache, meta, 1.0, out=out,
                                   num_splits=splits, **window)  # fmt: skip
        row: dict[str, object] = {"layer": kind.name, "head_dim": kind.head_dim, "case": case, "config": name,
                                  "error": None}  # fmt: skip
        try:
            with wide_tiles(kind.head_dim, config.tiles):
                timed = functools.partial(seconds_per_launch, launch, device)
                row |= time_checked_config(timed, out, expected, flops, flops_per_s, TOLERANCE)
            log(f"  {kind.name:8s} {case:>22s} {name:34s} {row['ms']:8.3f} ms  {row['tflops']:6.1f} TFLOP/s  "
                f"{row['x_floor']:6.2f}x floor")
        except Exception as err:  # noqa: BLE001  (a config that cannot launch is reported, not kept)
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            log(f"  {kind.name:8s} {case:>22s} {name:34s} failed: {row['error'][:120]}")
        results.append(row)
    return results


def measure(quick: bool, batch_sizes: list[int], context: int, prompt: int, page_size: int,
            log=print) -> dict[str, object]:  # fmt: skip
    from diffulex.bench.hardware import measure_matmul_throughput

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    flops_per_s = measure_matmul_throughput(device, dtype, 512 if quick else 8192, 3 if quick else 20)
    log(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}: {dtype} matmul "
        f"{flops_per_s / 1e12:.1f} TFLOP/s")
    rows = QUICK_CANVAS if quick else CANVAS
    cases = [(f"{b} canvas(es) after {context}", [context] * b, rows, True) for b in batch_sizes]
    if prompt:
        cases.append((f"prompt of {prompt}", [0], prompt, False))
    results: list[dict[str, object]] = []
    for kind in QUICK_LAYERS if quick else LAYERS:
        for i, (case, contexts, n, canvas) in enumerate(cases):
            results += measure_case(kind, case, contexts, n, canvas, i == 0, quick, dtype, device, flops_per_s,
                                    page_size, log)  # fmt: skip
    return {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
            "cpu", "dtype": str(dtype), "matmul_TFLOPs": flops_per_s / 1e12, "page_size": page_size,
            "rows": results, **choose(results)}  # fmt: skip


def choose(results: list[dict[str, object]]) -> dict[str, object]:
    """Per head width, the configuration with the lowest geometric mean of time over floor among those that ran
    every case, and its speed-up over the decode-sized tiles."""
    keep: dict[str, object] = {}
    for head_dim in sorted({r["head_dim"] for r in results}):
        mine = [r for r in results if r["head_dim"] == head_dim]
        cases = {r["case"] for r in mine}
        score: dict[str, float] = {}
        for name in dict.fromkeys(r["config"] for r in mine):
            ran = [r for r in mine if r["config"] == name and not r["error"]]
            if len(ran) == len(cases):
                score[name] = math.exp(sum(math.log(r["x_floor"]) for r in ran) / len(ran))
        if score:
            best = min(score, key=score.__getitem__)
            fastest = {case: min((r for r in mine if r["case"] == case and not r["error"]),
                                 key=lambda r: r["ms"])["config"] for case in sorted(cases)}  # fmt: skip
            keep[str(head_dim)] = {"keep": best, "geomean_x_floor": score, "fastest_per_case": fastest,
                                   "speedup_vs_before": score.get(BEFORE, math.nan) / score[best]}  # fmt: skip
    return {"by_head_dim": keep}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="canvases of one decoder launch")
    ap.add_argument("--context", type=int, default=512, help="cached positions before each canvas")
    ap.add_argument("--prompt", type=int, default=2048, help="an encoder prompt's positions (0: none)")
    ap.add_argument("--page-size", type=int, default=CANVAS, help="positions a cache page holds")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, any device: checks the script, not speed")
    args = ap.parse_args()
    if args.quick:
        args.batch_sizes, args.context, args.prompt, args.page_size = [1, 2], 40, 130, 32
    report = measure(args.quick, args.batch_sizes, args.context, args.prompt, args.page_size)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "wide_head_attention.json").write_text(json.dumps(report, indent=1))
    for head_dim, choice in report["by_head_dim"].items():
        print(f"heads of {head_dim}: keep {choice['keep']} ({choice['speedup_vs_before']:.2f}x the decode-sized "
              f"tiles, geometric mean over the cases)")
        for case, name in choice["fastest_per_case"].items():
            print(f"  fastest on {case}: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
