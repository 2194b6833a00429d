"""One request on a random-weight LLaDA2.0-mini geometry (16B total, 256 experts, top 8, block 32): milliseconds per
decode step with CUDA graphs, against the bytes a step must read (nothing downloaded; the tokenizer is the tiny
LLaDA2 one, the embedding has the real 157184 rows).

    PYTHONPATH=. python bench/llada2_mini_step.py [--out FILE]

The floor counts what one step of 32 rows reads: every non-expert weight (embedding rows aside) and, per MoE layer,
the experts its rows choose. Random routing is near uniform, so ``E * (1 - (1 - k/E)^rows)`` distinct experts of
``E`` are expected per layer (about 163 of 256 at 32 rows), the figure peers use (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.testing.checkpoints import write_tiny_checkpoint

LLADA2_MINI = dict(hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4,
                   head_dim=128, intermediate_size=5120, moe_intermediate_size=512, num_experts=256,
                   num_experts_per_tok=8, num_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                   first_k_dense_replace=1, partial_rotary_factor=0.5, rotary_dim=64, vocab_size=157184,
                   max_position_embeddings=8192, torch_dtype="bfloat16")  # fmt: skip
BLOCK = 32


def write_folder(tmp: Path) -> Path:
    tiny = write_tiny_checkpoint(tmp / "tiny", family="llada2")
    folder = tmp / "llada2-mini"
    folder.mkdir()
    for item in tiny.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, folder / item.name)
    config = json.loads((tiny / "config.json").read_text())
    config.update(LLADA2_MINI)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def floor_bytes(c: dict) -> float:
    h, hd, bf16 = c["hidden_size"], c["head_dim"], 2
    attention = ((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd * h + c["num_attention_heads"] * hd * h)
    expert = 3 * c["moe_intermediate_size"] * h
    e, k = c["num_experts"], c["num_experts_per_tok"]
    distinct = e * (1 - (1 - k / e) ** BLOCK)
    dense_layers = c["first_k_dense_replace"]
    moe_layers = c["num_hidden_layers"] - dense_layers
    per_moe = e * h + expert * c["num_shared_experts"] + distinct * expert
    total = c["num_hidden_layers"] * attention + dense_layers * 3 * c["intermediate_size"] * h + moe_layers * per_moe
    return (total + c["vocab_size"] * h) * bf16  # + the LM head


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp))
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
    steps = out.num_engine_steps
    peak_tb_s = 3.0 if "H100" in torch.cuda.get_device_name() else 4.3
    floor_ms = floor_bytes(LLADA2_MINI) / (peak_tb_s * 1e12) * 1e3
    report = {"device": torch.cuda.get_device_name(), "engine_build_s": build_s, "moe_paths": paths, "steps": steps,
              "tokens": len(out[0].token_ids), "ms_per_step": 1e3 * elapsed / steps,
              "floor_gb_per_step": floor_bytes(LLADA2_MINI) / 1e9, "floor_ms_at_nominal_bandwidth": floor_ms,
              "nominal_bandwidth_tb_s": peak_tb_s}  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
