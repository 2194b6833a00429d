"""Where an engine's steps go when its requests start at different times, against the same requests started together
(GPU; the serving sweep's model and request mix, no server).

    PYTHONPATH=. python bench/staggered_steps.py [--slots 64 128] [--model sdar-1.7b] [--json FILE]

Why: the serving sweep (`diffulex.bench.sweep_serving`) finds the server's steps at a full batch slower than the
offline engine's at the same batch and tokens per step. This separates the engine from the server: one engine per
slot count (``max_num_reqs``) runs the sweep's requests (as many a slot as the sweep sends,
`diffulex.bench.sweep_serving.REQUESTS_PER_SLOT`) twice, all queued at once (offline: the first batch starts
together and finishes in waves), then staggered (the first ``slots`` requests added one per step, the rest queued
behind them: every finish frees a slot at its own step, as under open-loop arrivals). For the steps while every
slot is taken and a request waits, it prints the mean step time (the wall time of `step()`) and the tokens per step,
by the kind of the step each call applied: continued on the device, or launched by the host, by reason
(`diffulex.engine.continuation.ContinuationRefusal`, counted by the call before, which launched it). A call's wall
time is the wait for the step it applies and the host's work after it, which includes planning the next step where
the host launches that one, so a call that does is counted apart (``..., then the host's``); ``host`` is the call's
time less its wait for the device's result (`EngineLoad.device_wait_s`): the host's work, overlapping the device's
step where one is in flight, else leaving the device idle (planning a step of its own after the result).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

from diffulex import Diffulex
from diffulex.bench.sweep_models import write_model
from diffulex.bench.sweep_serving import REQUESTS_PER_SLOT, refused_continuations, request_mix, serving_shape


def run(engine, specs, slots: int, staggered: bool) -> dict:
    """One pass over `specs`: each step's wall time, kind and tokens while the batch is held."""
    pending = collections.deque((spec.prompt, spec.sampling_params()) for spec in specs)
    if not staggered:
        while pending:
            engine.add_request(*pending.popleft())
    by_kind: dict[str, list[tuple[float, int, float]]] = collections.defaultdict(list)  # (ms, tokens, host ms)
    before = engine.load()
    launched_as = "other"  # why the step the next call applies was launched by the host (counted by this call)
    while pending or not engine.is_finished():
        if pending:
            engine.add_request(*pending.popleft())
            queued = engine.load()
            if queued.running + queued.waiting >= slots:  # the rest queue behind the first batch
                while pending:
                    engine.add_request(*pending.popleft())
        t0 = time.perf_counter()
        updates = engine.step()
        ms = 1e3 * (time.perf_counter() - t0)
        after = engine.load()
        tokens = sum(u.record.num_new_tokens for u in updates if u.record is not None)
        # the step this call applied: a continuation, or one the host launched in the call before, for the reason
        # counted there (a call refuses to continue the step in flight, applies it, then launches the next itself)
        kind = "continued" if after.continued_steps > before.continued_steps else launched_as
        refused = next(iter(refused_continuations(before, after)), None)
        launched_as = refused or "other"
        host_ms = ms - 1e3 * (after.device_wait_s - before.device_wait_s)  # the call's time not waiting for results
        if after.running >= slots and after.waiting > 0:
            by_kind[kind if refused is None else f"{kind}, then the host's"].append((ms, tokens, host_ms))
        before = after
    steps = [s for rows in by_kind.values() for s in rows]
    return {
        "staggered": staggered, "steps_holding_the_batch": len(steps),
        "ms_per_step": statistics.fmean(ms for ms, _, _ in steps) if steps else None,
        "tokens_per_step": statistics.fmean(t for _, t, _ in steps) if steps else None,
        "host_ms_per_step": statistics.fmean(h for _, _, h in steps) if steps else None,
        "by_kind": {kind: {"steps": len(rows), "ms_mean": statistics.fmean(ms for ms, _, _ in rows),
                           "ms_p50": statistics.median(ms for ms, _, _ in rows),
                           "host_ms_mean": statistics.fmean(h for _, _, h in rows)}
                    for kind, rows in sorted(by_kind.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--model", default="sdar-1.7b")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shape = serving_shape(quick=args.model.startswith("tiny"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(args.model, Path(tmp) / args.model)
        load_format = "safetensors" if any(folder.glob("*.safetensors")) else "dummy"
        for slots in args.slots:
            engine = Diffulex(str(folder), max_num_reqs=slots, max_model_len=shape.max_model_len,
                              load_format=load_format, seed=0)
            try:
                run(engine, request_mix(shape, slots, seed=10_000 + slots), slots, staggered=False)  # warm-up
                for staggered in (False, True):
                    specs = request_mix(shape, REQUESTS_PER_SLOT * slots, seed=slots)
                    row = {"slots": slots, **run(engine, specs, slots, staggered)}
                    results.append(row)
                    kinds = ", ".join(f"{k} {v['steps']} x {v['ms_mean']:.2f} ms (host {v['host_ms_mean']:.2f})"
                                      for k, v in row["by_kind"].items())
                    print(f"{slots} slots, {'staggered' if staggered else 'together'}: holding the batch "
                          f"{row['steps_holding_the_batch']} steps, {row['ms_per_step']:.2f} ms (host "
                          f"{row['host_ms_per_step']:.2f}) and {row['tokens_per_step']:.1f} tokens each; {kinds}",
                          flush=True)
            finally:
                engine.exit()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
