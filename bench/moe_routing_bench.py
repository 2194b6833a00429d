"""MoE routers' expert selection (`diffulex.kernels.moe_routing`) against the rows each program selects for:
microseconds a call, graph-replayed.

    PYTHONPATH=. python bench/moe_routing_bench.py [--out FILE] [--rows 4 32 128 256] [--rows-per-program 1 2 4 8 16]

Why: the selection is one small launch per MoE layer (48 a step at SDAR-30B-A3B, 19 at LLaDA2-mini), and at decode
sizes its time is latency: a program picks its rows' experts one after another (``top_k`` rounds of reductions
over every expert, after LLaDA2's ``topk_group`` rounds over the groups), so the rows one program takes trade the
launch's parallelism against each round's width. LLaDA2-mini at batch 1 (32 rows) showed 8 us a selection in a
step's profile (`bench/step_anatomy.py`), wait for the router GEMM included.

Each call is timed inside a CUDA graph of 20 back-to-back calls (no launch overhead; the best of 5 replays,
`diffulex.bench.hardware.time_graph_calls`), for SDAR-30B-A3B's softmax
router (128 experts, top 8, renormalized) and LLaDA2-mini's group-limited one (256 experts in 8 groups, 4 open, top
8, with the expert bias), float32 router scores, at each row count: one column per forced rows-per-program
(``rpN``) and the kernel's own choice (``auto``, the rows-per-program it takes in brackets). Every forced choice's
experts are checked against the automatic one's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from diffulex.bench.hardware import time_graph_calls
from diffulex.kernels import moe_routing

CALLS = 20
# (name, experts, top_k, groups, open groups): the routers of the MoE geometries (docs/models.md)
ROUTERS = (("sdar-30b-a3b softmax", 128, 8, None, None), ("llada2-mini group-limited", 256, 8, 8, 4))


def selection(router: tuple, logits: torch.Tensor, bias: torch.Tensor, rows_per_program: int | None):
    """The router's selection over ``logits`` with the given rows per program (None: the kernel's choice), as a
    call `time_graph_calls` can repeat (its call index unused)."""
    _, _, top_k, groups, open_groups = router
    if groups is None:
        return lambda _call=0: moe_routing.softmax_topk(logits, top_k, True, rows_per_program)
    return lambda _call=0: moe_routing.group_limited_topk(
        logits, bias, groups, open_groups, top_k, 2.5, 1e-20, rows_per_program
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 32, 128, 256], help="router rows a call selects for")
    ap.add_argument("--rows-per-program", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("moe_routing_bench: needs a CUDA device (the CPU tests run the kernels under the interpreter)",
              file=sys.stderr)  # fmt: skip
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for router in ROUTERS:
        name, experts = router[0], router[1]
        bias = 0.3 * torch.randn(experts, device="cuda", generator=gen)
        for rows in args.rows:
            logits = torch.randn(rows, experts, device="cuda", generator=gen)
            auto = moe_routing._rows_per_program(None, experts, rows)
            _, want = selection(router, logits, bias, None)()
            row = {"router": name, "rows": rows, "auto_rows_per_program": auto}
            for rpp in [*args.rows_per_program, None]:
                call = selection(router, logits, bias, rpp)
                if not torch.equal(call()[1], want):
                    raise SystemExit(f"{name}, {rows} rows: {rpp} rows a program chose other experts")
                row["auto" if rpp is None else f"rp{rpp}"] = round(time_graph_calls(call, CALLS), 2)
            results.append(row)
            print(row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"tool": "moe_routing_bench", "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
