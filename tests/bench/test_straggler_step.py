"""``bench/straggler_step.py --quick``: the tool that times short requests' decode steps alone and joined by a long
context runs each strategy through both phases and reports them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_each_strategy_is_timed_alone_and_joined_by_the_long_context(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "bench/straggler_step.py", str(tmp_path), "--quick"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "straggler_step.json").read_text())
    assert [r["strategy"] for r in report["rows"]] == ["multi_bd", "d2f"]
    for row in report["rows"]:
        assert row["alone_ms"] > 0 and row["joined_ms"] > 0
        assert row["joined_vs_alone"] == row["joined_ms"] / row["alone_ms"]
        assert row["joined_straggler_graph_share"] == 0, "no graphs on the CPU"
