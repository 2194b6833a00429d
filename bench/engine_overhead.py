"""Engine overhead per step on the CPU: everything a step costs besides the model's forward.

Runs a tiny random SDAR checkpoint at several batch sizes and splits each step's wall time into the model
forward (transformer + LM head), the sampler, and the rest (scheduling, block state, metadata, bookkeeping).

    python bench/engine_overhead.py --batch-sizes 1 8 64 --json runs/engine_overhead.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.testing.checkpoints import write_tiny_checkpoint


class Stopwatch:
    """Accumulates the time spent inside a wrapped callable."""

    def __init__(self, fn):
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def measure(model_dir: Path, batch: int, prompt_len: int, max_tokens: int, buffer_size: int) -> dict:
    llm = Diffulex(
        str(model_dir), block_size=4, page_size=32, buffer_size=buffer_size, max_num_reqs=max(batch, 1),
        max_model_len=prompt_len + max_tokens + 8, max_num_batched_tokens=8192, accept_threshold=0.9,
    )
    runner = llm.runner
    forward = Stopwatch(runner.forward)
    logits = Stopwatch(runner.model.compute_logits)
    sampler = Stopwatch(runner.sampler)
    runner.forward, runner.model.compute_logits, runner.sampler = forward, logits, sampler
    gen = torch.Generator().manual_seed(batch)
    vocab = llm.vocab_limit
    mask = llm.mask_token_id
    prompts = [
        [t if t != mask else 0 for t in torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()]
        for _ in range(batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t0
    steps = out.num_engine_steps
    llm.exit()
    model_s = forward.seconds + logits.seconds
    overhead = total - model_s - sampler.seconds
    return {
        "batch": batch,
        "steps": steps,
        "tokens": out.num_generated_tokens,
        "ms_per_step": 1e3 * total / steps,
        "forward_ms_per_step": 1e3 * model_s / steps,
        "sampler_ms_per_step": 1e3 * sampler.seconds / steps,
        "overhead_ms_per_step": 1e3 * overhead / steps,
        "overhead_us_per_request_step": 1e6 * overhead / steps / batch,
        "tpf": out.tpf,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prompt-len", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--buffer-size", type=int, default=1)
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", family="sdar", seed=0)
        rows = [measure(model_dir, b, args.prompt_len, args.max_tokens, args.buffer_size) for b in args.batch_sizes]
    header = f"{'batch':>5} {'steps':>6} {'ms/step':>8} {'forward':>8} {'sampler':>8} {'overhead':>9} {'us/req':>7}"
    print(header)
    for r in rows:
        print(
            f"{r['batch']:>5} {r['steps']:>6} {r['ms_per_step']:>8.2f} {r['forward_ms_per_step']:>8.2f} "
            f"{r['sampler_ms_per_step']:>8.2f} {r['overhead_ms_per_step']:>9.2f} "
            f"{r['overhead_us_per_request_step']:>7.0f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.platform(), "cpu_threads": torch.get_num_threads(), "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
