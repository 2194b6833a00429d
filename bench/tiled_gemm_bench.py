"""The tiled Triton GEMM (`diffulex.kernels.tiled_gemm`) against cuBLAS on the projections of batch 64 and 128.

    PYTHONPATH=. python bench/tiled_gemm_bench.py [--out runs/tiled_gemm.json]

Every product is graph-replayed on cold weight copies (`diffulex.bench.hardware.time_linear`, as the throughput
benchmark's linear roofline times cuBLAS), checked against an fp32 reference first, and reported as a share of
the measured bf16 matmul peak. Prints one line per (shape, M, config) and the best config per shape.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from diffulex.bench.hardware import measure_matmul_throughput, time_linear
from diffulex.kernels.tiled_gemm import TiledConfig, tiled_linear

SHAPES = {  # name: (N, K) of SDAR's projections (merged q/k/v and gate/up, as the engine runs them)
    "1.7b.qkv": (4096, 2048),
    "1.7b.o": (2048, 2048),
    "1.7b.gate_up": (12288, 2048),
    "1.7b.down": (2048, 6144),
    "8b.qkv": (6144, 4096),
    "8b.o": (4096, 4096),
    "8b.down": (4096, 12288),
}
_T = TiledConfig
CONFIGS = [
    _T(128, 128, 64, 8, 4, 1),
    _T(128, 64, 64, 4, 4, 1),
    _T(64, 128, 64, 4, 4, 1),
    _T(128, 128, 64, 8, 4, 2),
    _T(128, 64, 64, 4, 5, 1),
    _T(64, 64, 64, 4, 5, 1),
    _T(128, 128, 64, 4, 4, 2),
    _T(128, 256, 64, 8, 3, 2),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="*", default=[256, 512])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--out")
    args = ap.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    peak = measure_matmul_throughput(device, dtype, 8192)
    print(f"matmul peak {peak / 1e12:.0f} TFLOP/s")
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype) * 0.05
            ref = (x.float() @ w.float().T).to(dtype).float()
            results = {"cublas": time_linear(m, n, k, device, dtype)}
            for cfg in CONFIGS:
                err = (tiled_linear(x, w, cfg).float() - ref).abs().max().item()
                if err > 0.05 * ref.abs().max().item():
                    print(f"{name} M={m} {cfg}: WRONG (max error {err:.3g})")
                    continue
                results[str(tuple(cfg))] = time_linear(m, n, k, device, dtype,
                                                       product=functools.partial(tiled_linear, config=cfg))
            flops = 2 * m * n * k
            for label, sec in results.items():
                pct = 100 * flops / sec / peak
                print(f"{name:14s} M={m:4d} {label:28s} {sec * 1e6:8.1f} us {pct:5.1f}% of peak")
                rows.append({"shape": name, "m": m, "n": n, "k": k, "impl": label, "us": sec * 1e6, "pct": pct})
            best = min(results, key=results.get)
            cublas_us = results["cublas"] * 1e6
            print(f"BEST {name} M={m}: {best} {results[best] * 1e6:.1f} us against cuBLAS {cublas_us:.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"peak_tflops": peak / 1e12, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
