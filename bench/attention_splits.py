"""Decode attention against the split-KV settings: µs per call, graph-replayed.

    PYTHONPATH=. python bench/attention_splits.py [--out FILE] [--bound 4096] [--contexts 128 ... 4096]
        [--min-keys 64 128 256 512 1024] [--splits 16 32 64] [--split-stages 1 2] [--batch 1 32 128]
        [--page-size 16] [--unsplit-stages 1 2 3]

A decode step launches one attention per layer whose split count is fixed by the graph's key bound
(``max_model_len``), while the actual context may be much shorter. Each call is timed inside a CUDA graph of 20
back-to-back calls (no launch overhead), for SDAR-1.7B and SDAR-8B head shapes (4 rows a request; batch 1, or each
``--batch``: that many requests of the same context, the shape of a large decode step), each context,
and each minimum of keys per split the kernel may use (columns ``minN``, the split count automatic). With
``--splits``, also each forced split count (columns ``sN``), and with ``--split-stages``, every split launch at
each software-pipeline depth (column suffix ``/stagesK``; without it, the kernel's own choice, `_split_stages`); with
``--unsplit-stages``, unsplit launches likewise (suffix ``/unsplit-stagesK``: a large batch's launches, whose grid
fills the GPU without splits).
Reports the K/V bytes each call reads over its time beside (``TB/s`` of the best column).
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


def per_call_us(q, k, v, k_cache, v_cache, meta, min_split_keys: int, num_splits: int | None = None) -> float:
    def calls() -> None:
        for _ in range(CALLS):
            triton_paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5,
                                   min_split_keys=min_split_keys, num_splits=num_splits)

    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return 1e3 * time_ms(graph.replay, 3, 10) / CALLS


def main() -> None:
    from diffulex.kernels import paged_attention as pa

    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--bound", type=int, default=4096, help="max_kv_len the launch is sized for")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--min-keys", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--splits", type=int, nargs="*", default=[], help="forced split counts to time as well")
    ap.add_argument("--split-stages", type=int, nargs="*", default=[], help="forced pipeline depths of split launches")
    ap.add_argument("--unsplit-stages", type=int, nargs="*", default=[],
                    help="forced pipeline depths of unsplit launches")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="requests a launch holds")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page")
    args = ap.parse_args()
    if max(args.contexts) + 4 > args.bound:
        ap.error(f"--bound {args.bound} must cover the longest context plus the block ({max(args.contexts) + 4})")
    rows = []
    saved = pa._STAGES_SPLIT, pa._STAGES_SPLIT_LONG, pa._STAGES_UNSPLIT
    depths = [(None, None), *((d, None) for d in args.split_stages), *((None, d) for d in args.unsplit_stages)]
    for name, heads in (("1.7b", 16), ("8b", 32)):
        for batch, ctx in ((b, c) for b in args.batch for c in args.contexts):
            q, k, v, kc, vc, meta = make_batch([(ctx, 4, 100)] * batch, heads, 8, 128, args.page_size, 4, False,
                                                  torch.bfloat16)
            meta = PagedAttentionMetadata(**{**meta.__dict__, "max_kv_len": args.bound})
            row: dict[str, object] = {"model": name, "batch": batch, "context": ctx}
            for stages, unsplit_stages in depths:  # None: the kernel's own choice
                suffix = "" if stages is None else f"/stages{stages}"
                if stages is not None:
                    pa._STAGES_SPLIT = pa._STAGES_SPLIT_LONG = stages
                if unsplit_stages is not None:
                    pa._STAGES_UNSPLIT = unsplit_stages
                    suffix = f"/unsplit-stages{unsplit_stages}"
                try:
                    for min_keys in args.min_keys:
                        row[f"min{min_keys}{suffix}"] = round(per_call_us(q, k, v, kc, vc, meta, min_keys), 2)
                    for splits in args.splits:
                        row[f"s{splits}{suffix}"] = round(per_call_us(q, k, v, kc, vc, meta, 64, splits), 2)
                finally:
                    pa._STAGES_SPLIT, pa._STAGES_SPLIT_LONG, pa._STAGES_UNSPLIT = saved
            timed = {key: us for key, us in row.items() if key not in ("model", "batch", "context")}
            best = min(timed, key=timed.__getitem__)
            kv_bytes = batch * (ctx + 4) * 8 * 128 * 2 * 2  # K and V of 8 KV heads, bf16
            row |= {"best": best, "best_TBps": round(kv_bytes / (timed[best] * 1e-6) / 1e12, 3)}
            rows.append(row)
            print(row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
