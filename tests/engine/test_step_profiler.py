"""``profiler_config``: a torch.profiler trace of the asked engine steps."""

from __future__ import annotations

import json
from pathlib import Path

from diffulex import Diffulex, SamplingParams


def test_the_torch_profiler_records_the_asked_steps(sdar_dir: Path, tmp_path: Path) -> None:
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces"), "delay_iterations": 1,
                "max_iterations": 2, "run_id": "run"}  # fmt: skip
    with Diffulex(str(sdar_dir), block_size=4, max_model_len=64, profiler_config=profiler) as llm:
        llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        trace = tmp_path / "traces" / "run.json"
        assert trace.is_file()  # written once the two steps were recorded, before the engine exits
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)
    assert (tmp_path / "traces" / "run.txt").read_text().strip()
