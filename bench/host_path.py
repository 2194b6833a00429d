"""The host's share of an engine step, with the model forward stubbed out (CPU; no GPU needed).

    CUDA_VISIBLE_DEVICES= python bench/host_path.py --batch-sizes 1 8 64 128 [--steps 100] [--json FILE]
    CUDA_VISIBLE_DEVICES= python bench/host_path.py --cold-prompts 2048 8192 32000 [--json FILE]

Why: with CUDA graphs a decode step's GPU work is a few milliseconds, and everything the host does between the
sampler's result and the next graph launch (finish the step, schedule, collect the inputs) leaves the GPU idle.
On an H100 at batch 64 that path took about 0.7-1 ms of a 4.2 ms step (`bench/step_anatomy.py`). This harness
times exactly that Python, per phase, on a tiny random SDAR checkpoint whose forward returns zeros at once (the
sampler then sees uniform logits and accepts one forced token per block and step, like random weights).

Phases (ms per step): ``schedule``, ``collect`` (the flat inputs), ``inputs`` (their tensors, the eager path's
part of the graph fill), ``finish`` (`Scheduler.finish_step` for every request), ``sampler`` (host part of
sampling: on a GPU it runs while the forward does, so it is off the critical path) and ``rest`` (the engine's
own loop: records and updates). ``critical`` = everything but the sampler.

``--cold-prompts``: instead, the host's part of a cold prompt's time to first token (what the sweep's ``prefill``
target times: ``add_request`` and the one step that prefills the prompt and accepts its first token, which also
launches the step after it), per phase: ``add`` (`add_request`), ``schedule``, ``collect``, ``inputs``,
``forward`` (the stub: rows of a zero tensor made once), ``sampler``, ``finish`` and ``other`` (the engine's loop,
what the phases leave); the median of ``--repeats`` prompts per length, after an untimed one of the same length
(``ttft_host_min``: the fastest of them, the least disturbed on a shared machine).
``--profile N`` prints the N costliest functions of those prompts under cProfile.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.testing.checkpoints import write_tiny_checkpoint


def _timed(acc: dict[str, float], key: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0

    return wrapper


def measure(model_dir: Path, batch: int, steps: int, prompt_len: int, buffer_size: int) -> dict:
    llm = Diffulex(
        str(model_dir),
        block_size=4,
        page_size=32,
        buffer_size=buffer_size,
        max_num_reqs=batch,
        max_model_len=prompt_len + 2 * steps + 64,
        max_num_batched_tokens=max(8192, batch * (prompt_len + 8)),
    )
    gen = torch.Generator().manual_seed(batch)
    draws = torch.randint(0, llm.vocab_limit, (batch, prompt_len), generator=gen).tolist()
    prompts = [[t if t != llm.mask_token_id else 0 for t in row] for row in draws]
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 32, ignore_eos=True)
    for prompt in prompts:
        llm.add_request(prompt, params)
    for _ in range(3):  # admit and prefill with the real forward
        llm.step()
    runner, scheduler = llm.runner, llm.scheduler
    hidden = runner.token_embedding().embedding_dim
    runner.forward = lambda ids, positions, meta: torch.zeros(ids.shape[0], hidden)
    acc: dict[str, float] = collections.defaultdict(float)
    scheduler.schedule = _timed(acc, "schedule", scheduler.schedule)
    scheduler.finish_step = _timed(acc, "finish", scheduler.finish_step)
    runner.collect = _timed(acc, "collect", runner.collect)
    runner._eager_inputs = _timed(acc, "inputs", runner._eager_inputs)
    runner.sampler.launch = _timed(acc, "sampler", runner.sampler.launch)
    runner.launch = _timed(acc, "run", runner.launch)
    for _ in range(5):
        llm.step()
    acc.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    total = time.perf_counter() - t0
    llm.exit()
    row = {k: 1e3 * v / steps for k, v in acc.items()}
    row["step"] = 1e3 * total / steps
    row["rest"] = row["step"] - row["schedule"] - row["run"] - row["finish"]  # run: `ModelRunner.launch`
    row["critical"] = row["step"] - row["sampler"]
    row.pop("run")
    return {"batch": batch, **{k: round(v, 4) for k, v in row.items()}}


def measure_cold_prompt(model_dir: Path, prompt_lens: list[int], repeats: int, profile: int = 0) -> list[dict]:
    """Host milliseconds of `add_request` and of the first step of a cold prompt of each length, per phase: the
    median of ``repeats`` prompts, after an untimed one of the same length. With ``profile``, the timed prompts
    of each length run under cProfile and its ``profile`` costliest functions (own time) are printed."""
    llm = Diffulex(str(model_dir), block_size=4, buffer_size=1, max_num_reqs=4, max_model_len=max(prompt_lens) + 64,
                   max_num_batched_tokens=max(prompt_lens) + 64, enable_prefix_caching=True)
    runner, scheduler = llm.runner, llm.scheduler
    # the forward's stand-in returns rows of one zero tensor made once: on a GPU the host's part of a prompt's
    # forward is its launches, not a pass over its rows
    zeros = torch.zeros(max(prompt_lens) + 64, runner.token_embedding().embedding_dim)
    acc: dict[str, float] = collections.defaultdict(float)
    runner.forward = _timed(acc, "forward", lambda ids, positions, meta: zeros[: ids.shape[0]])
    scheduler.schedule = _timed(acc, "schedule", scheduler.schedule)
    scheduler.finish_step = _timed(acc, "finish", scheduler.finish_step)
    runner.collect = _timed(acc, "collect", runner.collect)
    runner._eager_inputs = _timed(acc, "inputs", runner._eager_inputs)
    runner.sampler.launch = _timed(acc, "sampler", runner.sampler.launch)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rows = []
    for n in prompt_lens:
        samples: list[dict[str, float]] = []
        profiler = cProfile.Profile() if profile else None
        for seed in range(2 * n, 2 * n + repeats + 1):  # the first of each length is untimed
            gen = torch.Generator().manual_seed(seed)
            prompt = [t if t != llm.mask_token_id else 0
                      for t in torch.randint(0, llm.vocab_limit, (n,), generator=gen).tolist()]  # fmt: skip
            timed = seed > 2 * n
            acc.clear()
            if profiler is not None and timed:
                profiler.enable()
            t0 = time.perf_counter()
            llm.add_request(prompt, params)
            added = time.perf_counter() - t0
            llm.step()
            total = time.perf_counter() - t0
            if profiler is not None and timed:
                profiler.disable()
            if timed:  # the phases of the span only, not of the steps that finish the request
                sample = {"add": added, **acc, "ttft_host": total}
                sample["other"] = total - sum(v for k, v in sample.items() if k != "ttft_host")
                samples.append(sample)
            while llm.scheduler.waiting or llm.scheduler.running:
                llm.step()
        rows.append({"prompt_len": n, "repeats": repeats,
                     **{k: round(1e3 * statistics.median(s[k] for s in samples), 4) for k in samples[0]},
                     "ttft_host_min": round(1e3 * min(s["ttft_host"] for s in samples), 4)})  # fmt: skip
        if profiler is not None:
            print(f"--- cProfile, {repeats} cold prompts of {n} tokens (add_request and the first step) ---")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    llm.exit()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 128])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--buffer-size", type=int, default=1)
    parser.add_argument("--cold-prompts", type=int, nargs="+", default=None,
                        help="measure a cold prompt's first step at these lengths instead")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="cold prompts timed per length (median)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="with --cold-prompts: print the N costliest functions under cProfile")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", family="sdar", seed=0)
        if args.cold_prompts:
            config = json.loads((model_dir / "config.json").read_text())
            config["max_position_embeddings"] = max(args.cold_prompts) + 64  # the tiny model's positions, widened
            (model_dir / "config.json").write_text(json.dumps(config))
            rows = measure_cold_prompt(model_dir, args.cold_prompts, args.repeats, args.profile)
            first = "prompt_len"
            keys = ["add", "schedule", "collect", "inputs", "forward", "sampler", "finish", "other", "ttft_host",
                    "ttft_host_min"]  # fmt: skip
        else:
            rows = [measure(model_dir, b, args.steps, args.prompt_len, args.buffer_size) for b in args.batch_sizes]
            first, keys = "batch", ["schedule", "collect", "inputs", "finish", "rest", "sampler", "critical", "step"]
    widths = [max(9, len(k)) for k in keys]
    print(f"{first:>10} " + " ".join(f"{k:>{w}}" for k, w in zip(keys, widths, strict=True)) + "   (ms)")
    for row in rows:
        print(f"{row[first]:>10} " + " ".join(f"{row.get(k, 0.0):>{w}.3f}" for k, w in zip(keys, widths, strict=True)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
