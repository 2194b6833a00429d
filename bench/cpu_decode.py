"""Batch-1 decode on a CPU: engine build time, step time and tokens/s of the built-in model (or another checkpoint).

    python bench/cpu_decode.py [--threads 2] [--buffer-sizes 1 2] [--problems 8] [--model DIR]

Why: the CPU is where a newcomer meets the engine first, so its defaults (threads, page pool) and speed are
measured where they are used. Each problem of the shipped arithmetic test set is sent alone, in the model's chat
format (as token ids, so nothing else wraps it), greedy, until the model stops. ``step`` is the median wall time
of the engine steps after each request's first (the first also encodes the prompt); ``tok/s`` is generated tokens
over the wall time of the generate calls; TPF is generated tokens per forward. ``build`` is the engine
constructor's wall time in this process after the imports, the way a server or notebook pays it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from importlib import resources

import torch

import diffulex
import diffulex.models  # noqa: F401  (imported here so that the build time below excludes imports)
import diffulex.strategy  # noqa: F401
import diffulex.tokenizer  # noqa: F401
from diffulex import Diffulex, SamplingParams
from diffulex.engine.cpu_resources import usable_cores
from diffulex.models.loader import build_model  # noqa: F401


def chat_prompts(llm, count: int) -> list[list[int]]:
    data = json.loads(resources.files("diffulex.bench").joinpath("data/arithmetic_test.json").read_text())
    texts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": item["question"]}], add_generation_prompt=True, tokenize=False
        )
        for item in data[:count]
    ]
    return [llm.tokenizer.encode(text, add_special_tokens=False) for text in texts]


def measure(model: str, buffer_size: int, threads: int | None, problems: int) -> dict:
    fields = {"buffer_size": buffer_size, "cpu_threads": threads}
    t0 = time.perf_counter()
    llm = Diffulex(model, **fields)
    build_s = time.perf_counter() - t0
    prompts = chat_prompts(llm, problems)
    params = SamplingParams(temperature=0.0, max_tokens=128)
    llm.generate(prompts[0], params, use_tqdm=False)  # the first call's one-time costs
    steps, tokens, forwards, wall = [], 0, 0, 0.0
    for prompt in prompts:
        out = llm.generate(prompt, params, use_tqdm=False)
        trajectory = out.trajectories[0]
        steps += [s.step_time for s in trajectory.steps[1:]]
        tokens += trajectory.num_generated_tokens
        forwards += trajectory.nfe
        wall += out.wall_time
    llm.exit()
    return {
        "buffer_size": buffer_size,
        "threads": torch.get_num_threads(),
        "build_s": build_s,
        "step_ms": statistics.median(steps) * 1e3,
        "tok_s": tokens / wall,
        "tpf": tokens / forwards,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=diffulex.BUILTIN_MODEL)
    parser.add_argument("--threads", type=int, default=None, help="cpu_threads; default: the engine's choice")
    parser.add_argument("--buffer-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--problems", type=int, default=8)
    args = parser.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {usable_cores()} usable cores, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("| buffer | threads | build (s) | step (ms) | tok/s | TPF | tokens |")
    print("|---|---|---|---|---|---|---|")
    for buffer_size in args.buffer_sizes:
        r = measure(args.model, buffer_size, args.threads, args.problems)
        print(
            f"| {r['buffer_size']} | {r['threads']} | {r['build_s']:.2f} | {r['step_ms']:.1f} | {r['tok_s']:.0f} | "
            f"{r['tpf']:.2f} | {r['tokens']} |"
        )


if __name__ == "__main__":
    main()
