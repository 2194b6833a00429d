"""Batch-1 decode attention against the split-KV minimum (`min_split_keys`): µs per call, graph-replayed.

    PYTHONPATH=. python bench/attention_splits.py [--out FILE]

A decode step at batch 1 launches one attention per layer whose split count is fixed by the graph's key bound
(``max_model_len``), while the actual context may be much shorter. Each call is timed inside a CUDA graph of 20
back-to-back calls (no launch overhead), for SDAR-1.7B and SDAR-8B head shapes, contexts 128 to 4096, and the
minimum keys per split the kernel may use.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_check import make_batch, time_ms  # noqa: E402

from diffulex.attention.metadata import PagedAttentionMetadata  # noqa: E402
from diffulex.kernels import triton_paged_attention  # noqa: E402

CALLS = 20


def per_call_us(q, k, v, k_cache, v_cache, meta, min_split_keys: int) -> float:
    def calls() -> None:
        for _ in range(CALLS):
            triton_paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5,
                                   min_split_keys=min_split_keys)

    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return 1e3 * time_ms(graph.replay, 3, 10) / CALLS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--bound", type=int, default=4096, help="max_kv_len the launch is sized for")
    args = ap.parse_args()
    rows = []
    for name, heads in (("1.7b", 16), ("8b", 32)):
        for ctx in (128, 256, 512, 1024, 2048, 4096):
            q, k, v, kc, vc, meta = make_batch([(ctx, 4, 100)], heads, 8, 128, 16, 4, False, torch.bfloat16)
            meta = PagedAttentionMetadata(**{**meta.__dict__, "max_kv_len": args.bound})
            row = {"model": name, "context": ctx}
            for min_keys in (64, 128, 256, 512, 1024):
                row[f"min{min_keys}"] = round(per_call_us(q, k, v, kc, vc, meta, min_keys), 2)
            rows.append(row)
            print(row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
