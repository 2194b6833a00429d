"""DiffusionGemma's canvas rule alone (what a step does after the LM head): ms per step of the batched rule
(`denoise_canvases` and the step's one read on the host, `copy_outcome`) against the rule run canvas by canvas with
the host reads it makes (`diffulex.testing.diffusion_gemma_canvas_reference.denoise_canvas`, then each canvas's
argmax read, as the runner did before), on random logits of the DiffusionGemma-26B-A4B shapes (canvas 256,
vocabulary 262,144, hidden 2,816, bf16 embedding) or of the tiny CPU geometry; and whether both give every canvas
the same outcome at those shapes: the same tokens, argmax and end, with the mean entropy and self-conditioning input
bit for bit on the CPU and within float32 rounding on a GPU (`same`).

    PYTHONPATH=. python bench/canvas_rule.py OUT_DIR [--geometry 26b-a4b|tiny] [--batch-sizes 1 8] [--iters 10]
        [--profile-top 15]

Canvases of a batch cycle through temperatures 1.0, 0.0, 0.7 and 1.3 (greedy among sampled), each at step 2 of the
checkpoint's schedule with a full stability history. ``queued_ms`` is the host's time to queue the batched step
(before it waits once); the reference waits for the device several times per canvas. Then both ways are profiled
at the largest batch: the operators that took the most device time (CPU time on a CPU), per step. Writes
OUT_DIR/canvas_rule.json; exits 1 when an outcome differs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from diffulex.bench.sweep_common import sync
from diffulex.strategy.diffusion_gemma import DiffusionGemmaOptions
from diffulex.strategy.diffusion_gemma.canvas import (
    CanvasState,
    CanvasSteps,
    denoise_canvases,
    initial_canvas,
    self_conditioning_probs,
)
from diffulex.strategy.diffusion_gemma.pending import copy_outcome
from diffulex.testing.diffusion_gemma_canvas_reference import denoise_canvas

# (canvas, vocabulary, hidden): the published checkpoint's and the CPU tests'
GEOMETRIES = {"26b-a4b": (256, 262144, 2816), "tiny": (16, 384, 64)}
TEMPERATURES = (1.0, 0.0, 0.7, 1.3)
SOFTCAP = 30.0  # the checkpoint's final_logit_softcapping
START_STEP = 2  # past the stability threshold: the stability check compares


class Embeddings:
    """The model's self-conditioning inputs over a random bf16 embedding matrix (`soft_embeddings`,
    `token_soft_embeddings` of `DiffusionGemmaForDiffusionLM`, as the runner calls them)."""

    def __init__(self, vocab: int, hidden: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.weight = (torch.randn(vocab, hidden, generator=g, device=device) * 0.02).to(torch.bfloat16)
        self.scale = torch.tensor(hidden**0.5, dtype=torch.bfloat16).item()

    def soft(self, scaled: torch.Tensor) -> torch.Tensor:
        return self.soft_of_probs(self_conditioning_probs(scaled, self.weight.dtype))

    def soft_of_probs(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.matmul(probs, self.weight) * self.scale

    def one_hot(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens] * self.scale


def make_inputs(batch: int, geometry: str, device: torch.device) -> tuple[torch.Tensor, list[CanvasState]]:
    canvas, vocab, _ = GEOMETRIES[geometry]
    g = torch.Generator(device=device).manual_seed(batch)
    logits = torch.tanh(torch.randn(batch, canvas, vocab, generator=g, device=device) * 4 / SOFTCAP) * SOFTCAP
    states = []
    for b in range(batch):
        tokens = initial_canvas(b, 0, canvas, vocab, device)
        history = tuple(torch.randint(0, vocab, (canvas,), generator=g, device=device) for _ in range(2))
        states.append(CanvasState(0, tokens, None, history, START_STEP))
    return logits, states


def run_batched(logits, states, temperatures, seeds, options, vocab, embeddings) -> tuple[CanvasSteps, list, list]:
    group = denoise_canvases(logits, states, temperatures, seeds, options.schedule, vocab, embeddings.soft_of_probs,
                             embeddings.one_hot, embeddings.weight.dtype)  # fmt: skip
    outcome, entropies, ready = copy_outcome([group])
    return group, outcome, entropies, ready


def read(outcome: torch.Tensor, entropies: torch.Tensor, ready) -> tuple[list, list]:
    if ready is not None:
        ready.synchronize()
    return outcome.tolist(), entropies.tolist()


def run_reference(logits, states, temperatures, seeds, options, vocab, embeddings) -> list:
    steps = []
    for b, state in enumerate(states):
        step = denoise_canvas(logits[b], state, options.schedule, temperatures[b], vocab, seeds[b], embeddings.soft,
                              embeddings.one_hot)  # fmt: skip
        step.argmax.tolist()
        steps.append(step)
    return steps


# On a GPU the batched rule's sampled canvases take two fused passes over their logits (`sample_canvases`), whose
# float32 sums round otherwise than PyTorch's: their mean entropy within this relative distance of the reference's,
# their self-conditioning inputs within bf16 rounding. On the CPU both are the same code, bit for bit.
ENTROPY_RTOL = 1e-5
SOFT_RTOL, SOFT_ATOL = 2e-2, 1e-3


def same(ours, theirs) -> bool:
    """The same tokens, argmax and end; the mean entropy and self-conditioning input equal on the CPU, within
    float32 rounding (`ENTROPY_RTOL`, `SOFT_RTOL`) on a GPU."""
    if not (torch.equal(ours.argmax, theirs.argmax) and torch.equal(ours.state.tokens, theirs.state.tokens)):
        return False
    exact = ours.argmax.device.type == "cpu"
    entropy_ok = math.isclose(ours.mean_entropy, theirs.mean_entropy, rel_tol=0 if exact else ENTROPY_RTOL)
    if ours.finished != theirs.finished or not entropy_ok:
        return False
    if (ours.state.soft_embeds is None) != (theirs.state.soft_embeds is None):
        return False
    if theirs.state.soft_embeds is None:
        return True
    if exact:
        return torch.equal(ours.state.soft_embeds, theirs.state.soft_embeds)
    return torch.allclose(ours.state.soft_embeds.float(), theirs.state.soft_embeds.float(), SOFT_RTOL, SOFT_ATOL)


def measure(batch: int, geometry: str, iters: int, device: torch.device) -> dict:
    canvas, vocab, hidden = GEOMETRIES[geometry]
    options = DiffusionGemmaOptions()
    embeddings = Embeddings(vocab, hidden, device)
    logits, states = make_inputs(batch, geometry, device)
    temperatures = [TEMPERATURES[b % len(TEMPERATURES)] for b in range(batch)]
    seeds = [100 + b for b in range(batch)]
    args = (states, temperatures, seeds, options, vocab, embeddings)

    reference = run_reference(logits, *args)
    group, outcome, entropies, ready = run_batched(logits.clone(), *args)
    rows, means = read(outcome, entropies, ready)
    differing = [b for b in range(batch) if not same(group.resolve(b, bool(rows[b][-2]), means[b]), reference[b])]

    batched_ms, queued_ms, reference_ms = [], [], []
    for _ in range(iters):
        work = logits.clone()
        sync(device)
        t0 = time.perf_counter()
        pending = run_batched(work, *args)
        t1 = time.perf_counter()
        read(*pending[1:])
        t2 = time.perf_counter()
        del pending, work
        sync(device)
        t3 = time.perf_counter()
        run_reference(logits, *args)
        sync(device)
        t4 = time.perf_counter()
        queued_ms.append((t1 - t0) * 1e3)
        batched_ms.append((t2 - t0) * 1e3)
        reference_ms.append((t4 - t3) * 1e3)
    row = {
        "batch": batch, "canvas": canvas, "vocab": vocab, "temperatures": temperatures,
        "batched_ms": statistics.median(batched_ms), "queued_ms": statistics.median(queued_ms),
        "reference_ms": statistics.median(reference_ms), "equal": not differing, "differing_canvases": differing,
    }  # fmt: skip
    row["speedup"] = row["reference_ms"] / row["batched_ms"] if row["batched_ms"] > 0 else math.nan
    return row


def profile_step(batch: int, geometry: str, device: torch.device, top: int) -> dict[str, list[dict]]:
    """Per step, the ``top`` operators by self time on the device (the CPU on a CPU), batched and per canvas."""
    from torch.profiler import ProfilerActivity, profile

    _, vocab, hidden = GEOMETRIES[geometry]
    options = DiffusionGemmaOptions()
    embeddings = Embeddings(vocab, hidden, device)
    logits, states = make_inputs(batch, geometry, device)
    temperatures = [TEMPERATURES[b % len(TEMPERATURES)] for b in range(batch)]
    args = (states, temperatures, [100 + b for b in range(batch)], options, vocab, embeddings)
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    ways = {"batched": lambda: read(*run_batched(logits.clone(), *args)[1:]),
            "per_canvas": lambda: run_reference(logits, *args)}  # fmt: skip
    report, steps = {}, 3
    for name, step in ways.items():
        step()
        sync(device)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            sync(device)
        events = prof.key_averages()
        key = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
        report[name] = [
            {"op": e.key, "calls": e.count // steps, "ms": key(e) / 1e3 / steps}
            for e in sorted(events, key=key, reverse=True)[:top] if key(e) > 0
        ]  # fmt: skip
        print(f"profile, {name}, batch {batch}, ms per step by operator ({'device' if on_gpu else 'CPU'}):")
        for entry in report[name]:
            print(f"  {entry['ms']:8.3f}  x{entry['calls']:<4} {entry['op']}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="26b-a4b")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile-top", type=int, default=15, help="operators listed per profile (0: none)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.geometry != "tiny" and device.type != "cuda":
        print(f"--geometry {args.geometry} needs a GPU (its logits are 268 MB per canvas); use --geometry tiny",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = []
    with torch.inference_mode():
        for batch in args.batch_sizes:
            row = measure(batch, args.geometry, args.iters, device)
            rows.append(row)
            print(f"batch {batch}: batched {row['batched_ms']:.2f} ms (queued in {row['queued_ms']:.2f}), "
                  f"per canvas {row['reference_ms']:.2f} ms, {row['speedup']:.2f}x; "
                  f"equal: {row['equal']} {row['differing_canvases'] or ''}")  # fmt: skip
        profiles = {}
        if args.profile_top:
            profiles = profile_step(max(args.batch_sizes), args.geometry, device, args.profile_top)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": device_name, "torch": torch.__version__, "geometry": args.geometry, "results": rows,
              "profile_batch": max(args.batch_sizes), "profiles": profiles}  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "canvas_rule.json").write_text(json.dumps(report, indent=1))
    print(f"report: {args.out_dir / 'canvas_rule.json'}")
    return 0 if all(row["equal"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
