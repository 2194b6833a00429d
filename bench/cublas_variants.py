"""cuBLAS call variants for the projections cuBLAS under-fills at batch 64/128 (SDAR-1.7B o_proj and down_proj).

    PYTHONPATH=. python bench/cublas_variants.py

At M = 512 cuBLAS covers a 2048-column output with 64 tiles of 128 x 128 on 132 SMs. Variants, each timed as
the linear roofline times ``F.linear`` (graph replay, a cold weight copy per call): the plain call; the cuBLASLt
backend (``torch.backends.cuda.preferred_blas_library``); fp32 output (``torch.mm(out_dtype=)``); K split in two
halves run on two streams forked inside the graph and summed (twice the tiles in flight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffulex.bench.hardware import measure_matmul_throughput

SHAPES = {"1.7b.o": (2048, 2048), "1.7b.down": (2048, 6144), "1.7b.qkv": (4096, 2048)}
COLD_BYTES = 256 << 20


def timed(product, m: int, n: int, k: int, iters: int = 20) -> float:
    """Seconds per call of ``product(x, w)`` replayed from a CUDA graph over cold weight copies."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=dtype)
    copies = max(1, min(iters, -(-COLD_BYTES // (n * k * 2))))
    weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.05 for _ in range(copies)]

    def calls():
        for i in range(iters):
            product(x, weights[i % copies])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / 5 / iters


_FORK = {}


def k_halves(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` as two K halves on two streams (fp32 outputs), summed and rounded."""
    k = x.shape[1] // 2
    main = torch.cuda.current_stream()
    other = _FORK.setdefault("s", torch.cuda.Stream())
    other.wait_stream(main)
    a = torch.mm(x[:, :k], w[:, :k].t(), out_dtype=torch.float32)
    with torch.cuda.stream(other):
        b = torch.mm(x[:, k:], w[:, k:].t(), out_dtype=torch.float32)
    main.wait_stream(other)
    return (a + b).to(x.dtype)


def main() -> None:
    peak = measure_matmul_throughput(torch.device("cuda"), torch.bfloat16, 8192)
    print(f"matmul peak {peak / 1e12:.0f} TFLOP/s")
    variants = {
        "F.linear": F.linear,
        "mm fp32 out": lambda x, w: torch.mm(x, w.t(), out_dtype=torch.float32),
        "K halves, two streams": k_halves,
    }
    for name, (n, k) in SHAPES.items():
        for m in (256, 512):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
            ref = F.linear(x.float(), w.float())
            for label, fn in variants.items():
                err = (fn(x, w).float() - ref).abs().max().item()
                sec = timed(fn, m, n, k)
                print(f"{name:10s} M={m:4d} {label:24s} {sec * 1e6:7.1f} us {100 * 2 * m * n * k / sec / peak:5.1f}% "
                      f"(max error {err:.2g})")
            torch.backends.cuda.preferred_blas_library("cublaslt")
            sec = timed(F.linear, m, n, k)
            print(f"{name:10s} M={m:4d} {'F.linear, cuBLASLt':24s} {sec * 1e6:7.1f} us "
                  f"{100 * 2 * m * n * k / sec / peak:5.1f}%")
            torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
