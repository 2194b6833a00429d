"""One request on a random-weight LLaDA2.0-mini geometry (16B total, 256 experts, top 8, block 32): milliseconds per
decode step with CUDA graphs, against the bytes a step must read (nothing downloaded; the folder is the throughput
harness's `write_llada2_checkpoint`, the floor its MoE-aware roofline).

    PYTHONPATH=. python bench/llada2_mini_step.py [--out FILE]

The floor counts what one step of 32 rows reads: every non-expert weight (embedding rows aside) and, per MoE layer,
the experts its rows are expected to choose under uniform routing (about 163 of 256), the figure peers use.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.bench.roofline import StepWork, cost_model_from_module, step_bytes
from diffulex.bench.throughput import write_llada2_checkpoint

BLOCK = 32


def floor_bytes(model: torch.nn.Module) -> int:
    cost = cost_model_from_module(model, itemsize=2)
    return step_bytes(cost, StepWork(query_tokens=BLOCK, logit_rows=BLOCK, context_tokens=0, written_tokens=0,
                                     attn_pairs=0))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_llada2_checkpoint(Path(tmp) / "llada2-mini", "llada2-mini")
        t0 = time.perf_counter()
        with Diffulex(str(folder), load_format="dummy", buffer_size=1, max_model_len=512, max_num_reqs=4) as llm:
            build_s = time.perf_counter() - t0
            prompt = torch.randint(0, 370, (128,), generator=torch.Generator().manual_seed(0)).tolist()
            greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=BLOCK, ignore_eos=True), use_tqdm=False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = llm.generate([prompt], greedy, use_tqdm=False)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            paths = sorted({layer.mlp._impl_for(torch.zeros(1, device="cuda", dtype=torch.bfloat16))
                            for layer in llm.runner.model.model.layers if hasattr(layer.mlp, "_impl_for")})  # fmt: skip
            floor = floor_bytes(llm.model)
    steps = out.num_engine_steps
    peak_tb_s = 3.0 if "H100" in torch.cuda.get_device_name() else 4.3
    report = {"device": torch.cuda.get_device_name(), "engine_build_s": build_s, "moe_paths": paths, "steps": steps,
              "tokens": len(out[0].token_ids), "ms_per_step": 1e3 * elapsed / steps,
              "floor_gb_per_step": floor / 1e9, "floor_ms_at_nominal_bandwidth": floor / (peak_tb_s * 1e12) * 1e3,
              "nominal_bandwidth_tb_s": peak_tb_s}  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
