"""Tensor parallelism on two GPUs: CUDA graphs captured with the all-reduces inside give the tokens of one GPU, and
the decode step time of the SDAR-8B geometry at TP=2 against TP=1 (batch 1, bf16, graphs, block 4).

    PYTHONPATH=. python bench/tp_decode.py OUT_DIR [--size 8b] [--max-steps 200]

1. Correctness (float32, a small random checkpoint with 64-wide heads, so that the Triton attention and the graphs
   run): the same prompts through TP=1 and then two TP=2 engines one after the other, each with its decode steps
   replayed from captured graphs; the tokens must be equal, and the TP=2 engines must have captured graphs and
   all-reduce in their norms over peer memory (the second engine of a process too).
2. Timing: `diffulex bench throughput`'s decode measurement (`run_sweep`) of the SDAR geometry with random weights,
   once with ``tensor_parallel_size=1`` and once with 2; the issue's bar is TP=2 <= 0.6 x TP=1 ms per step.

Prints the results and writes ``OUT_DIR/tp_decode.json`` after each part (a failed part is recorded with its
traceback and the others still run; if the graph timing fails, eager step times are taken instead); exits non-zero
when a check fails. Needs two CUDA
devices and the source checkout's tests/data/sdar-4b-chat (config and tokenizer of the SDAR geometry).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.bench.throughput import ModelEntry, ThroughputSettings, run_sweep, write_sdar_checkpoint
from diffulex.testing.checkpoints import write_tiny_checkpoint
from diffulex.testing.distributed import free_port

TP_SIZES = (1, 2)
TARGET_RATIO = 0.6  # the issue's bar: TP=2 ms per step at most this fraction of TP=1's
SMALL_GEOMETRY = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      intermediate_size=1024)  # fmt: skip


def tokens_with_graphs(path: Path, inspect: Callable[[Diffulex], Any], **layout: int) -> tuple[list, bool, Any]:
    """The float32 check of an engine of ``layout`` (its parallel sizes) with captured decode graphs: the answers
    to four fixed prompts, whether its decode graphs were captured, and what ``inspect`` read of the engine."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 370, (n,), generator=gen).tolist() for n in (12, 17, 30, 9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    fields = dict(dtype="float32", block_size=4, buffer_size=1, max_model_len=256, max_num_reqs=8,
                  master_addr="127.0.0.1", master_port=free_port())  # fmt: skip
    with Diffulex(str(path), **layout, **fields) as llm:
        captured = bool(llm.runner.graphs is not None and llm.runner.graphs.capture_graphs)
        out = llm.generate(prompts, greedy, use_tqdm=False)
        return [t.token_ids for t in out.trajectories], captured, inspect(llm)


def peer_exchanged_projections(llm: Diffulex) -> int:
    """How many row-parallel projections of rank 0's model hand their all-reduce to the next norm over peer memory
    (`diffulex.layers.peer_exchange`); 0 where they all-reduce by NCCL."""
    from diffulex.layers.peer_exchange import row_parallel_projections

    return sum(m.peer_exchange is not None for m in row_parallel_projections(llm.runner.model))


def check_tokens(tmp: Path) -> dict:
    """TP=1 and then two TP=2 engines with captured decode graphs, float32: the same tokens, and each TP=2 engine's
    all-reduces fused into its norms over peer memory."""
    path = write_tiny_checkpoint(tmp / "small", "sdar", seed=1, init_std=1.0, dtype=torch.float32, **SMALL_GEOMETRY)
    tokens, graphs, fused = {}, {}, {}
    # TP=2 twice: a process's second sharded engine maps its peers' memory as its first did
    sizes = (*TP_SIZES, TP_SIZES[-1])
    for run, size in enumerate(sizes):
        tokens[run], graphs[run], (continued, fused[run]) = tokens_with_graphs(
            path, lambda llm: (llm.num_continuations, peer_exchanged_projections(llm)), tensor_parallel_size=size
        )
        print(f"TP={size}: graphs captured {graphs[run]}, {continued} continued steps, {fused[run]} projections "
              f"all-reduced in the next norm over peer memory, first answer {tokens[run][0][:12]}")  # fmt: skip
    same = all(answer == tokens[0] for answer in tokens.values())
    sharded_fused = all(fused[run] > 0 for run, size in enumerate(sizes) if size > 1)
    return {"tokens_match": same, "graphs_captured": graphs, "peer_exchanged_projections": fused,
            "ok": same and all(graphs.values()) and sharded_fused}  # fmt: skip


def time_steps(tmp: Path, size: str, max_steps: int, enforce_eager: bool) -> dict:
    """ms per decode step of the SDAR geometry at each TP size (graphs unless ``enforce_eager``)."""
    path = write_sdar_checkpoint(tmp / f"sdar-{size}", size)
    entry = ModelEntry(f"sdar-{size}", str(path), "dummy", size)
    rows = {}
    for tp in TP_SIZES:
        overrides = {"tensor_parallel_size": tp, "dtype": "bfloat16", "enforce_eager": enforce_eager,
                     "master_addr": "127.0.0.1", "master_port": free_port()}  # fmt: skip
        settings = ThroughputSettings(
            batch_sizes=[1], buffer_sizes=[1], block_size=4, max_steps=max_steps, max_seconds=30.0, max_tokens=512,
            quick=True, engine_overrides=overrides,
        )  # fmt: skip
        (rows[tp],) = run_sweep([entry], settings)["results"]
    errors = {tp: row["error"] for tp, row in rows.items() if row.get("error")}
    if errors:
        return {"errors": errors, "rows": rows}
    ms = {tp: rows[tp]["ms_per_step_mean"] for tp in TP_SIZES}
    ratio = ms[2] / ms[1]
    mode = "eager" if enforce_eager else "graphs"
    print(f"SDAR-{size} batch 1 bf16 {mode} block 4: TP=1 {ms[1]:.3f} ms/step, TP=2 {ms[2]:.3f} ms/step, "
          f"ratio {ratio:.3f} (target <= {TARGET_RATIO})")  # fmt: skip
    return {"ms_per_step": ms, "ratio": ratio, "target_ratio": TARGET_RATIO, "meets_target": ratio <= TARGET_RATIO,
            "rows": rows}  # fmt: skip


def attempt(report: dict, key: str, out: Path, part: Callable[[], dict]) -> dict:
    """Run one part, record its result or its failure, and write the report so far (a later part may not end)."""
    try:
        report[key] = part()
    except Exception as err:  # noqa: BLE001  (recorded: the other parts still run)
        traceback.print_exc()
        report[key] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report[key]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--size", default="8b")
    ap.add_argument("--max-steps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < max(TP_SIZES):
        print(f"needs {max(TP_SIZES)} CUDA devices, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "tp_decode.json"
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "command": " ".join(sys.argv)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="diffulex-tp-") as tmp:
        correctness = attempt(report, "correctness", out, lambda: check_tokens(Path(tmp)))
        timing = attempt(report, "timing", out, lambda: time_steps(Path(tmp), args.size, args.max_steps, False))
        if "ms_per_step" not in timing:  # the graphs failed: at least the eager step times
            attempt(report, "timing_eager", out, lambda: time_steps(Path(tmp), args.size, args.max_steps, True))
    print(f"results: {out}")
    return 0 if correctness.get("ok") and "ms_per_step" in timing else 1


if __name__ == "__main__":
    sys.exit(main())
