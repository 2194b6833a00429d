"""tools/test_time_by_file.py: a pytest run's reported durations, summed by test file."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "test_time_by_file.py"
_spec = importlib.util.spec_from_file_location("test_time_by_file", TOOL)
by_file = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(by_file)

LOG = """\
[gw3] [ 99%] PASSED tests/kernels/test_a.py::test_one
============================== slowest durations ===============================
121.19s call     tests/kernels/test_a.py::test_one[dtype0-128]
10.50s setup    tests/test_b.py::test_two
0.80s call     tests/kernels/test_a.py::test_three
0.60s teardown tests/test_b.py::test_two
================= 3 passed in 130.00s (0:02:10) ==================
"""


def test_every_duration_line_is_read_and_nothing_else():
    found = by_file.durations(LOG.splitlines())
    phases = [(seconds, phase) for seconds, phase, _ in found]
    assert phases == [(121.19, "call"), (10.5, "setup"), (0.8, "call"), (0.6, "teardown")]
    assert by_file.by_file(found) == {"tests/kernels/test_a.py": pytest.approx(121.99), "tests/test_b.py": 11.1}


def test_the_command_says_the_sum_over_the_workers(tmp_path):
    log = tmp_path / "gpu_tests.log"
    log.write_text(LOG)
    out = subprocess.run([sys.executable, str(TOOL), str(log), "--workers", "4"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith("reported durations: 4 lines, 133 s in all (call 122 s, setup 10 s, teardown 1 s)")
    assert out[0].endswith("over 4 workers 33 s")
    assert out[1].split() == ["122.0", "tests/kernels/test_a.py"]
