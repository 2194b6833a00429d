"""Latency of one tensor-parallel all-reduce on two GPUs, NCCL against the peer-memory one-shot path
(`diffulex.layers.peer_all_reduce`), at the sizes a decode step sends (rows x hidden size in bf16), each replayed
from a CUDA graph of many back-to-back calls (as the engine's graphs run them).

    PYTHONPATH=. python bench/all_reduce_latency.py OUT_DIR [--hidden 4096] [--rows 4 64 256 2048]

Also checks that both paths give the same sums (bf16 and float32). Writes ``OUT_DIR/all_reduce_latency.json``;
exits non-zero when a sum is wrong or the peer path could not be set up. Needs two CUDA devices.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

CALLS = 64  # all-reduces per captured graph
REPLAYS = 20


def _time_graph(fn, x: torch.Tensor) -> float:
    """Microseconds per call of ``fn(x)`` captured `CALLS` times in one graph (best of `REPLAYS` replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(CALLS):
            y = fn(y) * 0.5  # each call depends on the last, as in a forward
    best = float("inf")
    for _ in range(REPLAYS):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / CALLS)
    return best


def _rank(rank: int, port: int, out_dir: str, hidden: int, rows: list[int]) -> None:
    from diffulex.layers.parallel_state import init_tensor_parallel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = init_tensor_parallel()
    if group.peer is None:
        raise SystemExit("the peer-memory all-reduce could not be set up (see the log)")

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for n in rows:
            gen = torch.Generator(device="cuda").manual_seed(1000 * rank + n)
            x = torch.randn(n, hidden, device="cuda", dtype=dtype, generator=gen)
            if not group.peer.takes(x):
                continue
            same = bool(torch.equal(group.peer(x), nccl(x.clone())))
            row = {"dtype": str(dtype).removeprefix("torch."), "rows": n, "bytes": x.numel() * x.element_size(),
                   "same_as_nccl": same}  # fmt: skip
            if dtype is torch.bfloat16:
                row["nccl_us"] = _time_graph(nccl, x)
                row["peer_us"] = _time_graph(group.peer, x)
            results.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        device = torch.cuda.get_device_name()
        Path(out_dir, "all_reduce_latency.json").write_text(
            json.dumps({"device": device, "hidden": hidden, "calls_per_graph": CALLS, "results": results}, indent=1)
        )
    dist.barrier()
    dist.destroy_process_group()
    if not all(r["same_as_nccl"] for r in results):
        raise SystemExit("the peer-memory sums differ from NCCL's")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 64, 256, 2048])
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("all_reduce_latency: needs two CUDA devices", file=sys.stderr)
        return 2
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    import torch.multiprocessing as mp

    from diffulex.testing.distributed import free_port

    mp.spawn(_rank, args=(free_port(), args.out_dir, args.hidden, args.rows), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
