"""The steps an engine launches itself instead of continuing them on the device, by reason, under the serving sweep's
mix of prompt and answer lengths with requests arriving into freed slots (CPU; no GPU needed).

    PYTHONPATH=. python bench/continuation_refusals.py [--slots 16 64] [--buffer-size 4] [--arrival-delay 1]
        [--requests-per-slot 2] [--json FILE]

Why: a continuation (`diffulex.engine.continuation`) must suit every request of the batch, and online each request
arrives at its own time, so at many steps some request is at a point the device cannot handle; each such step is
planned by the host after the result, its host work no longer overlapping the GPU's. This replays that on a tiny
random SDAR checkpoint with the real Qwen tokenizer, whose decode steps run the graphs' static buffers eagerly (the
GPU's step path, continuations included, with pages lent as a GPU engine lends them): ``--slots`` request slots
(``max_num_reqs``) and the serving sweep's own requests for that many streams (`diffulex.bench.sweep_serving.
request_mix`: prompts of 32 to 256 words, whose token counts end anywhere in a block, some on its boundary, and
shared prefixes the prefix cache finds; answers of 32 to 256 tokens, ``ignore_eos``), ``--requests-per-slot`` of
them, the first ``--slots`` arriving one per step, each later one ``--arrival-delay`` steps after a request finishes.
Prints per slot count the steps applied, how many were continued, and the others by reason
(`diffulex.engine.continuation.ContinuationRefusal`, as `/metrics` exports them). The tokens are not compared here:
the engine's tests hold continued steps to the tokens of one step in flight.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import torch

from diffulex import Diffulex
from diffulex.bench.sweep_serving import request_mix, serving_shape
from diffulex.testing.checkpoints import write_tiny_checkpoint


def replay(model_dir: Path, slots: int, buffer_size: int, arrival_delay: int, requests_per_slot: int) -> dict:
    """One run: the engine's steps, continued steps and refusals by reason."""
    shape = serving_shape(quick=False)
    llm = Diffulex(str(model_dir), block_size=4, page_size=32, buffer_size=buffer_size, max_num_reqs=slots,
                   max_model_len=shape.max_model_len, max_num_batched_tokens=4096,
                   accept_threshold=0.99)  # fmt: skip
    try:
        llm.enable_static_decode(capture=False)
        llm.scheduler.limits.reserve_running_pages = True  # as an engine on a GPU lends them
        requests = collections.deque(
            (spec.prompt, spec.sampling_params()) for spec in request_mix(shape, requests_per_slot * slots, seed=slots)
        )
        arrivals = list(range(slots))  # the steps at which the next requests arrive
        step = live = 0
        while requests or live:
            while arrivals and arrivals[0] <= step and requests:
                arrivals.pop(0)
                llm.add_request(*requests.popleft())
                live += 1
            for update in llm.step() if live else []:
                if update.finished:
                    live -= 1
                    arrivals.append(step + arrival_delay)
            step += 1
        load = llm.load()
    finally:
        llm.exit()
    return {"slots": slots, "buffer_size": buffer_size, "arrival_delay": arrival_delay,
            "requests": requests_per_slot * slots, "steps": load.steps,
            "continued_steps": load.continued_steps, "refused": dict(sorted(load.refused_continuations.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--buffer-size", type=int, default=4, help="the engine field (4: the serving sweep's default)")
    parser.add_argument("--arrival-delay", type=int, default=1, help="steps from a finish to the next arrival")
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", family="sdar", seed=2, real_tokenizer=True)
        rows = [replay(model_dir, n, args.buffer_size, args.arrival_delay, args.requests_per_slot) for n in args.slots]
    for row in rows:
        refused = ", ".join(f"{reason} {n}" for reason, n in row["refused"].items()) or "none"
        print(f"{row['slots']:>4} slots: {row['continued_steps']} of {row['steps']} steps continued; the host's: "
              f"{refused}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
