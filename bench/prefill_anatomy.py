"""Where a cold prompt's time to first token goes (`diffulex.bench.prefill_anatomy`): one cold 2k, 8k and 32k-token
prompt of the SDAR-1.7B and 8B geometries (random weights, bf16, the sweep's engine settings) under torch.profiler,
GPU time per kernel class (attention, GEMMs, elementwise, sampling, other) against each class's floor.

    PYTHONPATH=. python bench/prefill_anatomy.py OUT_DIR [--models sdar-1.7b sdar-8b] [--lengths 2048 8192 32000]
    PYTHONPATH=. python bench/prefill_anatomy.py OUT_DIR --quick    # the tiny checkpoint on a CPU: the plumbing
    PYTHONPATH=. python bench/prefill_anatomy.py OUT_DIR --lengths 2048 --max-prefill-graph-tokens 512

With ``--max-prefill-graph-tokens`` the engine takes prompts up to that many rows into prefill graphs (by default
2,048); a longer prompt runs its step eagerly, whose launches can outlast its kernels on a small model.

Writes ``OUT_DIR/prefill_anatomy.json`` and prints a table per prompt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from diffulex.bench.prefill_anatomy import run_anatomy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--models", nargs="+", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--data-dir", default=None, help="SDAR config and tokenizer files (default: tests/data)")
    ap.add_argument("--quick", action="store_true", help="the tiny SDAR checkpoint and short prompts, any device")
    ap.add_argument("--max-prefill-graph-tokens", type=int, default=None,
                    help="the engine field (default: its own, 2048): the longest prompt prefix a prefill graph takes; "
                         "longer ones run their step eagerly")
    args = ap.parse_args()
    if not args.quick and not torch.cuda.is_available():
        print("prefill_anatomy: no CUDA device (the GPU geometries need one; --quick runs the tiny checkpoint)",
              file=sys.stderr)
        return 2
    graph_tokens = args.max_prefill_graph_tokens
    fields = {} if graph_tokens is None else {"max_prefill_graph_tokens": graph_tokens}
    report = run_anatomy(args.out_dir, args.quick, args.models, args.lengths, args.data_dir, engine_fields=fields)
    print(f"wrote {args.out_dir / 'prefill_anatomy.json'} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
