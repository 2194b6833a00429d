"""Where a pytest run's time went, by test file: the durations pytest printed (``--durations=0``), summed.

Usage: python tools/test_time_by_file.py LOG [--workers N] [--top N]

Why: the GPU suite (tools/gpu_tests.sh) runs on 16 pytest-xdist workers and is throughput-bound, so its wall time
is about the workers' summed time over their count; the longest test says little. This sums every setup, call
and teardown pytest reported (those under ``--durations-min`` are not in the log), by file and by phase, and says
what the sum is over the workers.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+)")


def durations(lines: list[str]) -> list[tuple[float, str, str]]:
    """(seconds, phase, test id) of each duration line of a pytest log."""
    found = []
    for line in lines:
        match = DURATION.match(line)
        if match:
            found.append((float(match.group(1)), match.group(2), match.group(3)))
    return found


def by_file(found: list[tuple[float, str, str]]) -> Counter[str]:
    """Seconds summed by the test's file."""
    totals: Counter[str] = Counter()
    for seconds, _, test in found:
        totals[test.split("::")[0]] += seconds
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    with open(args.log, errors="replace") as f:
        found = durations(f.read().splitlines())
    total = sum(s for s, _, _ in found)
    phases = Counter()
    for seconds, phase, _ in found:
        phases[phase] += seconds
    print(f"reported durations: {len(found)} lines, {total:.0f} s in all "
          f"({', '.join(f'{p} {s:.0f} s' for p, s in phases.most_common())}); "
          f"over {args.workers} workers {total / max(args.workers, 1):.0f} s")
    for path, seconds in by_file(found).most_common(args.top):
        print(f"  {seconds:8.1f}  {path}")


if __name__ == "__main__":
    main()
