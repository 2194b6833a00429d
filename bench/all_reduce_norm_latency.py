"""Latency of a tensor-parallel layer's all-reduce and the RMSNorm after it, on every GPU of the host: NCCL's
all-reduce then `rms_norm` against the fused peer-memory kernel (`diffulex.kernels.peer_all_reduce`).

    PYTHONPATH=. python bench/all_reduce_norm_latency.py OUT_DIR [--hidden 4096] [--rows 1 4 16 64 256]

Each rank captures ``--calls`` back-to-back calls (a decode step's worth) in one CUDA graph per path and row count,
replays it ``--replays`` times and reports the best replay's microseconds per call; the fused results are checked
against NCCL's (the sum bitwise, the normed rows within one bf16 ulp). Prints a table and writes
``OUT_DIR/all_reduce_norm_latency.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> list[dict]:
    """This rank's measurements, one dict per row count."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    from diffulex.bench.hardware import time_graph_calls
    from diffulex.kernels.fused_norm import rms_norm
    from diffulex.kernels.peer_all_reduce import all_reduce_rms_norm
    from diffulex.layers.parallel_state import init_tensor_parallel
    from diffulex.layers.peer_exchange import open_peer_exchange

    group = init_tensor_parallel()
    device = torch.device("cuda", rank)
    dtype = torch.bfloat16
    exchange = open_peer_exchange(group, device, args.hidden * 2, 60.0, max_rows=max(args.rows))
    if exchange is None:
        raise SystemExit("no peer exchange on this host")
    weight = (1 + 0.1 * torch.randn(args.hidden, generator=torch.Generator().manual_seed(0))).to(dtype).to(device)
    rows_out = []
    for rows in args.rows:
        gen = torch.Generator().manual_seed(rows * 10 + rank)
        local = torch.randn(rows, args.hidden, generator=gen).to(dtype).to(device)
        residual = torch.randn(rows, args.hidden, generator=torch.Generator().manual_seed(rows)).to(dtype).to(device)

        def nccl(local: torch.Tensor = local, residual: torch.Tensor = residual) -> tuple[torch.Tensor, torch.Tensor]:
            total = local.clone()
            dist.all_reduce(total)
            return rms_norm(total, weight, 1e-6, residual)

        def fused(local: torch.Tensor = local, residual: torch.Tensor = residual) -> tuple[torch.Tensor, torch.Tensor]:
            return all_reduce_rms_norm(local, exchange, weight, 1e-6, residual)

        expected, got = nccl(), fused()
        torch.cuda.synchronize()
        same_sum = torch.equal(expected[1], got[1])
        normed_diff = (expected[0].float() - got[0].float()).abs().max().item()
        row = {"rows": rows, "same_sum": same_sum, "normed_max_abs_diff": normed_diff}
        for name, call in (("nccl", nccl), ("fused", fused)):
            # every rank replays at once: each waits for the others before its timed replay
            row[f"{name}_us"] = time_graph_calls(lambda _, call=call: call(), args.calls, args.replays,
                                                 before_replay=dist.barrier)  # fmt: skip
        row["timed_out"] = exchange.timed_out()
        rows_out.append(row)
    dist.barrier()
    dist.destroy_process_group()
    return rows_out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: mp.Queue) -> None:
    rows = _rank(rank, world, port, args)
    if rank == 0:
        queue.put({"rows": rows})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        print("needs two GPUs or more", file=sys.stderr)
        return 2
    from diffulex.testing.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(0), "world": world,
              "hidden": args.hidden, "calls_per_graph": args.calls, "torch": torch.__version__,
              "command": " ".join(sys.argv), **results}  # fmt: skip
    print(f"{'rows':>5} {'NCCL + norm us':>15} {'fused us':>9} {'same sum':>9} {'normed diff':>12}")
    for row in results["rows"]:
        print(f"{row['rows']:>5} {row['nccl_us']:>15.2f} {row['fused_us']:>9.2f} {str(row['same_sum']):>9} "
              f"{row['normed_max_abs_diff']:>12.3g}")  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "all_reduce_norm_latency.json").write_text(json.dumps(report, indent=2) + "\n")
    ok = all(row["same_sum"] and not row["timed_out"] for row in results["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    sys.exit(main())
