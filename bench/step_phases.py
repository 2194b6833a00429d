"""Host time per engine step on the GPU machine, by phase, with or without micro-batches (timing only).

    PYTHONPATH=. python bench/step_phases.py --batch 64 --micro-batches 2

Builds a random SDAR checkpoint (``load_format="dummy"``), lets the batch settle into decode and times 60 steps
with `step_anatomy.host_phases` (without its profiler pass): ``launch`` (schedule, collect, graph fill and
replay, LM head and sampler launches), ``apply`` (the wait for the result, finish) and ``report`` (records and
updates, built after the next launch). A wait near
zero means the host, not the GPU, bounds the step.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from step_anatomy import host_phases

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
    with tempfile.TemporaryDirectory() as tmp:
        path = write_sdar_checkpoint(Path(tmp) / args.model, args.model, args.data_dir)
        engine = Diffulex(
            str(path), block_size=4, buffer_size=1, max_num_reqs=args.batch, max_model_len=1024,
            load_format="dummy", micro_batches=args.micro_batches,
        )
        prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, args.batch, 128, 0)
        ids = {engine.add_request(p, _greedy(800)) for p in prompts}
        _admit_until_decoding(engine, [r for r in engine.scheduler.waiting if r.req_id in ids], 4 * args.batch + 16)
        for _ in range(10):
            engine.step()
        phases = host_phases(engine, args.steps)
        print(f"STEP_PHASES {args.model} batch={args.batch} micro_batches={args.micro_batches}: "
              f"{phases['step total']:.3f} ms per engine step")
        for key, ms in phases.items():
            print(f"  {key:36s} {ms:.3f} ms")
        engine.exit()


if __name__ == "__main__":
    main()
