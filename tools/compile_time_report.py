"""What a test run's Triton compiles cost: the log written under DIFFULEX_TRITON_COMPILE_LOG (`diffulex.kernels.
compile_log`: the test processes and the compile helpers of the engines they build).

Usage: python tools/compile_time_report.py LOG [--top N]
Prints the compile seconds by process kind, by kernel and by test (a helper's compiles count to the test whose
engine started it), and how much went to compiling a variant that another process had already compiled
(pytest-xdist workers share one Triton cache; a compile outside the engine's variant locks does not wait for
another worker's).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class CompileSummary:
    """The compiles of a log (cache hits apart): seconds by kernel and by test, variants and compiles per kernel,
    and the seconds spent compiling a variant again."""

    hits: int = 0
    compiles: int = 0
    seconds_by_kernel: Counter[str] = field(default_factory=Counter)
    seconds_by_test: Counter[str] = field(default_factory=Counter)
    seconds_by_process: Counter[str] = field(default_factory=Counter)
    compiles_by_kernel: Counter[str] = field(default_factory=Counter)
    variants_by_kernel: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    repeated_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.seconds_by_kernel.values())

    @property
    def variants(self) -> int:
        return sum(len(v) for v in self.variants_by_kernel.values())


def summarize(lines: list[dict]) -> CompileSummary:
    """`CompileSummary` of the log's lines (``kernel``, ``hash``, ``us``, ``hit``, ``test``, ``process``: the test
    process or an engine's compile helper, whose ``test`` is the test that built the engine), in log order."""
    summary, seen = CompileSummary(), set()
    for line in lines:
        if line["hit"]:
            summary.hits += 1
            continue
        seconds = line["us"] / 1e6
        summary.compiles += 1
        summary.seconds_by_kernel[line["kernel"]] += seconds
        summary.seconds_by_test[line["test"]] += seconds
        summary.seconds_by_process[line.get("process", "test process")] += seconds
        summary.compiles_by_kernel[line["kernel"]] += 1
        summary.variants_by_kernel[line["kernel"]].add(line["hash"])
        if line["hash"] in seen:
            summary.repeated_seconds += seconds
        seen.add(line["hash"])
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    with open(args.log) as log:
        summary = summarize([json.loads(text) for text in log if text.strip()])
    print(f"{summary.compiles} compiles ({summary.variants} distinct variants), {summary.seconds:.0f} s; "
          f"{summary.hits} hits")  # fmt: skip
    print(f"compiles of a variant already compiled elsewhere: {summary.repeated_seconds:.0f} s")
    print("by process: " + ", ".join(f"{p} {s:.0f} s" for p, s in summary.seconds_by_process.most_common()))
    print("\nby kernel: seconds, variants, compiles")
    for kernel, seconds in summary.seconds_by_kernel.most_common(args.top):
        variants, compiles = len(summary.variants_by_kernel[kernel]), summary.compiles_by_kernel[kernel]
        print(f"  {seconds:8.1f}  {variants:4d}  {compiles:4d}  {kernel}")
    print("\nby test: seconds")
    for test, seconds in summary.seconds_by_test.most_common(args.top):
        print(f"  {seconds:8.1f}  {test}")


if __name__ == "__main__":
    main()
