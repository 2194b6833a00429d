"""One MoE layer of the SDAR-30B-A3B geometry (128 experts, top 8, hidden 2048, expert width 768; random bf16
weights) with its experts on one GPU (EP=1) against split over two GPUs (EP=2, NCCL): that both give the same
output, and the ms per layer call of each, inside CUDA graphs, at 4 and 64 rows (batch 1 and 16 at block 4),
against the rank's weight-read floor (the experts it owns that the rows route to, at the measured copy rate).

    PYTHONPATH=. python bench/expert_parallel_step.py OUT_DIR

Needs two CUDA devices of compute capability >= 9.0 (the grouped GEMM path); writes OUT_DIR/expert_parallel_step.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffulex.layers import merge_projections
from diffulex.layers.moe import SoftmaxRouter, SparseMoE, grouped_mm_supported
from diffulex.layers.parallel_state import expert_parallel_group, init_expert_parallel, reset_expert_parallel
from diffulex.testing.distributed import free_port

HIDDEN, EXPERT_WIDTH, EXPERTS, TOP_K = 2048, 768, 128, 8
ROWS = (4, 64)
WORLD = 2
CALLS_PER_GRAPH = 20  # layer calls captured in one graph, so that a replay's launch cost is shared
REPLAYS = 50
WEIGHT_STD = 0.02
# bf16 outputs summed in a different order (and over two ranks) differ by a few units of bf16 rounding
MAX_RELATIVE_ERROR = 2e-2


def copy_rate(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the floor's rate."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * src.numel() * src.element_size() * 10 / (time.perf_counter() - start)


def build(device: torch.device, randomize: bool) -> SparseMoE:
    with torch.device(device):
        moe = SparseMoE(HIDDEN, EXPERT_WIDTH, SoftmaxRouter(HIDDEN, EXPERTS, TOP_K, normalize=True))
    moe = moe.to(torch.bfloat16)
    if randomize:
        with torch.no_grad():
            for param in moe.parameters():
                param.normal_(0.0, WEIGHT_STD)
    return moe


def load_from(split: SparseMoE, whole: SparseMoE) -> None:
    for name, tensor in whole.state_dict().items():
        if name.startswith("experts."):
            split.expert_weight_loader(name, tensor)
        else:
            split.get_parameter(name).data.copy_(tensor)


def ms_per_call(layer: SparseMoE, x: torch.Tensor) -> tuple[float, bool]:
    """Milliseconds per layer call, from graph replays (eager calls where capture fails); and whether graphed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(CALLS_PER_GRAPH):
                layer(x)
        run, graphed = graph.replay, True
    except RuntimeError as err:
        print(f"graph capture failed ({err}); timing eager calls", flush=True)

        def run() -> None:
            for _ in range(CALLS_PER_GRAPH):
                layer(x)

        graphed = False
    run()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (REPLAYS * CALLS_PER_GRAPH), graphed


def expert_bytes(layer: SparseMoE, x: torch.Tensor) -> int:
    """The weights a call must read on this rank: the router, and gate/up/down of each owned expert routed to."""
    _, experts = layer.gate.route(x)
    owned = layer.experts.owned
    used = {e for e in experts.unique().tolist() if e in owned}
    return (len(used) * 3 * HIDDEN * EXPERT_WIDTH + EXPERTS * HIDDEN) * 2


def run_rank(rank: int, port: int, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120),
        device_id=device,
    )  # fmt: skip
    try:
        rate = copy_rate(device)
        reset_expert_parallel()
        torch.manual_seed(0)
        whole = build(device, randomize=True)
        init_expert_parallel()
        split = build(device, randomize=False)
        load_from(split, whole)
        merge_projections(whole)
        merge_projections(split)
        results = []
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN, device=device, generator=torch.Generator(device=device).manual_seed(rows))
            x = x.to(torch.bfloat16)
            with torch.no_grad():
                expected, got = whole(x).float(), split(x).float()
                ep1_ms, ep1_graphed = ms_per_call(whole, x)
                ep2_ms, ep2_graphed = ms_per_call(split, x)
            error = ((got - expected).abs().max() / expected.abs().max()).item()
            ep1_bytes, ep2_bytes = expert_bytes(whole, x), expert_bytes(split, x)
            results.append({
                "rows": rows, "relative_error": error, "ok": error <= MAX_RELATIVE_ERROR,
                "ep1_ms": ep1_ms, "ep2_ms": ep2_ms, "graphed": ep1_graphed and ep2_graphed,
                "ep1_floor_ms": ep1_bytes / rate * 1e3, "ep2_floor_ms": ep2_bytes / rate * 1e3,
                "ep2_owned_experts_read": (ep2_bytes // 2 - EXPERTS * HIDDEN) // (3 * HIDDEN * EXPERT_WIDTH),
            })  # fmt: skip
        report = {"rank": rank, "device": torch.cuda.get_device_name(device), "copy_rate_gb_s": rate / 1e9,
                  "ep_size": expert_parallel_group().size, "results": results}  # fmt: skip
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        reset_expert_parallel()
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder for expert_parallel_step.json")
    out_dir = Path(parser.parse_args().out_dir)
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        print(f"needs {WORLD} CUDA devices; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    if not grouped_mm_supported(torch.zeros(1, device="cuda", dtype=torch.bfloat16)):
        print("needs the grouped GEMM (compute capability >= 9.0, bf16)", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(run_rank, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    summary = {"date": time.strftime("%Y-%m-%d"), "geometry": {"hidden": HIDDEN, "expert_width": EXPERT_WIDTH,
               "experts": EXPERTS, "top_k": TOP_K, "dtype": "bfloat16"}, "ranks": ranks}  # fmt: skip
    (out_dir / "expert_parallel_step.json").write_text(json.dumps(summary, indent=1))
    ok = True
    for rank in ranks:
        for r in rank["results"]:
            ok &= r["ok"]
            print(f"rank {rank['rank']} ({rank['device']}) rows {r['rows']:3d}: EP=1 {r['ep1_ms']:.3f} ms "
                  f"(floor {r['ep1_floor_ms']:.3f}), EP=2 {r['ep2_ms']:.3f} ms (floor {r['ep2_floor_ms']:.3f}, "
                  f"{r['ep2_owned_experts_read']} owned experts read), graphed={r['graphed']}, "
                  f"relative error {r['relative_error']:.2e} {'ok' if r['ok'] else 'TOO LARGE'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
