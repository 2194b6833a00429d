"""GPU correctness check of the fast path: CUDA graphs, compiled forward, Triton kernels, bf16.

    python bench/gpu_smoke.py --out runs/gpu_smoke.json

1. A tiny confident random SDAR checkpoint in float32, 8 requests with preemption: the engine with CUDA graphs
   equals the reference decoder token for token, and equals the eager engine (``enforce_eager=True``); the
   same with the compiled forward (``enable_cudagraph_torch_compile=True``).
2. The built-in model on held-out arithmetic questions: bf16 graphs vs bf16 eager, and bf16 vs float32 (share of
   answer positions with the same token, and answers with the same final number).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

import diffulex
from diffulex import Diffulex, SamplingParams
from diffulex.testing.checkpoints import write_tiny_checkpoint
from diffulex.testing.reference_decoder import reference_for_engine


def prompts_for(llm, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    banned = set(llm.settings.stop_token_ids) | {llm.mask_token_id}
    allowed = [t for t in range(llm.vocab_limit) if t not in banned]
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def graph_steps(llm) -> list[int]:
    """Record the bucket of every step served by a captured graph."""
    used: list[int] = []
    graphs = llm.runner.graphs
    if graphs is None:
        return used
    original = graphs.run

    def run(step, bucket, *args):
        used.append(bucket)
        return original(step, bucket, *args)

    graphs.run = run
    return used


def agreement(a_list, b_list) -> float:
    same = total = 0
    for a, b in zip(a_list, b_list, strict=True):
        n = min(len(a.token_ids), len(b.token_ids))
        same += sum(x == y for x, y in zip(a.token_ids[:n], b.token_ids[:n], strict=True))
        total += max(len(a.token_ids), len(b.token_ids))
    return same / max(total, 1)


def tiny_checks(attn_impl: str, report: dict) -> None:
    fields = dict(block_size=4, page_size=8, buffer_size=2, max_model_len=96, max_num_batched_tokens=1024,
                  accept_threshold=0.7, num_pages=24, attn_impl=attn_impl, max_num_reqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "m", family="sdar", seed=1, init_std=1.0)
        runs = {}
        for name, extra in [
            ("eager", dict(enforce_eager=True)),
            ("graphs", {}),
            ("graphs_compiled", dict(enable_cudagraph_torch_compile=True)),
        ]:
            t0 = time.perf_counter()
            try:
                llm = Diffulex(str(ckpt), dtype="float32", **fields, **extra)
            except Exception as err:  # report and go on with the other checks
                report[f"{attn_impl}/{name}"] = {"error": repr(err)[:500]}
                continue
            with llm:
                init = time.perf_counter() - t0
                prompts = prompts_for(llm, [3, 7, 12, 17, 5, 9, 22, 2], seed=0)
                used = graph_steps(llm)
                out = llm.generate(prompts, params, use_tqdm=False)
                mismatches = sum(
                    traj.token_ids != reference_for_engine(llm, prompt, params).token_ids
                    for prompt, traj in zip(prompts, out, strict=True)
                )
                runs[name] = out
                report[f"{attn_impl}/{name}"] = {
                    "init_seconds": round(init, 2),
                    "steps": out.num_engine_steps,
                    "graph_steps": len(used),
                    "buckets": sorted(set(used)),
                    "mismatches_vs_reference": mismatches,
                    "preemptions": sum(t.num_preemptions for t in out),
                }
        for name in ("graphs", "graphs_compiled"):
            if name in runs:
                same = [t.token_ids for t in runs[name]] == [t.token_ids for t in runs["eager"]]
                report[f"{attn_impl}/{name}"]["same_tokens_as_eager"] = same


def builtin_checks(report: dict, n: int) -> None:
    from diffulex.bench.arithmetic import generate_problems

    problems = generate_problems(n, 1234)
    params = SamplingParams(temperature=0.0, max_tokens=128)
    outs = {}
    for name, extra in [
        ("fp32", dict(dtype="float32")),
        ("bf16_eager", dict(dtype="bfloat16", enforce_eager=True)),
        ("bf16", dict(dtype="bfloat16")),
    ]:
        with Diffulex(diffulex.BUILTIN_MODEL, buffer_size=1, accept_threshold=0.9, **extra) as llm:
            prompts = [p["question"] for p in problems]  # generate asks a chat model through its template
            t0 = time.perf_counter()
            outs[name] = llm.generate(prompts, params, use_tqdm=False)
            report[f"builtin/{name}_seconds"] = round(time.perf_counter() - t0, 2)

    def final(text: str) -> str | None:
        return text.rsplit("####", 1)[-1].strip() if "####" in text else None

    correct = {k: sum(final(t.text) == final(p["answer"]) for t, p in zip(v, problems, strict=True))
               for k, v in outs.items()}
    report["builtin/problems"] = n
    report["builtin/correct"] = correct
    report["builtin/bf16_graphs_vs_bf16_eager_token_agreement"] = agreement(outs["bf16"], outs["bf16_eager"])
    report["builtin/bf16_vs_fp32_token_agreement"] = agreement(outs["bf16"], outs["fp32"])
    report["builtin/bf16_vs_fp32_same_answer"] = sum(
        final(a.text) == final(b.text) for a, b in zip(outs["bf16"], outs["fp32"], strict=True)
    ) / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--attn-impl", nargs="+", default=["triton_grouped", "triton"])
    parser.add_argument("--builtin-problems", type=int, default=200)
    parser.add_argument("--skip-tiny", action="store_true", help="only the built-in model checks")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this check needs a GPU"
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d")}
    for impl in [] if args.skip_tiny else args.attn_impl:
        tiny_checks(impl, report)
        print(json.dumps({k: v for k, v in report.items() if k.startswith(impl)}, indent=1), flush=True)
    if args.builtin_problems:
        builtin_checks(report, args.builtin_problems)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
