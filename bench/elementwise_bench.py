"""The forward's elementwise kernels at prompt sizes against the copy bandwidth: microseconds a call and the share
of the measured copy rate their bytes reach, graph-replayed.

    PYTHONPATH=. python bench/elementwise_bench.py [--rows 2052 8196] [--out FILE]

Why: in a cold prompt's profile (`bench/prefill_anatomy.py`) the residual-add + RMSNorm, SiLU-and-mul and q/k norm +
rotary + KV store launches took about 1.9x their bytes' floor at SDAR-8B and 2k rows; a launch that reaches the
copy rate is at its floor, one that does not says where the class's time goes. Each kernel runs at the SDAR-1.7B and
8B widths on its own inputs, cycled through enough copies that none is read from the L2 cache, inside a CUDA graph
(`diffulex.bench.hardware.time_graph_calls`); the bytes are what the launch must read and write, each once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from diffulex.bench.hardware import measure_copy_bandwidth, time_graph_calls
from diffulex.kernels.activation import silu_mul
from diffulex.kernels.fused_norm import qk_norm_rope_store, rms_norm

# name -> (hidden, heads, kv heads, head dim, intermediate)
GEOMETRIES = {"sdar-1.7b": (2048, 16, 8, 128, 6144), "sdar-8b": (4096, 32, 8, 128, 12288)}
_COLD_BYTES = 256 * 2**20  # inputs cycled through add up to at least this, so no call reads the L2 cache
PAGE_SIZE = 32


def _copies(nbytes: int) -> int:
    return max(2, -(-_COLD_BYTES // max(1, nbytes)))


def cases(geometry: tuple[int, ...], rows: int, dev: torch.device) -> dict[str, tuple]:
    """name -> (call(i), bytes a call moves)"""
    hidden, heads, kv_heads, head_dim, inter = geometry
    bf = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype = bf) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen)

    out: dict[str, tuple] = {}
    item = 2
    n = _copies(2 * rows * hidden * item)
    xs, rs, w = [rand(rows, hidden) for _ in range(n)], [rand(rows, hidden) for _ in range(n)], rand(hidden)
    out["add + rms_norm"] = (lambda i: rms_norm(xs[i % len(xs)], w, 1e-6, rs[i % len(rs)]), 4 * rows * hidden * item)
    gus = [rand(rows, 2 * inter) for _ in range(_copies(2 * rows * inter * item))]
    out["silu_mul"] = (lambda i: silu_mul(gus[i % len(gus)][:, :inter], gus[i % len(gus)][:, inter:]),
                       3 * rows * inter * item)  # fmt: skip
    q_cols, kv_cols = heads * head_dim, kv_heads * head_dim
    qkvs = [rand(rows, q_cols + 2 * kv_cols) for _ in range(_copies(rows * (q_cols + 2 * kv_cols) * item))]
    pages = -(-rows // PAGE_SIZE)
    k_cache, v_cache = rand(pages, PAGE_SIZE, kv_heads, head_dim), rand(pages, PAGE_SIZE, kv_heads, head_dim)
    slots = torch.arange(rows, device=dev)
    pos = torch.arange(rows, device=dev, dtype=torch.float32)[:, None]
    freqs = pos / (1e6 ** (torch.arange(0, head_dim, 2, device=dev, dtype=torch.float32) / head_dim))
    cos, sin = freqs.cos(), freqs.sin()
    qw, kw = rand(head_dim), rand(head_dim)

    def qk(i: int):
        qkv = qkvs[i % len(qkvs)]
        q = qkv[:, :q_cols].view(rows, heads, head_dim)
        k = qkv[:, q_cols : q_cols + kv_cols].view(rows, kv_heads, head_dim)
        v = qkv[:, q_cols + kv_cols :].view(rows, kv_heads, head_dim)
        return qk_norm_rope_store(q, k, v, cos, sin, qw, kw, 1e-6, k_cache, v_cache, slots)

    # read q, k, v; write q, k and the cached k, v
    out["qk_norm_rope_store"] = (qk, rows * (2 * q_cols + 5 * kv_cols) * item)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2052, 8196])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("elementwise_bench: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(dev, 2**30)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results = []
    for model, geometry in GEOMETRIES.items():
        for rows in args.rows:
            for name, (call, nbytes) in cases(geometry, rows, dev).items():
                us = time_graph_calls(call, args.calls)
                floor_us = 1e6 * nbytes / bandwidth
                row = {"model": model, "rows": rows, "kernel": name, "us": round(us, 2),
                       "floor_us": round(floor_us, 2), "x_floor": round(us / floor_us, 2)}  # fmt: skip
                results.append(row)
                print(row, flush=True)
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"tool": "elementwise_bench", "copy_bandwidth_Bps": bandwidth,
                                              "results": results}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
