"""The skinny GEMM against cuBLAS on the decode-sized linears of SDAR-1.7B and SDAR-8B.

For every projection (fused qkv, o, fused gate_up, down, LM head) and row count M, this times ``F.linear``
(cuBLAS) and `skinny_linear` twice: eager launches bracketed by CUDA events, and a CUDA graph of many
back-to-back calls replayed (no launch overhead, the way the engine runs decode). Consecutive calls read
different copies of the weight, so that, as in a real forward where every layer has its own weights, the
weights come from HBM and not from the 50 MB L2. Reports weight-read bandwidth (GB/s), the speedup, which
path the dispatch (`use_skinny`) takes, and the max error of both against an fp32 reference.

``--sweep`` first times a grid of kernel configs per shape and row bucket and prints the table rows for
`diffulex.kernels.skinny_gemm._TABLE` (the best config, or None where cuBLAS stays faster), then runs the
comparison with that table in place of the built-in one.

    PYTHONPATH=. python bench/skinny_gemm_bench.py --out runs/skinny.json
    PYTHONPATH=. python bench/skinny_gemm_bench.py --sweep --out runs/skinny_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from diffulex.bench.hardware import time_graph_calls as time_graph
from diffulex.bench.roofline import ModelGeometry
from diffulex.bench.throughput import SDAR_SIZES
from diffulex.kernels import skinny_gemm
from diffulex.kernels.skinny_gemm import SkinnyConfig, _bucket, config_for, skinny_linear, use_skinny

# The linears the engine runs (projections fused), by the bench's names.
_ENGINE_LINEARS = {
    "qkv": "qkv (fused)", "o_proj": "o", "gate_up": "gate_up (fused)", "down": "down", "lm_head": "lm_head",
}
_SDAR_CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "sdar-4b-chat" / "config.json"


def _sdar_linears(size: str) -> dict[str, tuple[int, int]]:
    """``name -> (N, K)`` of an SDAR geometry, from the real 4B config and `SDAR_SIZES` (as `bench throughput`)."""
    config = {**json.loads(_SDAR_CONFIG.read_text(encoding="utf-8")), **SDAR_SIZES[size]}
    shapes = ModelGeometry.from_config(config).linear_shapes()
    return {name: shapes[key] for name, key in _ENGINE_LINEARS.items()}


def _tensor_parallel_shard(linears: dict[str, tuple[int, int]], ranks: int) -> dict[str, tuple[int, int]]:
    """One rank's ``(N, K)`` under tensor parallelism: column-parallel projections (qkv, gate_up, the vocabulary-
    parallel LM head) hold ``N / ranks`` outputs, row-parallel ones (o, down) ``K / ranks`` inputs."""
    rows_split = {"o_proj", "down"}
    return {
        name: (n, k // ranks) if name in rows_split else (-(-n // ranks), k) for name, (n, k) in linears.items()
    }


GEOMETRIES: dict[str, dict[str, tuple[int, int]]] = {
    "sdar-1.7b": _sdar_linears("1.7b"),
    "sdar-8b": _sdar_linears("8b"),
    # a rank's shapes of SDAR-8B at tensor_parallel_size=2 (bench/tp_decode.py's geometry)
    "sdar-8b-tp2": _tensor_parallel_shard(_sdar_linears("8b"), 2),
    # the dense linears of the MoE geometries (`bench sweep --targets moe`): SDAR-30B-A3B at 4 rows a request,
    # LLaDA2-mini (blocks of 32) at 32, with its shared expert
    "sdar-30b-a3b": {"qkv": (5120, 2048), "o_proj": (2048, 4096), "lm_head": (151936, 2048)},
    "llada2-mini": {
        "qkv": (3072, 2048),
        "o_proj": (2048, 2048),
        "gate_up": (1024, 2048),
        "down": (2048, 512),
        "lm_head": (157184, 2048),
    },
    # SDAR-30B-A3B's router (128 experts scored from the hidden state; a bf16 product, `SoftmaxRouter`), at 4 rows a
    # request: a kernel of a few microseconds every MoE layer, which on cuBLAS also breaks the PDL chain around it
    "sdar-30b-a3b-router": {"router": (128, 2048)},
    # not in the config table: these check the generic config (Qwen3-4B and Qwen2.5-7B / Dream-7B layouts)
    "sdar-4b": _sdar_linears("4b"),
    "dream-7b": {
        "qkv": (4608, 3584),
        "o_proj": (3584, 3584),
        "gate_up": (37888, 3584),
        "down": (3584, 18944),
        "lm_head": (152064, 3584),
    },
}
TABLE_GEOMETRIES = ["sdar-1.7b", "sdar-8b"]
ROWS = (1, 4, 5, 8, 16)
SMS = 132
# Weight copies rotated through: at least this many bytes, several times the H100's 50 MB L2.
ROTATE_BYTES = 256 << 20
# (block_n, block_k, num_warps, num_stages) of the sweep, per inner product.
DOT_TILES = [
    (16, 512, 4, 4),
    (32, 256, 4, 4),
    (32, 512, 4, 3),
    (64, 128, 4, 4),
    (64, 128, 4, 6),
    (64, 256, 4, 3),
    (64, 256, 4, 4),
    (128, 128, 4, 4),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
]
# added for 64+ rows (the tiles of a batch of 16-64 requests' blocks), where x's tile is as large as the weight's and
# wider weight tiles halve how often each program re-reads it
WIDE_DOT_TILES = [
    (64, 64, 4, 4),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
    (256, 64, 8, 3),
]
FMA_TILES = [
    (16, 512, 4, 1),
    (32, 256, 4, 1),
    (64, 128, 4, 1),
    (32, 512, 8, 1),
]


class WeightPool:
    """One large random buffer; `weights(n, k)` gives views of distinct regions, enough to defeat the L2."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.buf = torch.empty(numel, dtype=dtype, device="cuda").normal_(0.0, 0.02)

    def weights(self, n: int, k: int) -> list[torch.Tensor]:
        size = n * k
        copies = max(1, min(self.buf.numel() // size, math.ceil(ROTATE_BYTES / (size * self.buf.element_size()))))
        return [self.buf[i * size : (i + 1) * size].view(n, k) for i in range(copies)]


def rotate(fn: Callable[..., torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor], **kw: object) -> Callable:
    """``call(i)``: ``fn(x, weight_i)``, cycling through the weight copies."""
    return lambda i: fn(x, weights[i % len(weights)], **kw)


def time_eager(call: Callable[[int], object], calls: int) -> float:
    """Microseconds per call, launched one after another (includes launch overhead where it dominates)."""
    for i in range(3):
        call(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(calls):
        call(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def calls_for(nbytes: int) -> int:
    """Enough calls in a graph for ~0.5 ms of work at 2.5 TB/s, between 5 and 60."""
    return max(5, min(60, math.ceil(5e-4 / (nbytes / 2.5e12))))


def split_options(n: int, k: int, block_n: int, block_k: int) -> list[int]:
    """K splits worth trying: none, and the ones bringing the grid to about 1, 2 and 4 waves of the SMs."""
    tiles = math.ceil(n / block_n)
    max_split = max(1, k // block_k)
    options = {1}
    for waves in (1, 2, 4):
        s = min(max_split, max(1, round(waves * SMS / tiles)))
        options.add(s)
    return sorted(options)


def candidates(n: int, k: int, m: int) -> list[SkinnyConfig]:
    out = []
    dot_tiles = DOT_TILES + (WIDE_DOT_TILES if m > 64 else [])
    for use_dot, tiles in ((True, dot_tiles), (False, FMA_TILES if m <= 4 else [])):
        for bn, bk, warps, stages in tiles:
            if bk > k:
                continue
            for s in split_options(n, k, bn, bk):
                out.append(SkinnyConfig(bn, bk, warps, stages, use_dot, s))
                if use_dot and s == 1 and bk * 2 <= 256:  # weight tiles through TMA (boxes of at most 256 bytes)
                    out.append(SkinnyConfig(bn, bk, warps, stages, use_dot, s, True))
    return out


def _compile_worker(job: tuple[SkinnyConfig, int, int, str]) -> str | None:
    """Compile one variant into the on-disk Triton cache (a small launch with the same specializations)."""
    cfg, m, k, dtype_name = job
    try:
        dtype = getattr(torch, dtype_name)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(256, k, device="cuda", dtype=dtype)
        skinny_linear(x, w, None, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - report and go on
        return f"{cfg} m={m}: {type(e).__name__}: {e}"[:300]


def precompile(jobs: list[tuple[SkinnyConfig, int, int, str]], workers: int) -> None:
    """Compile the sweep's kernels in parallel processes; the timing process then loads them from the cache."""
    seen, unique = set(), []
    for cfg, m, k, dt in jobs:
        block_m = max(16, 1 << (m - 1).bit_length()) if cfg.use_dot else 1 << (m - 1).bit_length()
        key = (cfg._replace(split_k=min(cfg.split_k, 2)), block_m, dt)
        if key not in seen:
            seen.add(key)
            unique.append((cfg._replace(split_k=min(cfg.split_k, 2)), m, k, dt))
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.imap_unordered(_compile_worker, unique) if e]
    print(f"precompiled {len(unique)} variants in {time.perf_counter() - t0:.0f} s, {len(errors)} failed", flush=True)
    for e in errors[:10]:
        print("  ", e, flush=True)


def max_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = F.linear(x.float(), w.float())
    return (y.float() - ref).abs().max().item()


def shapes(geometries: list[str]) -> list[tuple[str, str, int, int]]:
    return [(g, name, n, k) for g in geometries for name, (n, k) in GEOMETRIES[g].items()]


def sweep(args: argparse.Namespace, pool: WeightPool, dtype: torch.dtype) -> dict:
    t_start = time.perf_counter()
    # one row count per bucket of the table, the largest (its worst case)
    rows = sorted({_bucket(m): m for m in sorted(args.rows)}.values())
    jobs = []
    for _, _, n, k in shapes(args.geometries):
        for m in rows:
            jobs.extend((cfg, m, k, args.dtype) for cfg in candidates(n, k, m))
    try:
        precompile(jobs, args.workers)
    except Exception as e:  # noqa: BLE001 - the sweep then compiles as it goes
        print(f"parallel precompile failed ({type(e).__name__}: {e}); compiling serially", flush=True)
    results, table = [], {}
    for geometry, name, n, k in shapes(args.geometries):
        weights = pool.weights(n, k)
        nbytes = n * k * pool.buf.element_size()
        calls = calls_for(nbytes)
        for m in rows:
            if time.perf_counter() - t_start > args.budget:
                print("time budget spent, stopping the sweep", flush=True)
                break
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = F.linear(x.float(), weights[0].float())
            tol = 2 * (F.linear(x, weights[0]).float() - ref).abs().max().item() + 1e-3
            cublas_us = time_graph(rotate(F.linear, x, weights), calls)
            timed, wrong = [], 0
            for cfg in candidates(n, k, m):
                try:
                    err = (skinny_linear(x, weights[0], None, cfg).float() - ref).abs().max().item()
                    if not err <= tol:
                        wrong += 1
                        print(f"  {tuple(cfg)} wrong: max error {err:.3g} > {tol:.3g}", flush=True)
                        continue
                    us = time_graph(rotate(skinny_linear, x, weights, config=cfg), calls)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is skipped
                    print(f"  {tuple(cfg)} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                timed.append((us, err, cfg))
            del ref
            timed.sort(key=lambda t: t[0])
            best_us, err, best = timed[0]
            ref_err = tol / 2 - 5e-4
            results.append(
                {
                    "geometry": geometry,
                    "name": name,
                    "n": n,
                    "k": k,
                    "m": m,
                    "cublas_us": cublas_us,
                    "cublas_gbps": nbytes / cublas_us / 1e3,
                    "best_us": best_us,
                    "best_gbps": nbytes / best_us / 1e3,
                    "best": best._asdict(),
                    "max_err": err,
                    "cublas_max_err": ref_err,
                    "wrong_configs": wrong,
                    "top5": [(us, c._asdict()) for us, _, c in timed[:5]],
                }
            )
            table[(n, k, _bucket(m))] = best if best_us < cublas_us else None
            print(
                f"{geometry:>9} {name:>8} N={n:>6} K={k:>5} M={m:>2}  cublas {cublas_us:8.2f} us "
                f"{nbytes / cublas_us / 1e3:6.0f} GB/s  best {best_us:8.2f} us {nbytes / best_us / 1e3:6.0f} GB/s "
                f"x{cublas_us / best_us:4.2f} err {err:.3g}  {tuple(best)}",
                flush=True,
            )
            for us, _, c in timed[1:4]:
                print(f"{'':>40} {us:8.2f} us {tuple(c)}", flush=True)
    print("_TABLE rows:")
    for key, cfg in table.items():
        print(f"    {key}: {cfg},")
    return {"results": results, "table": {",".join(map(str, key)): cfg and cfg._asdict() for key, cfg in table.items()}}


def bench(args: argparse.Namespace, pool: WeightPool, dtype: torch.dtype) -> dict:
    results = []
    header = (
        f"{'model':>9} {'layer':>8} {'N':>6} {'K':>5} {'M':>2} | {'cuBLAS us':>9} {'GB/s':>6} | "
        f"{'skinny us':>9} {'GB/s':>6} {'x':>5} | {'eager cuBLAS':>12} {'skinny':>7} | "
        "dispatch graph/eager  err(skinny/cublas)"
    )
    print(header, flush=True)
    for geometry, name, n, k in shapes(args.geometries):
        weights = pool.weights(n, k)
        nbytes = n * k * pool.buf.element_size()
        calls = calls_for(nbytes)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            cfg = config_for(n, k, m)
            dispatch = cfg is not None  # under graph capture
            eager_dispatch = use_skinny(x, weights[0])
            row = {"geometry": geometry, "name": name, "n": n, "k": k, "m": m, "dispatch_graph": dispatch}
            row["dispatch_eager"] = eager_dispatch
            row["cublas_us"] = time_graph(rotate(F.linear, x, weights), calls)
            row["cublas_eager_us"] = time_eager(rotate(F.linear, x, weights), calls)
            row["cublas_gbps"] = nbytes / row["cublas_us"] / 1e3
            row["cublas_max_err"] = max_error(F.linear(x, weights[0]), x, weights[0])
            if cfg is not None:
                row["config"] = cfg._asdict()
                row["skinny_us"] = time_graph(rotate(skinny_linear, x, weights), calls)
                row["skinny_eager_us"] = time_eager(rotate(skinny_linear, x, weights), calls)
                row["skinny_gbps"] = nbytes / row["skinny_us"] / 1e3
                row["speedup"] = row["cublas_us"] / row["skinny_us"]
                row["skinny_max_err"] = max_error(skinny_linear(x, weights[0]), x, weights[0])
                mine = (
                    f"{row['skinny_us']:9.2f} {row['skinny_gbps']:6.0f} {row['speedup']:5.2f} | "
                    f"{row['cublas_eager_us']:12.2f} {row['skinny_eager_us']:7.2f} | "
                    f"{'skinny' if dispatch else 'cuBLAS':>8}/{'skinny' if eager_dispatch else 'cuBLAS'}  "
                    f"{row['skinny_max_err']:.3g}/{row['cublas_max_err']:.3g}"
                )
            else:
                mine = (
                    f"{'-':>9} {'-':>6} {'-':>5} | {row['cublas_eager_us']:12.2f} {'-':>7} | "
                    f"{'cuBLAS':>8}/cuBLAS  -/{row['cublas_max_err']:.3g}"
                )
            print(
                f"{geometry:>9} {name:>8} {n:>6} {k:>5} {m:>2} | {row['cublas_us']:9.2f} {row['cublas_gbps']:6.0f} | "
                + mine,
                flush=True,
            )
            results.append(row)
    for geometry in args.geometries:
        rows = [r for r in results if r["geometry"] == geometry and "speedup" in r]
        if rows:
            worst = min(rows, key=lambda r: r["speedup"])
            print(
                f"{geometry}: {len(rows)} shapes on the kernel, speedup min {worst['speedup']:.3f} "
                f"({worst['name']} M={worst['m']}), geomean "
                f"{math.exp(sum(math.log(r['speedup']) for r in rows) / len(rows)):.3f}",
                flush=True,
            )
    return {"results": results}


def selfcheck(dtype: torch.dtype) -> list[dict]:
    """Odd shapes, bias, every inner product and split, eager and replayed from a CUDA graph, against fp32."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m, n, k in ((1, 1000, 2000), (5, 1000, 2000), (13, 333, 4160), (16, 4096, 1024)):
        x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) * 0.05
        b = torch.randn(n, device="cuda", dtype=dtype, generator=gen)
        ref = F.linear(x.float(), w.float(), b.float())
        tol = 2 * (F.linear(x, w, b).float() - ref).abs().max().item() + 1e-3
        for cfg in (
            SkinnyConfig(64, 256, 4, 3, True, 1),
            SkinnyConfig(64, 256, 4, 3, True, 4),
            SkinnyConfig(32, 128, 4, 1, False, 1),
            SkinnyConfig(32, 128, 4, 1, False, 5),
        ):
            if m > 8 and not cfg.use_dot:
                continue
            eager = (skinny_linear(x, w, b, cfg).float() - ref).abs().max().item()
            out = []
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                skinny_linear(x, w, b, cfg)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(3):
                    out.append(skinny_linear(x, w, b, cfg))
            graph.replay()
            graph.replay()
            torch.cuda.synchronize()
            replayed = max((o.float() - ref).abs().max().item() for o in out)
            ok = eager <= tol and replayed <= tol
            rows.append(
                {
                    "m": m,
                    "n": n,
                    "k": k,
                    "config": cfg._asdict(),
                    "eager_err": eager,
                    "graph_err": replayed,
                    "tol": tol,
                    "ok": ok,
                }
            )
            if not ok:
                print(f"SELFCHECK FAILED m={m} n={n} k={k} {tuple(cfg)}: {eager:.3g} {replayed:.3g} > {tol:.3g}")
    # the layers' path: first eager call compiles (warm-up), the capture then takes the kernel
    from diffulex.layers.linear import linear

    x = torch.randn(4, 2048, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(4096, 2048, device="cuda", dtype=dtype, generator=gen) * 0.05
    ref = F.linear(x.float(), w.float())
    tol = 2 * (F.linear(x, w).float() - ref).abs().max().item() + 1e-3
    eager = [(linear(x, w).float() - ref).abs().max().item() for _ in range(2)]
    graph, out = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        out.append(linear(x, w))
    graph.replay()
    torch.cuda.synchronize()
    replayed = (out[0].float() - ref).abs().max().item()
    ok = max(eager + [replayed]) <= tol
    rows.append({"layer_path": True, "eager_err": eager, "graph_err": replayed, "tol": tol, "ok": ok})
    if not ok:
        print(f"SELFCHECK FAILED layer path: {eager} {replayed:.3g} > {tol:.3g}")
    print(f"selfcheck: {sum(r['ok'] for r in rows)}/{len(rows)} ok", flush=True)
    return rows


def copy_bandwidth(pool: WeightPool) -> float:
    """GB/s of a device-to-device copy of 1 GiB (read + write), the practical ceiling."""
    src = pool.buf[: (512 << 20)]
    dst = torch.empty_like(src)
    us = time_graph(lambda i: dst.copy_(src), 5)
    return 2 * src.numel() * src.element_size() / us / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometries", nargs="+", default=TABLE_GEOMETRIES, choices=list(GEOMETRIES))
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="time a grid of configs and print table rows")
    parser.add_argument("--budget", type=float, default=190.0, help="seconds the sweep may take")
    parser.add_argument("--workers", type=int, default=12, help="processes compiling the sweep's kernels")
    parser.add_argument("--out", type=str, default=None, help="write the results here (JSON)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    largest = max(n * k for _, _, n, k in shapes(args.geometries))
    pool = WeightPool(max(largest, ROTATE_BYTES // 2), dtype)
    copy_gbps = copy_bandwidth(pool)
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {copy_gbps:.0f} GB/s  dtype {args.dtype}", flush=True)
    report: dict = {"selfcheck": selfcheck(dtype)}
    if args.sweep:
        report["sweep"] = sweep(args, pool, dtype)
        # then the comparison with the swept table in place of the built-in one
        skinny_gemm._TABLE.clear()
        skinny_gemm._TABLE.update(
            {
                tuple(int(v) for v in key.split(",")): cfg and SkinnyConfig(**cfg)
                for key, cfg in report["sweep"]["table"].items()
            }
        )
    report |= bench(args, pool, dtype)
    if args.out:
        meta = {
            "machine": platform.platform(),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "copy_gbps": copy_gbps,
            "args": vars(args),
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta} | report, indent=2))


if __name__ == "__main__":
    main()
