"""What a test run's Triton compiles cost: the log that tests/conftest.py writes under DIFFULEX_TRITON_COMPILE_LOG.

Usage: python tools/compile_time_report.py LOG [--top N]
Prints the compile seconds by kernel and by test, and how much went to compiling a variant that another process had
already compiled (pytest-xdist workers share one Triton cache but do not wait for each other's compiles).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    lines = [json.loads(text) for text in open(args.log) if text.strip()]
    compiles = [line for line in lines if not line["hit"]]
    by_kernel: Counter[str] = Counter()
    variants: defaultdict[str, set[str]] = defaultdict(set)
    by_test: Counter[str] = Counter()
    seen: set[str] = set()
    repeated_s = 0.0
    for line in compiles:
        seconds = line["us"] / 1e6
        by_kernel[line["kernel"]] += seconds
        variants[line["kernel"]].add(line["hash"])
        by_test[line["test"]] += seconds
        if line["hash"] in seen:
            repeated_s += seconds
        seen.add(line["hash"])
    total = sum(by_kernel.values())
    print(f"{len(compiles)} compiles ({len(seen)} distinct variants), {total:.0f} s; {len(lines) - len(compiles)} hits")
    print(f"compiles of a variant already compiled elsewhere: {repeated_s:.0f} s")
    print("\nby kernel: seconds, variants, compiles")
    for kernel, seconds in by_kernel.most_common(args.top):
        count = sum(1 for line in compiles if line["kernel"] == kernel)
        print(f"  {seconds:8.1f}  {len(variants[kernel]):4d}  {count:4d}  {kernel}")
    print("\nby test: seconds")
    for test, seconds in by_test.most_common(args.top):
        print(f"  {seconds:8.1f}  {test}")


if __name__ == "__main__":
    main()
