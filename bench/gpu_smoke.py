"""GPU smoke check: the engine on CUDA reproduces the reference decoder in float32, and bf16 mostly agrees.

    python bench/gpu_smoke.py --out runs/gpu_smoke.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.testing.checkpoints import write_tiny_checkpoint
from diffulex.testing.reference_decoder import reference_generate


def prompts_for(llm, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    banned = set(llm.settings.stop_token_ids) | {llm.mask_token_id}
    allowed = [t for t in range(llm.vocab_limit) if t not in banned]
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--attn-impl", default="triton_grouped", choices=["triton_grouped", "triton", "naive"])
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this check needs a GPU"
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    fields = dict(block_size=4, page_size=8, buffer_size=2, max_model_len=96, max_num_batched_tokens=1024,
                  accept_threshold=0.7, num_pages=24, attn_impl=args.attn_impl)
    report["attn_impl"] = args.attn_impl
    params = SamplingParams(temperature=0.0, max_tokens=40)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "m", family="sdar", seed=1, init_std=1.0)
        with Diffulex(str(ckpt), dtype="float32", **fields) as llm:
            assert llm.device.type == "cuda"
            prompts = prompts_for(llm, [3, 7, 12, 17, 5, 9, 22, 2], seed=0)
            t0 = time.perf_counter()
            out32 = llm.generate(prompts, params, use_tqdm=False)
            report["fp32_seconds"] = time.perf_counter() - t0
            mismatches = 0
            for prompt, traj in zip(prompts, out32, strict=True):
                th = llm.config.decoding_thresholds
                ref = reference_generate(
                    llm.model, prompt, mask_token_id=llm.mask_token_id, block_size=4, buffer_size=2,
                    max_tokens=params.max_tokens, max_model_len=llm.config.max_model_len,
                    stop_token_ids=llm.settings.stop_token_ids, accept_threshold=th.accept_threshold,
                    add_block_threshold=th.add_block_threshold, semi_complete_threshold=th.semi_complete_threshold,
                    vocab_limit=llm.vocab_limit,
                )
                mismatches += traj.token_ids != ref.token_ids
            report["fp32_requests"] = len(prompts)
            report["fp32_mismatches_vs_reference"] = mismatches
            report["preemptions"] = sum(t.num_preemptions for t in out32)
        with Diffulex(str(ckpt), dtype="bfloat16", **fields) as llm:
            out16 = llm.generate(prompts, params, use_tqdm=False)
        same = total = 0
        for a, b in zip(out32, out16, strict=True):
            n = min(len(a.token_ids), len(b.token_ids))
            same += sum(x == y for x, y in zip(a.token_ids[:n], b.token_ids[:n], strict=True))
            total += max(len(a.token_ids), len(b.token_ids))
        report["bf16_token_agreement"] = same / max(total, 1)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
