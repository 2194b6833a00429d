"""tools/compile_time_report.py: what a GPU test run's Triton compiles cost, from the log tests/conftest.py writes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "compile_time_report.py"
_spec = importlib.util.spec_from_file_location("compile_time_report", TOOL)
report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = report  # its dataclass looks its module up there
_spec.loader.exec_module(report)

LOG = [
    {"kernel": "attn", "hash": "a1", "us": 3_000_000, "hit": False, "test": "t::one"},
    {"kernel": "attn", "hash": "a1", "us": 2_000_000, "hit": False, "test": "t::two"},  # another worker, again
    {"kernel": "attn", "hash": "a2", "us": 1_000_000, "hit": False, "test": "t::two"},
    {"kernel": "norm", "hash": "n1", "us": 500_000, "hit": False, "test": "t::one", "process": "compile helper"},
    {"kernel": "norm", "hash": "n1", "us": 10, "hit": True, "test": "t::three"},
]


def test_compiles_are_summed_by_kernel_and_test_and_repeats_counted_apart():
    summary = report.summarize(LOG)
    assert (summary.compiles, summary.hits, summary.variants) == (4, 1, 3)
    assert summary.seconds == 6.5
    assert summary.seconds_by_kernel == {"attn": 6.0, "norm": 0.5}
    assert summary.seconds_by_test == {"t::one": 3.5, "t::two": 3.0}
    assert summary.repeated_seconds == 2.0  # the second compile of a1
    assert summary.seconds_by_process == {"test process": 6.0, "compile helper": 0.5}  # unnamed: a test process


def test_the_command_prints_the_totals(tmp_path):
    log = tmp_path / "compiles.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in LOG))
    out = subprocess.run([sys.executable, str(TOOL), str(log)], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "4 compiles (3 distinct variants), 6 s; 1 hits"
    assert "already compiled elsewhere: 2 s" in out
    assert "by process: test process 6 s, compile helper 0 s" in out
