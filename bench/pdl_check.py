"""GPU check that programmatic dependent launch (`diffulex.kernels.pdl`) changes timing only, never results.

    DIFFULEX_PDL=1 python bench/pdl_check.py --out runs/pdl_on.json
    DIFFULEX_PDL=0 python bench/pdl_check.py --out runs/pdl_off.json --compare runs/pdl_on.json

Decodes fixed random prompts greedily on a random-weight SDAR checkpoint of a real geometry in bf16 (every layer
of the step then runs the Triton kernels, the skinny GEMM with its L2 prefetch included), once with CUDA graphs
and once eagerly, and writes the token ids. The kernels are deterministic, so a race between a kernel and its
predecessor (a read before `wait_for_inputs`) shows up as a token that differs between PDL on and off. Exits 1 on
any difference. (Graph and eager runs are not compared: eagerly, small projections run on cuBLAS rather than the
skinny GEMM, whose bf16 sums round differently, and random weights leave many near-ties.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from diffulex import Diffulex
from diffulex.bench.throughput import _greedy, random_prompts, write_sdar_checkpoint
from diffulex.kernels.pdl import pdl_enabled


def decode(model_dir: Path, enforce_eager: bool, args: argparse.Namespace) -> list[list[int]]:
    engine = Diffulex(
        str(model_dir),
        load_format="dummy",
        decoding_strategy="multi_bd",
        block_size=4,
        buffer_size=args.buffer_size,
        max_num_reqs=args.batch,
        max_model_len=args.prompt_len + args.max_tokens + 8,
        enforce_eager=enforce_eager,
        seed=0,
    )
    try:
        prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, args.batch, args.prompt_len, seed=1)
        outputs = engine.generate(prompts, _greedy(args.max_tokens), use_tqdm=False)
        return [list(o.token_ids) for o in outputs]
    finally:
        engine.exit()
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.7b")
    parser.add_argument("--batch", type=int, default=3)  # 12 rows: PDL is on up to 16
    parser.add_argument("--buffer-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--data-dir", default="tests/data/sdar-4b-chat")
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="a previous run's --out to compare with")
    args = parser.parse_args()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_sdar_checkpoint(tmp, args.size, args.data_dir)
        graphs = decode(model_dir, False, args)
        eager = decode(model_dir, True, args)
    report = {
        "pdl": pdl_enabled(device, 1),
        "env": os.environ.get("DIFFULEX_PDL"),
        "device": torch.cuda.get_device_name(device),
        "graphs": graphs,
        "eager": eager,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report) + "\n", encoding="utf-8")
    failures = []
    if args.compare:
        other = json.loads(Path(args.compare).read_text(encoding="utf-8"))
        for mode in ("graphs", "eager"):
            if other[mode] != report[mode]:
                failures.append(f"{mode} tokens differ from {args.compare} (pdl {other['pdl']} vs {report['pdl']})")
    tokens = sum(len(t) for t in graphs)
    print(f"pdl={report['pdl']} {args.size} batch {args.batch}: {tokens} tokens per mode; " + (
        "; ".join(failures) if failures else "all equal"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
