"""An MoE family on a GPU (SDAR-MoE or LLaDA2): CUDA-graph decoding against eager decoding, and the step time, on
a random checkpoint of a small MoE geometry (nothing downloaded).

    PYTHONPATH=. python bench/moe_smoke.py [--family sdar_moe|llada2] [--dtype float32] [--impl dense] [--out FILE]

Graph steps run the experts on the `grouped` path (two grouped GEMMs over the stacked weights); eager steps too,
so the two agree unless capture changed something. A float32 engine runs the `dense` path and is compared with the
reference decoder by tests/models/test_families.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.testing.checkpoints import write_tiny_checkpoint

GEOMETRY = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                intermediate_size=1024, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)  # fmt: skip


def run(
    path: str, eager: bool, prompts: list[list[int]], max_tokens: int, fields: dict
) -> tuple[list[list[int]], float, int]:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with Diffulex(path, enforce_eager=eager, buffer_size=1, max_model_len=256, **fields) as llm:
        llm.generate(prompts[:1], greedy, use_tqdm=False)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = llm.generate(prompts, greedy, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        impls = {layer.mlp._impl_for(torch.zeros(1, device="cuda", dtype=llm.dtype))
                 for layer in llm.runner.model.model.layers if hasattr(layer.mlp, "_impl_for")}  # fmt: skip
        print(f"eager={eager} moe paths={sorted(impls)}")
        return [t.token_ids for t in out], elapsed, out.num_engine_steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--family", default="sdar_moe", choices=["sdar_moe", "llada2"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--impl", choices=["grouped", "dense"], help="force this expert path on CUDA (default: chosen)")
    args = ap.parse_args()
    if args.impl:
        from diffulex.layers.moe import SparseMoE

        SparseMoE._impl_for = lambda self, x: args.impl if x.is_cuda else "loop"
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_tiny_checkpoint(tmp, family=args.family, dtype=getattr(torch, args.dtype), init_std=1.0,
                                         seed=3, **GEOMETRY))  # fmt: skip
        fields = {"block_size": 4} if args.family == "sdar_moe" else {}  # LLaDA2: its default, 32
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 370, (n,), generator=gen).tolist() for n in (12, 17, 30, 9)]
        graphs, t_graphs, steps = run(path, False, prompts, 64, fields)
        eager, t_eager, _ = run(path, True, prompts, 64, fields)
    same = sum(a == b for g, e in zip(graphs, eager, strict=True) for a, b in zip(g, e, strict=True))
    total = sum(len(g) for g in graphs)
    report = {"family": args.family, "geometry": GEOMETRY, "dtype": args.dtype, "impl": args.impl or "chosen",
              "graphs_vs_eager_token_agreement": same / total, "tokens": total,
              "engine_steps": steps, "ms_per_step_graphs": 1e3 * t_graphs / steps,
              "ms_per_step_eager": 1e3 * t_eager / steps, "device": torch.cuda.get_device_name()}  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
