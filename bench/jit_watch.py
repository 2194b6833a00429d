"""Which Triton kernels compile while decode steps run: a compile is a 0.1-0.3 s stall of one step.

    PYTHONPATH=. python bench/jit_watch.py --model 1.7b --batch 64
    PYTHONPATH=. python bench/jit_watch.py --model 1.7b --mix

The first form runs the throughput measurement of one (model, batch) on a random-weight SDAR geometry (`diffulex
bench throughput` with one configuration) and prints every Triton JIT compile that happens after the engine is
built, with the kernel, its specialization key, and the wall time since the measurement started. A compile
inside the timed region means a kernel variant the warm-up did not meet (a new constexpr, or a pointer whose
16-byte alignment changed), which a server would pay as a latency spike.

``--mix`` serves what the throughput run does not: after the engine is ready, batches of 1 to 24 requests of odd
and even prompt lengths, greedy and drawing (``temperature > 0``, which samples eagerly after the forward graph),
so that eager sampler launches of every row-count parity and both sides of the PDL row limit run; then prompts
long enough that their prefill splits its keys, twice (the second time from cached prefixes). It prints each
compile after the engine was ready and ends with ``COMPILES_AFTER_READY n``; n should be 0.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import triton


def serve_mix(
    model: str, data_dir: str, checkpoint: str | None, watch: list[tuple[float, str, str]], t0: float
) -> None:
    """Build an engine on a random-weight SDAR geometry (or on `checkpoint`), then serve the mixed batches; `watch`
    is cleared once the engine is ready, so what it holds afterwards compiled while serving."""
    from diffulex import Diffulex
    from diffulex.bench.throughput import write_sdar_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        if checkpoint:
            path, load_format = checkpoint, "safetensors"
        else:
            path, load_format = write_sdar_checkpoint(tmp, model, data_dir), "dummy"
        fields = dict(block_size=4, buffer_size=1, max_num_reqs=24, max_model_len=256, seed=0)
        with Diffulex(str(path), load_format=load_format, **fields) as llm:
            print(f"{time.perf_counter() - t0:8.2f} s  engine ready")
            watch.clear()
            serve_batches(llm, t0)


def serve_batches(llm, t0: float) -> None:
    """Each batch size twice: every other request drawing, then all greedy; prompt lengths of both parities."""
    from diffulex import SamplingParams
    from diffulex.bench.throughput import random_prompts

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for batch in (1, 2, 3, 5, 8, 17, 24):
        prompts = random_prompts(llm.vocab_limit, llm.mask_token_id, batch, 64, seed=batch)
        prompts = [p[: 9 + 2 * i + batch % 2] for i, p in enumerate(prompts)]
        drawing = [
            greedy if i % 2 == 0 else SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)
            for i in range(batch)
        ]
        for params in (drawing, [greedy] * batch):
            llm.generate(prompts, params, use_tqdm=False)
        print(f"{time.perf_counter() - t0:8.2f} s  served batch {batch} (mixed, then greedy)")
    # prompts long enough that an eager prefill splits its keys, then the same prompts again (a cached prefix)
    for batch in (1, 3):
        prompts = random_prompts(llm.vocab_limit, llm.mask_token_id, batch, 150, seed=100 + batch)
        for _ in range(2):
            llm.generate(prompts, [greedy] * batch, use_tqdm=False)
        print(f"{time.perf_counter() - t0:8.2f} s  served batch {batch} of 150-token prompts, twice")


def explain(name: str, parts: dict[str, str], seen: list[tuple[str, dict[str, str]]]) -> str:
    """How a compile differs from the closest earlier compile of the same kernel: the arguments whose type or
    specialization (16-byte alignment, value 1, a constexpr's value) changed, and any compile option."""
    earlier = [was for n, was in seen if n == name]
    if not earlier:
        return "first compile of this kernel"
    nearest = min(earlier, key=lambda was: len(set(was.items()) ^ set(parts.items())))
    changes = [f"{k}: {nearest.get(k)} -> {v}" for k, v in parts.items() if nearest.get(k) != v]
    return "; ".join(changes) or "same key as an earlier compile"


def key_parts(key: str, arg_names: list[str]) -> dict[str, str]:
    """Triton's cache key, ``str(specialization) + str(options)``, as named parts: one per argument (named from the
    kernel's parameters) and one per compile option."""
    depth, end = 0, len(key)
    for i, ch in enumerate(key):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and i > 0:
            end = i + 1
            break
    args = _top_level_items(key[1 : end - 1])
    parts = {(arg_names[i] if i < len(arg_names) else f"arg{i}"): item for i, item in enumerate(args)}
    options = key[end:].strip()  # the launch's keyword options, a dict's text
    if options.startswith("{") and options.endswith("}"):
        for item in _top_level_items(options[1:-1]):
            k, _, v = item.partition(": ")
            parts[f"option {k.strip(chr(39))}"] = v
    elif options:
        parts["options"] = options
    return parts


def _top_level_items(text: str) -> list[str]:
    """The comma-separated items of `text` that are not inside brackets."""
    items, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        items.append(current.strip())
    return items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--mix", action="store_true", help="serve mixed greedy/drawing batches after the engine is ready")
    ap.add_argument("--data-dir", default="tests/data/sdar-4b-chat")
    ap.add_argument("--checkpoint", help="--mix on this checkpoint folder instead of a random-weight SDAR geometry")
    args = ap.parse_args()
    t0 = time.perf_counter()
    compiles: list[tuple[float, str, str]] = []
    seen: list[tuple[str, dict[str, str]]] = []  # every compile, before the engine was ready too

    def on_cache_miss(*_args, **kwargs) -> bool:
        fn = kwargs.get("fn")
        jit_fn = getattr(fn, "jit_function", fn)
        name = str(getattr(jit_fn, "__name__", repr(fn)))
        parts = key_parts(str(kwargs.get("key", "")), list(getattr(jit_fn, "arg_names", [])))
        compiles.append((time.perf_counter() - t0, name, explain(name, parts, seen)))
        seen.append((name, parts))
        return False  # go on compiling

    triton.knobs.runtime.jit_cache_hook = on_cache_miss
    if args.mix:
        serve_mix(args.model, args.data_dir, args.checkpoint, compiles, t0)
    else:
        from diffulex.bench.throughput import ThroughputSettings, run

        def log(line: str) -> None:
            print(f"{time.perf_counter() - t0:8.2f} s  {line}")

        settings = ThroughputSettings(batch_sizes=[args.batch], buffer_sizes=[1], max_seconds=3.0)
        run(settings, sizes=[args.model], data_dir=args.data_dir, log=log)
    for at, name, key in compiles:
        print(f"{at:8.2f} s  {name}  {key}")
    if args.mix:
        print(f"COMPILES_AFTER_READY {len(compiles)}")


if __name__ == "__main__":
    main()
