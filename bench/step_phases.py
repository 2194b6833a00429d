"""Host time per engine step on the GPU machine, by phase, with or without micro-batches (timing only).

    PYTHONPATH=. python bench/step_phases.py --batch 64 --micro-batches 2

Builds a random SDAR checkpoint (``load_format="dummy"``), lets the batch settle into decode, wraps each phase of
a step in a timer and runs 60 steps: ``launch`` (schedule, collect, graph fill and replay, LM head and sampler
launches) and ``complete`` (the wait for the result, finish, records). A ``wait`` near zero means the host, not the
GPU, bounds the step.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

import torch
from host_path import _timed

import diffulex.sampler.confidence as confidence
from diffulex import Diffulex
from diffulex.bench.throughput import _admit_until_decoding, _greedy, random_prompts, write_sdar_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--data-dir", default="tests/data/sdar-4b-chat")
    args = ap.parse_args()
    acc: dict[str, float] = collections.defaultdict(float)

    def timed(obj, name: str, key: str) -> None:
        setattr(obj, name, _timed(acc, key, getattr(obj, name)))

    with tempfile.TemporaryDirectory() as tmp:
        path = write_sdar_checkpoint(Path(tmp) / args.model, args.model, args.data_dir)
        engine = Diffulex(
            str(path),
            block_size=4,
            buffer_size=1,
            max_num_reqs=args.batch,
            max_model_len=1024,
            load_format="dummy",
            micro_batches=args.micro_batches,
        )
        prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, args.batch, 128, 0)
        ids = {engine.add_request(p, _greedy(800)) for p in prompts}
        _admit_until_decoding(engine, [r for r in engine.scheduler.waiting if r.req_id in ids], 4 * args.batch + 16)
        for _ in range(10):
            engine.step()
        timed(engine, "_launch", "launch")
        timed(engine, "_complete", "complete")
        timed(confidence.PendingWrites, "result", "wait (+ writes)")
        timed(engine.scheduler, "schedule", "schedule")
        timed(engine.scheduler, "finish_step", "finish")
        timed(engine.runner, "collect", "collect")
        timed(engine.runner.sampler, "launch", "sampler launch")
        timed(engine.runner.model, "compute_logits", "LM head launch")
        if engine.runner.graphs is not None:
            timed(engine.runner.graphs, "run", "graph fill + replay")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0) / args.steps
        print(
            f"STEP_PHASES {args.model} batch={args.batch} micro_batches={args.micro_batches}: {ms:.3f} ms per "
            f"engine step"
        )
        for key, seconds in acc.items():
            print(f"  {key:22s} {1e3 * seconds / args.steps:.3f} ms")
        engine.exit()


if __name__ == "__main__":
    main()
