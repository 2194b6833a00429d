"""What one long context does to the decode steps of many short requests: step time alone and with it among them.

    PYTHONPATH=. python bench/straggler_step.py OUT_DIR [--model 1.7b] [--strategies multi_bd d2f]
        [--decoders 32] [--long 16000] [--steps 24] [--quick]

For each strategy, an engine of the SDAR geometry with random weights (bf16, graphs, block 4) admits ``--decoders``
requests of 128-token prompts and times ``--steps`` decode steps (median); then a request of a ``--long``-token
prompt joins, and once it decodes (its first token) the same number of steps is timed with it among them. Reported:
both medians, their ratio, and the share of the joined steps that replayed the chunk graphs (whose attention
splits a context that stands out, `diffulex.engine.prefill_graphs.has_straggling_context`; the decode graphs'
attention splits keys only where its grid cannot fill the GPU). `multi_bd` has had chunk graphs beside its prefill
graphs; `d2f`, whose prompts cannot be split off, has them only for such steps.

Writes ``OUT_DIR/straggler_step.json``. ``--quick`` runs a tiny checkpoint on whatever device there is (the CPU
tests), with contexts scaled down; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from diffulex import Diffulex
from diffulex.bench.throughput import _admit_until_decoding, _greedy, random_prompts, write_sdar_checkpoint

DECODER_PROMPT_LEN = 128


def _timed_steps(engine: Diffulex, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def _chunk_replays(engine: Diffulex) -> int:
    chunk = engine.runner.chunk_graphs
    return 0 if chunk is None else chunk.num_replays


def measure(path: Path, strategy: str, decoders: int, long_len: int, steps: int, fields: dict[str, Any]) -> dict:
    """One strategy's steps alone and joined by the long request (milliseconds, medians)."""
    engine = Diffulex(str(path), decoding_strategy=strategy, max_num_reqs=decoders + 1,
                      max_model_len=long_len + 8 * steps + 256, **fields)  # fmt: skip
    try:
        answer = 4 * (4 * steps + 64)  # no decoder finishes while measured
        prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, decoders, DECODER_PROMPT_LEN, 0)
        ids = set(engine.add_request(p, _greedy(answer)) for p in prompts)
        requests = [r for r in engine.scheduler.waiting if r.req_id in ids]
        _admit_until_decoding(engine, requests, 4 * decoders + 16)
        _timed_steps(engine, 3)  # settle
        alone = _timed_steps(engine, steps)
        (long_prompt,) = random_prompts(engine.vocab_limit, engine.mask_token_id, 1, long_len, 1)
        long_id = engine.add_request(long_prompt, _greedy(4 * steps))
        (long_req,) = [r for r in engine.scheduler.waiting if r.req_id == long_id]
        _admit_until_decoding(engine, [long_req], 64 + long_len // 16)
        replays = _chunk_replays(engine)
        joined = _timed_steps(engine, steps)
        chunk_share = (_chunk_replays(engine) - replays) / steps
    finally:
        engine.exit()
    alone_ms, joined_ms = 1e3 * statistics.median(alone), 1e3 * statistics.median(joined)
    return {"strategy": strategy, "decoders": decoders, "long_len": long_len, "steps": steps,
            "alone_ms": alone_ms, "joined_ms": joined_ms, "joined_vs_alone": joined_ms / alone_ms,
            "joined_chunk_graph_share": chunk_share}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--strategies", nargs="+", default=["multi_bd", "d2f"])
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--long", type=int, default=16000)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            from diffulex.testing.checkpoints import write_tiny_checkpoint

            path = write_tiny_checkpoint(Path(tmp) / "tiny", family="sdar", seed=1)
            fields: dict[str, Any] = dict(block_size=4, page_size=8, dtype="float32")
            decoders, long_len, steps = min(args.decoders, 4), min(args.long, 96), min(args.steps, 3)
        else:
            path = write_sdar_checkpoint(Path(tmp) / args.model, args.model)
            fields = dict(block_size=4, load_format="dummy")
            decoders, long_len, steps = args.decoders, args.long, args.steps
        for strategy in args.strategies:
            row = measure(path, strategy, decoders, long_len, steps, fields)
            rows.append(row)
            print(f"{strategy:>9}: {decoders} decoders alone {row['alone_ms']:.2f} ms, joined by a {long_len}-token "
                  f"context {row['joined_ms']:.2f} ms ({row['joined_vs_alone']:.2f}x), "
                  f"{row['joined_chunk_graph_share']:.0%} of those steps on the chunk graphs", flush=True)  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"tool": "bench/straggler_step.py", "device": device, "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": "tiny" if args.quick else args.model, "rows": rows}  # fmt: skip
    (out / "straggler_step.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
