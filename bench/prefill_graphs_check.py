"""GPU check of the prefill graphs (`diffulex.engine.prefill_graphs`): steps that carry a prompt stay on the graph path.

    python bench/prefill_graphs_check.py OUT_DIR [--skip-timing] [--data-dir DIR]

1. Tokens. A tiny random SDAR checkpoint, captured CUDA graphs against the eager engine (``enforce_eager``), in
   float32 (must be equal) and bf16 (equal token for token expected; the agreement is reported): requests arriving
   one by one while others decode, and a long prompt computed in chunks beside eight decoders. For each run, the
   share of steps on the graph path and the prefill-graph replays (both must be above zero on the graph engine).
2. Time (unless ``--skip-timing``). The SDAR-1.7B geometry (random weights, bf16): 32 decoders' step time alone,
   then beside an 8k-token prompt prefilled in chunks (``enable_chunked_prefill``, a 2,048-token budget), with the
   prefill graphs (``max_prefill_graph_tokens=512``) and without them (``0``, every step carrying a chunk eager):
   p50 / p99, the share of graphed steps, the prompt's time to first token.

Writes OUT_DIR/prefill_graphs_check.json and prints one line per result; exits 1 if a check failed (the JSON says
which), 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.testing.arrivals import serve_arrivals
from diffulex.testing.checkpoints import write_tiny_checkpoint

MAX_STEPS = 4000
TINY_FIELDS = dict(block_size=4, page_size=8, buffer_size=2, max_model_len=256, max_num_reqs=12, accept_threshold=0.7,
                   max_num_batched_tokens=1024)  # fmt: skip
ARRIVAL_LENGTHS = [9, 14, 21, 6, 17, 30, 12, 40, 3, 25]
CHUNKED_FIELDS = dict(enable_chunked_prefill=True, max_num_batched_tokens=96, max_prefill_graph_tokens=33,
                      buffer_size=1)  # fmt: skip
CHUNKED_LENGTHS = [6, 3, 9, 5, 7, 2, 10, 4, 150]  # eight decoders, then the long prompt
DECODERS = 32
DECODER_PROMPT = 128
LONG_PROMPT = 8192
CHUNK_BUDGET = 2048
ALONE_STEPS = 32


def prompts_for(llm: Diffulex, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    banned = set(llm.settings.stop_token_ids) | {llm.mask_token_id}
    allowed = [t for t in range(llm.vocab_limit) if t not in banned]
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def step_counts(llm: Diffulex) -> dict[str, int]:
    runner = llm.runner
    return {"launched_steps": runner.launched_steps, "eager_steps": runner.eager_steps,
            "decode_graph_replays": runner.graph_replays, "prefill_graph_replays": runner.prefill_replays}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b, strict=True):
        same += sum(p == q for p, q in zip(x, y, strict=False))
        total += max(len(x), len(y))
    return same / max(total, 1)


def token_checks(ckpt: Path, report: dict[str, Any], failures: list[str]) -> None:
    scenarios = {
        "arrivals": (dict(TINY_FIELDS), ARRIVAL_LENGTHS, 2, SamplingParams(temperature=0.0, max_tokens=32)),
        "chunked_beside_8_decoders": ({**TINY_FIELDS, **CHUNKED_FIELDS}, CHUNKED_LENGTHS, 1,
                                      SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)),
    }  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        for name, (fields, lengths, gap, params) in scenarios.items():
            key = f"{dtype}/{name}"
            tokens = {}
            entry: dict[str, Any] = {}
            for mode, extra in (("eager", dict(enforce_eager=True)), ("graphs", {})):
                t0 = time.perf_counter()
                with Diffulex(str(ckpt), dtype=dtype, **fields, **extra) as llm:
                    if mode == "graphs" and llm.runner.prefill_graphs is None:
                        raise RuntimeError(f"{key}: the graph engine built no prefill graphs (CUDA graphs off?)")
                    prompts = prompts_for(llm, lengths, seed=5)
                    before = step_counts(llm)
                    tokens[mode] = serve_arrivals(llm, prompts, params, gap, MAX_STEPS)
                    after = step_counts(llm)
                counts = {k: after[k] - before[k] for k in after}
                counts["graphed_share"] = 1 - counts["eager_steps"] / max(counts["launched_steps"], 1)
                counts["seconds"] = round(time.perf_counter() - t0, 2)
                entry[mode] = counts
            entry["same_tokens"] = tokens["graphs"] == tokens["eager"]
            entry["token_agreement"] = agreement(tokens["graphs"], tokens["eager"])
            report[key] = entry
            graphs = entry["graphs"]
            print(f"{key}: same tokens {entry['same_tokens']} (agreement {entry['token_agreement']:.4f}); graph "
                  f"engine {graphs['launched_steps']} steps, {graphs['graphed_share']:.0%} graphed, "
                  f"{graphs['prefill_graph_replays']} prefill replays", flush=True)
            if dtype == "float32" and not entry["same_tokens"]:
                failures.append(f"{key}: float32 graphs differ from eager")
            if graphs["prefill_graph_replays"] == 0:
                failures.append(f"{key}: no prefill graph was replayed")
            if graphs["graphed_share"] < 0.9:
                failures.append(f"{key}: only {graphs['graphed_share']:.0%} of the steps were graphed")


def beside_chunked_prompt(ckpt: Path, max_prefill_graph_tokens: int) -> dict[str, Any]:
    """32 decoders alone, then beside a chunked 8k-token prompt until its first token; step times in ms."""
    from diffulex.bench.throughput import _admit_until_decoding, random_prompts

    max_model_len = LONG_PROMPT + 64
    fields = dict(decoding_strategy="multi_bd", block_size=4, buffer_size=1, max_model_len=max_model_len,
                  max_num_reqs=DECODERS + 1, enable_chunked_prefill=True, max_num_batched_tokens=CHUNK_BUDGET,
                  max_prefill_graph_tokens=max_prefill_graph_tokens, load_format="dummy", dtype="bfloat16", seed=0)
    t0 = time.perf_counter()
    with Diffulex(str(ckpt), **fields) as llm:
        build_s = time.perf_counter() - t0
        greedy = SamplingParams(temperature=0.0, max_tokens=max_model_len - DECODER_PROMPT - 8, ignore_eos=True)
        prompts = random_prompts(llm.vocab_limit, llm.mask_token_id, DECODERS, DECODER_PROMPT, 3)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        ids = [llm.add_request(p, greedy) for p in prompts]
        decoders = [next(r for r in llm.scheduler.waiting if r.req_id == i) for i in ids]
        _admit_until_decoding(llm, decoders, step_limit=4 * DECODERS + 16)
        for _ in range(3):
            llm.step()

        def timed() -> tuple[float, list]:
            t = time.perf_counter()
            updates = llm.step()
            return time.perf_counter() - t, updates

        torch.cuda.synchronize()
        alone = [timed()[0] for _ in range(ALONE_STEPS)]
        before = step_counts(llm)
        (long_prompt,) = random_prompts(llm.vocab_limit, llm.mask_token_id, 1, LONG_PROMPT, 11)
        long_id = llm.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        beside = []
        for _ in range(MAX_STEPS):
            seconds, updates = timed()
            beside.append(seconds)
            if any(u.req_id == long_id and (u.finished or (u.record is not None and u.record.num_new_tokens > 0))
                   for u in updates):
                break
        else:
            raise RuntimeError(f"the long prompt had no token after {MAX_STEPS} steps")
        after = step_counts(llm)
    steps = after["launched_steps"] - before["launched_steps"]
    ordered_alone, ordered_beside = sorted(alone), sorted(beside)
    row = {
        "max_prefill_graph_tokens": max_prefill_graph_tokens, "build_s": round(build_s, 1),
        "alone_p50_ms": 1e3 * statistics.median(alone),
        "alone_p99_ms": 1e3 * ordered_alone[min(len(alone) - 1, int(0.99 * len(alone)))],
        "beside_steps": len(beside), "beside_p50_ms": 1e3 * statistics.median(beside),
        "beside_p99_ms": 1e3 * ordered_beside[min(len(beside) - 1, int(0.99 * len(beside)))],
        "prompt_ttft_ms": 1e3 * sum(beside),
        "beside_graphed_share": 1 - (after["eager_steps"] - before["eager_steps"]) / max(steps, 1),
        "beside_prefill_graph_replays": after["prefill_graph_replays"] - before["prefill_graph_replays"],
    }  # fmt: skip
    row["p99_vs_alone"] = row["beside_p99_ms"] / row["alone_p50_ms"]
    print(f"1.7B, max_prefill_graph_tokens={max_prefill_graph_tokens}: {DECODERS} decoders alone p50/p99 "
          f"{row['alone_p50_ms']:.2f}/{row['alone_p99_ms']:.2f} ms; beside a {LONG_PROMPT}-token chunked prompt "
          f"({len(beside)} steps, {row['beside_graphed_share']:.0%} graphed) p50/p99 {row['beside_p50_ms']:.2f}/"
          f"{row['beside_p99_ms']:.2f} ms = {row['p99_vs_alone']:.2f}x alone; prompt TTFT "
          f"{row['prompt_ttft_ms']:.0f} ms", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--skip-timing", action="store_true", help="only the token checks on the tiny model")
    parser.add_argument("--data-dir", default=None, help="SDAR-4B-Chat config and tokenizer (default: tests/data)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("prefill_graphs_check: CUDA is not available; this check needs a GPU", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    failures: list[str] = []
    path = args.out_dir / "prefill_graphs_check.json"

    def save() -> None:
        report["failures"] = failures
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    with tempfile.TemporaryDirectory() as tmp:
        try:
            tiny = write_tiny_checkpoint(Path(tmp) / "tiny", family="sdar", seed=1, init_std=1.0)
            token_checks(tiny, report, failures)
        except Exception as err:  # noqa: BLE001 - recorded, and the check fails
            failures.append(f"token checks: {err!r}"[:1000])
        save()
        if not args.skip_timing and not failures:
            from diffulex.bench.throughput import write_sdar_checkpoint

            try:
                ckpt = write_sdar_checkpoint(Path(tmp) / "sdar-1.7b", "1.7b", args.data_dir)
                rows = [beside_chunked_prompt(ckpt, cap) for cap in (512, 0)]
                report["beside_chunked_prompt_1.7b"] = rows
                if rows[0]["beside_graphed_share"] < 0.9:
                    failures.append(f"1.7B: only {rows[0]['beside_graphed_share']:.0%} of the steps beside the "
                                    "chunked prompt were graphed")
            except Exception as err:  # noqa: BLE001
                failures.append(f"timing: {err!r}"[:1000])
    save()
    print(f"wrote {path}; " + (f"FAILED: {failures}" if failures else "all checks passed"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
