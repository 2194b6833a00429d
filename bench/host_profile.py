"""cProfile of the host side of decode steps (SDAR geometry, random weights): which Python calls cost what.

    PYTHONPATH=. python bench/host_profile.py --model 1.7b --batch 1 --steps 50
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from pathlib import Path

from diffulex import Diffulex
from diffulex.bench.throughput import _admit_until_decoding, _greedy, random_prompts, write_sdar_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--data-dir", default="tests/data/sdar-4b-chat")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_sdar_checkpoint(Path(tmp) / args.model, args.model, args.data_dir)
        engine = Diffulex(str(path), block_size=4, buffer_size=1, max_num_reqs=args.batch, max_model_len=1024,
                          load_format="dummy")
        prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, args.batch, 128, 0)
        ids = [engine.add_request(p, _greedy(800)) for p in prompts]
        _admit_until_decoding(engine, list(engine.scheduler.waiting), 4 * args.batch + 16)
        for _ in range(5):
            engine.step()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            engine.step()
        profiler.disable()
        for rid in ids:
            engine.abort_request(rid)
        engine.exit()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
