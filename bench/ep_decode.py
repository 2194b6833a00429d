"""Expert parallelism on two GPUs: CUDA graphs captured with the experts' all-reduce inside give the tokens of one
GPU, and the decode step time of the SDAR-30B-A3B geometry split over two ranks against its MoE floor per rank
(batch 1 and 16, bf16, graphs, block 4).

    PYTHONPATH=. python bench/ep_decode.py OUT_DIR [--max-steps 100] [--with-one-gpu]

1. Correctness (float32, a small random SDAR-MoE checkpoint with 64-wide heads, so that the Triton attention and the
   graphs run): the same prompts through EP=1, EP=2 (attention replicated) and EP=2 with TP=2 engines, each with its
   decode steps replayed from captured graphs; the tokens must be equal, and the split engines must have captured
   graphs.
2. Timing: `diffulex bench throughput`'s decode measurement (`run_sweep`) of the SDAR-30B-A3B geometry with random
   weights at EP=2 and at EP=2 with TP=2, batch 1 and 16. Each row carries its floors (`diffulex.bench.roofline`):
   per rank, only the experts of that rank its rows select, plus its share (whole at TP=1, a slice at TP=2) of the
   rest. ``--with-one-gpu`` adds EP=1 on one GPU (61 GB of weights: an 80 GB card holds it, with little room).

Prints the results and writes ``OUT_DIR/ep_decode.json`` after each part (a failed part is recorded with its
traceback and the others still run); exits non-zero when a check fails. Needs two CUDA devices and the source
checkout's tests/data/sdar-4b-chat (config and tokenizer of the SDAR geometry).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.tp_decode import attempt, tokens_with_graphs  # the same report and float32 check
from diffulex import Diffulex
from diffulex.bench.throughput import ModelEntry, ThroughputSettings, run_sweep, write_sdar_checkpoint
from diffulex.testing.checkpoints import write_tiny_checkpoint
from diffulex.testing.distributed import free_port

RANKS = 2
# (tensor_parallel_size, expert_parallel_size) of each engine compared: one GPU, experts split, both split
LAYOUTS = ((1, 1), (1, RANKS), (RANKS, RANKS))
BATCHES = [1, 16]
SMALL_MOE = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)  # fmt: skip
SIZE = "30b-a3b"


def label(tp: int, ep: int) -> str:
    return f"TP={tp} EP={ep}"


def check_tokens(tmp: Path) -> dict:
    """Every layout with captured decode graphs, float32: the tokens of one GPU."""
    path = write_tiny_checkpoint(tmp / "small", "sdar_moe", seed=1, init_std=1.0, dtype=torch.float32, **SMALL_MOE)
    tokens, graphs = {}, {}
    for tp, ep in LAYOUTS:
        name = label(tp, ep)
        tokens[name], graphs[name], held = tokens_with_graphs(
            path, experts_on_rank_0, tensor_parallel_size=tp, expert_parallel_size=ep
        )
        print(f"{name}: graphs captured {graphs[name]}, {held} experts per layer on rank 0, "
              f"first answer {tokens[name][0][:12]}")  # fmt: skip
    reference = tokens[label(*LAYOUTS[0])]
    same = {name: toks == reference for name, toks in tokens.items()}
    return {"tokens_match": same, "graphs_captured": graphs, "ok": all(same.values()) and all(graphs.values())}


def experts_on_rank_0(llm: Diffulex) -> int:
    return len(next(layer.mlp for layer in llm.model.model.layers).experts)


def time_steps(tmp: Path, max_steps: int, layouts: list[tuple[int, int]]) -> dict:
    """ms per decode step of the SDAR-30B-A3B geometry in each layout, batch 1 and 16, against its floors."""
    path = write_sdar_checkpoint(tmp / f"sdar-{SIZE}", SIZE)
    entry = ModelEntry(f"sdar-{SIZE}", str(path), "dummy", SIZE)
    rows = {}
    for tp, ep in layouts:
        overrides = {"tensor_parallel_size": tp, "expert_parallel_size": ep, "dtype": "bfloat16",
                     "master_addr": "127.0.0.1", "master_port": free_port()}  # fmt: skip
        settings = ThroughputSettings(
            batch_sizes=BATCHES, buffer_sizes=[1], block_size=4, max_steps=max_steps, max_seconds=20.0,
            max_tokens=256, quick=True, engine_overrides=overrides,
        )  # fmt: skip
        for row in run_sweep([entry], settings)["results"]:
            rows[f"{label(tp, ep)} batch {row['batch']}"] = row
    summary = {}
    for key, row in rows.items():
        if row.get("error"):
            summary[key] = {"error": row["error"]}
            continue
        summary[key] = {name: row[name] for name in ("ms_per_step_mean", "floor_ms", "memory_floor_ms",
                                                     "compute_floor_ms", "floor_ratio", "tokens_per_s",
                                                     "cuda_graphs")}  # fmt: skip
        print(f"SDAR-{SIZE} {key} bf16 block 4: {row['ms_per_step_mean']:.3f} ms/step, floor per rank "
              f"{row['floor_ms']:.3f} ms ({row['bound']}), {row['floor_ratio']:.2f}x the floor, graphs "
              f"{row['cuda_graphs']}")  # fmt: skip
    return {"summary": summary, "rows": rows, "ok": all("error" not in s for s in summary.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--max-steps", type=int, default=100)
    ap.add_argument("--with-one-gpu", action="store_true", help="also time EP=1 on one GPU (61 GB of weights)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < RANKS:
        print(f"needs {RANKS} CUDA devices, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "ep_decode.json"
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "command": " ".join(sys.argv)}  # fmt: skip
    timed = [layout for layout in LAYOUTS if layout != (1, 1) or args.with_one_gpu]
    with tempfile.TemporaryDirectory(prefix="diffulex-ep-") as tmp:
        correctness = attempt(report, "correctness", out, lambda: check_tokens(Path(tmp)))
        timing = attempt(report, "timing", out, lambda: time_steps(Path(tmp), args.max_steps, timed))
    print(f"results: {out}")
    return 0 if correctness.get("ok") and timing.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
