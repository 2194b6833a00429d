"""What one long context does to the decode steps of many short requests: step time alone and with it among them.

    PYTHONPATH=. python bench/straggler_step.py OUT_DIR [--model 1.7b] [--strategies multi_bd d2f]
        [--decoders 32] [--long 16000] [--steps 24] [--buffer-size 1] [--profile-top N] [--quick]

For each strategy, an engine of the SDAR geometry with random weights (bf16, graphs, block 4, buffer 1 unless
``--buffer-size``) admits ``--decoders`` requests of 128-token prompts and times ``--steps`` decode steps (their
mean); then a request of a ``--long``-token prompt joins, and once it decodes (its first token) the same number of
steps is timed with it among them. Reported: both means, their ratio, the share of the joined steps that replayed
the straggler graphs (whose attention splits a context that stands out,
`diffulex.engine.prefill_graphs.has_straggling_context`; the decode graphs' attention splits keys only where its
grid cannot fill the GPU), and the share of steps launched as continuations (before their predecessor's result).

``--profile-top N`` profiles as many more steps of each phase and lists their N longest kernels (and the kernel
time by kind). Writes ``OUT_DIR/straggler_step.json``. ``--quick`` runs a tiny checkpoint on whatever device there
is (the CPU tests), with contexts scaled down; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from diffulex import Diffulex
from diffulex.bench.throughput import _admit_until_decoding, _greedy, random_prompts, write_sdar_checkpoint

DECODER_PROMPT_LEN = 128


def _timed_steps(engine: Diffulex, steps: int) -> float:
    """Mean seconds a step over ``steps`` steps, the GPU's work included. The device is synchronized around the run
    only: a step may return before its forward ends (its successor is launched first, a continuation), and a
    synchronization after each would serialize what the engine overlaps."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda device: None)
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    return (time.perf_counter() - t0) / steps


def _straggler_replays(engine: Diffulex) -> int:
    straggler = engine.runner.straggler_graphs
    return 0 if straggler is None else straggler.num_replays


def _profile(engine: Diffulex, steps: int, top: int) -> dict[str, object]:
    """GPU activity of ``steps`` more steps (`diffulex.bench.gpu_profile`), its ``top`` kernels printed."""
    from diffulex.bench.gpu_profile import profile_steps

    summary = profile_steps(engine.step, steps, engine.device, top=top, time_unprofiled=False)
    by_kind = ", ".join(f"{kind} {ms:.2f}" for kind, ms in summary["kernel_ms_per_step"].items())
    print(f"    GPU busy {summary['gpu_busy_ms_per_step']:.2f} ms of {summary['wall_ms_per_step']:.2f} a step; "
          f"kernel ms by kind: {by_kind}", flush=True)  # fmt: skip
    for kernel in summary.get("top_kernels", []):
        print(f"    {kernel['ms_per_step']:8.3f} ms  x{kernel['calls_per_step']:<6.1f} [{kernel['category']}] "
              f"{kernel['kernel'][:90]}", flush=True)  # fmt: skip
    return summary


def measure(
    path: Path, strategy: str, decoders: int, long_len: int, steps: int, fields: dict[str, Any], profile_top: int = 0
) -> dict:
    """One strategy's steps alone and joined by the long request (milliseconds, means); with ``profile_top``, the
    GPU activity of as many more steps of each phase and their ``profile_top`` longest kernels."""
    max_model_len = long_len + 8 * steps + 256
    # d2f cannot split a prompt, so a step must hold the whole long prompt; only decode steps are timed
    engine = Diffulex(str(path), decoding_strategy=strategy, max_num_reqs=decoders + 1, max_model_len=max_model_len,
                      max_num_batched_tokens=max_model_len, **fields)  # fmt: skip
    try:
        answer = 4 * (4 * steps + 64)  # no decoder finishes while measured
        prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, decoders, DECODER_PROMPT_LEN, 0)
        ids = set(engine.add_request(p, _greedy(answer)) for p in prompts)
        requests = [r for r in engine.scheduler.waiting if r.req_id in ids]
        _admit_until_decoding(engine, requests, 4 * decoders + 16)
        _timed_steps(engine, 3)  # settle
        continued = engine.num_continuations
        alone = _timed_steps(engine, steps)
        alone_continued = (engine.num_continuations - continued) / steps
        profiles = {}
        if profile_top:
            print(f"  {strategy}, {decoders} decoders alone:", flush=True)
            profiles["alone"] = _profile(engine, steps, profile_top)
        (long_prompt,) = random_prompts(engine.vocab_limit, engine.mask_token_id, 1, long_len, 1)
        long_id = engine.add_request(long_prompt, _greedy(answer))
        (long_req,) = [r for r in engine.scheduler.waiting if r.req_id == long_id]
        _admit_until_decoding(engine, [long_req], 64 + long_len // 16)
        replays, continued = _straggler_replays(engine), engine.num_continuations
        joined = _timed_steps(engine, steps)
        joined_continued = (engine.num_continuations - continued) / steps
        straggler_share = (_straggler_replays(engine) - replays) / steps
        if profile_top:
            print(f"  {strategy}, joined by the {long_len}-token context:", flush=True)
            profiles["joined"] = _profile(engine, steps, profile_top)
    finally:
        engine.exit()
    alone_ms, joined_ms = 1e3 * alone, 1e3 * joined
    return {"strategy": strategy, "decoders": decoders, "long_len": long_len, "steps": steps,
            "alone_ms": alone_ms, "joined_ms": joined_ms, "joined_vs_alone": joined_ms / alone_ms,
            "joined_straggler_graph_share": straggler_share, "alone_continued_share": alone_continued,
            "joined_continued_share": joined_continued, "profiles": profiles}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--strategies", nargs="+", default=["multi_bd", "d2f"])
    ap.add_argument("--decoders", type=int, default=32)
    ap.add_argument("--long", type=int, default=16000)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--buffer-size", type=int, default=1, help="blocks in flight (the engine's default is 4)")
    ap.add_argument("--profile-top", type=int, default=0, help="profile both phases, listing this many kernels")
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
            fields = dict(block_size=4, buffer_size=args.buffer_size, load_format="dummy")
            decoders, long_len, steps = args.decoders, args.long, args.steps
        for strategy in args.strategies:
            row = measure(path, strategy, decoders, long_len, steps, fields, args.profile_top)
            rows.append(row)
            print(f"{strategy:>9}: {decoders} decoders alone {row['alone_ms']:.2f} ms, joined by a {long_len}-token "
                  f"context {row['joined_ms']:.2f} ms ({row['joined_vs_alone']:.2f}x), "
                  f"{row['joined_straggler_graph_share']:.0%} of those steps on the straggler graphs; continuations "
                  f"{row['alone_continued_share']:.0%} / {row['joined_continued_share']:.0%}", flush=True)  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"tool": "bench/straggler_step.py", "device": device, "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": "tiny" if args.quick else args.model, "rows": rows}  # fmt: skip
    (out / "straggler_step.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
