"""The sampler alone: milliseconds per call of `ConfidenceSampler` against the per-request sampler it replaced.

Each request brings one block of ``--rows`` masked positions (the first block of a request, so it may force), and
the logits are random ``[requests * rows, vocab]`` in ``--dtype``. On CUDA the default vocabulary is SDAR's
(151936) and the new sampler takes its fused Triton top-1 path; on the CPU the vocabulary is small and both run
in torch. ``old`` is the sampler as it was before the batched version (softmax probabilities, then a Python
loop over requests and blocks), kept here only as the baseline; the ``same`` column says whether both wrote
the same tokens (they can differ only where a confidence is within float32 rounding of the threshold or of
another position's, because the new one computes the top probability without the softmax).

    python bench/sampler_bench.py --batch-sizes 1 8 32 64 128 --json runs/sampler_bench.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from diffulex.engine.block import Block, BlockStatus
from diffulex.engine.request import DecodeSettings, Request, SampleTarget
from diffulex.sampler import ConfidenceSampler, SamplerSettings
from diffulex.sampler.acceptance import accept_confident
from diffulex.sampler.token_sampling import sample, step_generator
from diffulex.sampling_params import SamplingParams

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class OldSampler:
    """The sampler before batching: full softmax, two device-to-host copies, then a loop over requests and blocks."""

    def __init__(self, settings: SamplerSettings) -> None:
        self.settings = settings

    def __call__(self, logits: torch.Tensor, work: list) -> dict[int, list[tuple[int, int]]]:
        s = self.settings
        logits = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        if s.vocab_limit < logits.shape[-1]:
            logits[:, s.vocab_limit :] = float("-inf")
        logits[:, s.mask_token_id] = float("-inf")
        conf, tokens = torch.softmax(logits, dim=-1).max(dim=-1)
        row = 0
        for req, targets in work:
            n = sum(len(t.positions) for t in targets)
            sp = req.sampling_params
            if sp.temperature > 0 and n:
                seed = sp.seed if sp.seed is not None else s.base_seed + req.req_id
                g = step_generator(seed, req.nfe, logits.device)
                t, c = sample(logits[row : row + n], sp.temperature, sp.top_k, sp.top_p, g)
                tokens[row : row + n], conf[row : row + n] = t, c
            row += n
        tokens_l, conf_l = tokens.tolist(), conf.tolist()
        writes: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for req, targets in work:
            out = writes.setdefault(req.req_id, [])
            for target in targets:
                n = len(target.positions)
                keep = accept_confident(conf_l[row : row + n], s.accept_threshold, target.force_allowed)
                out.extend((target.positions[i], tokens_l[row + i]) for i in keep)
                row += n
        return writes


def make_work(batch: int, rows: int, sampled_every: int) -> list[tuple[Request, list[SampleTarget]]]:
    settings = DecodeSettings(rows, 1, 0, 1 << 20, frozenset(), 0.9, 0.1, 0.9, 8, 1.0)
    work = []
    for req_id in range(batch):
        sampled = sampled_every > 0 and req_id % sampled_every == 0
        sp = SamplingParams(temperature=0.8 if sampled else 0.0, seed=req_id)
        req = Request(req_id, list(range(1, rows + 1)), sp, settings)
        block = Block(1, rows, rows, BlockStatus.ACTIVE)
        work.append((req, [SampleTarget(block, list(range(rows, 2 * rows)), True)]))
    return work


def time_calls(fn, logits: torch.Tensor, work: list, iters: int, warmup: int) -> tuple[float, dict]:
    for _ in range(warmup):
        writes = fn(logits, work)
    if logits.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        writes = fn(logits, work)
    if logits.is_cuda:
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / iters, writes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--rows", type=int, default=4, help="masked positions per request")
    parser.add_argument("--vocab", type=int, default=None, help="default: 151936 on CUDA, 4096 on the CPU")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--sampled-every", type=int, default=0, help="every k-th request samples at T=0.8 (0: none)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    vocab = args.vocab or (151936 if device.type == "cuda" else 4096)
    settings = SamplerSettings(vocab_limit=vocab - 267, mask_token_id=vocab - 300, accept_threshold=0.9, base_seed=0)
    new, old = ConfidenceSampler(settings), OldSampler(settings)
    gen = torch.Generator().manual_seed(0)
    results = []
    print(f"device={device} vocab={vocab} dtype={args.dtype} rows/request={args.rows}")
    print(f"{'batch':>5} {'rows':>5} {'old ms':>8} {'new ms':>8} {'speedup':>8} {'same':>5}")
    for batch in args.batch_sizes:
        work = make_work(batch, args.rows, args.sampled_every)
        num_rows = batch * args.rows
        scale = torch.rand(num_rows, 1, generator=gen) * 20  # flat to very peaky rows
        logits = (torch.randn(num_rows, vocab, generator=gen) * scale).to(DTYPES[args.dtype]).to(device)
        old_ms, old_writes = time_calls(old, logits, work, args.iters, args.warmup)
        new_ms, new_writes = time_calls(new, logits, work, args.iters, args.warmup)
        same = old_writes == new_writes
        results.append({"batch": batch, "rows": num_rows, "old_ms": old_ms, "new_ms": new_ms, "same_writes": same})
        print(f"{batch:>5} {num_rows:>5} {old_ms:>8.3f} {new_ms:>8.3f} {old_ms / new_ms:>7.1f}x {str(same):>5}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "machine": platform.platform(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "args": vars(args) | {"vocab": vocab},
        }
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
