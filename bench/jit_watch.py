"""Which Triton kernels compile while decode steps are timed: a compile is a 0.1-0.3 s stall of one step.

    PYTHONPATH=. python bench/jit_watch.py --model 1.7b --batch 64

Runs the throughput measurement of one (model, batch) on a random-weight SDAR geometry (`diffulex bench
throughput` with one configuration) and prints every Triton JIT compile that happens after the engine is
built, with the kernel, its specialization key, and the wall time since the measurement started. A compile
inside the timed region means a kernel variant the warm-up did not meet (a new constexpr, or a pointer whose
16-byte alignment changed), which a server would pay as a latency spike.
"""

from __future__ import annotations

import argparse
import time

import triton


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--data-dir", default="tests/data/sdar-4b-chat")
    args = ap.parse_args()
    t0 = time.perf_counter()
    compiles: list[tuple[float, str, str]] = []

    def on_cache_miss(*_args, **kwargs) -> bool:
        fn = kwargs.get("fn")
        name = getattr(getattr(fn, "jit_function", fn), "__name__", repr(fn))
        compiles.append((time.perf_counter() - t0, str(name), str(kwargs.get("key", ""))[:160]))
        return False  # go on compiling

    triton.knobs.runtime.jit_cache_hook = on_cache_miss
    from diffulex.bench.throughput import ThroughputSettings, run

    def log(line: str) -> None:
        print(f"{time.perf_counter() - t0:8.2f} s  {line}")

    settings = ThroughputSettings(batch_sizes=[args.batch], buffer_sizes=[1], max_seconds=3.0)
    run(settings, sizes=[args.model], data_dir=args.data_dir, log=log)
    for at, name, key in compiles:
        print(f"{at:8.2f} s  {name}  {key}")


if __name__ == "__main__":
    main()
