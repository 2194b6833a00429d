"""``profiler_config``: a torch.profiler trace of the asked engine steps."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.config import ProfilerConfig
from diffulex.engine import step_profiler

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


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


# --- the profiler ends with the process: a script that never calls exit() -----------------------------------


def test_a_script_that_never_calls_exit_ends_cleanly_and_keeps_its_trace(tmp_path: Path) -> None:
    """The running torch profiler used to outlive the engine into interpreter teardown: a segfault (exit code
    139) and no trace. The profiler is now stopped, and its trace written, when the interpreter exits."""
    script = textwrap.dedent(
        f"""
        from diffulex import BUILTIN_MODEL, Diffulex, SamplingParams
        profiler = {{"profiler": "torch", "torch_profiler_dir": {str(tmp_path / "traces")!r}, "run_id": "run"}}
        llm = Diffulex(BUILTIN_MODEL, profiler_config=profiler)
        out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        print("GENERATED", len(out.trajectories[0].token_ids))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "GENERATED 8" in result.stdout
    assert (tmp_path / "traces" / "run.json").is_file()
    assert (tmp_path / "traces" / "run.txt").read_text().strip()


# --- torch_profiler_dir and run_id are checked when the engine is built ---------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"torch_profiler_dir": 5}, r"profiler_config.torch_profiler_dir=5 is invalid: must be a path"),
        ({"torch_profiler_dir": b"/tmp/traces"}, r"profiler_config.torch_profiler_dir=b'/tmp/traces' is invalid"),
        ({"torch_profiler_dir": ""}, r"profiler_config.torch_profiler_dir='' is invalid: must be a non-empty path"),
        ({"torch_profiler_dir": "/tmp/a\0b"}, r"torch_profiler_dir='/tmp/a\\x00b' is invalid: .*NUL"),
        ({"run_id": "a/b/c"}, r"profiler_config.run_id='a/b/c' is invalid: must be a plain file name"),
        ({"run_id": "../escaped"}, r"profiler_config.run_id='../escaped' is invalid: must be a plain file name"),
        ({"run_id": "a\\b"}, r"profiler_config.run_id='a\\\\b' is invalid: must be a plain file name"),
        ({"run_id": ".."}, r"profiler_config.run_id='..' is invalid: must be a plain file name"),
        ({"run_id": "."}, r"profiler_config.run_id='.' is invalid: must be a plain file name"),
        ({"run_id": "a\0b"}, r"profiler_config.run_id='a\\x00b' is invalid: .*NUL"),
        ({"run_id": "x" * 300}, r"profiler_config.run_id='xxx.* is invalid: .*at most 250 bytes"),
        ({"run_id": ""}, r"profiler_config.run_id='' is invalid: must be a non-empty string"),
        ({"run_id": 5}, r"profiler_config.run_id=5 is invalid: must be a non-empty string"),
    ],
)
def test_bad_profiler_paths_are_rejected_naming_the_field(tmp_path: Path, changes: dict, message: str) -> None:
    values = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces"), "run_id": "run", **changes}
    with pytest.raises(ValueError, match=message):
        ProfilerConfig(**values)


def test_a_profiler_dir_that_is_a_file_is_rejected_when_the_engine_is_built(sdar_dir: Path, tmp_path: Path) -> None:
    """It used to pass the build and raise FileExistsError in the middle of generate(), failing every request."""
    (tmp_path / "file").write_text("")
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "file"), "max_iterations": 1}
    with pytest.raises(ValueError, match=r"profiler_config.torch_profiler_dir='.*file' is invalid: .*not a directory"):
        Diffulex(str(sdar_dir), block_size=4, max_model_len=64, profiler_config=profiler)


def test_the_profiler_dir_is_created_when_the_engine_is_built(sdar_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "a" / "b" / "traces"
    profiler = {"profiler": "torch", "torch_profiler_dir": str(folder), "max_iterations": 1}
    with Diffulex(str(sdar_dir), block_size=4, max_model_len=64, profiler_config=profiler):
        assert folder.is_dir()


def test_a_profiler_dir_that_cannot_be_created_is_rejected_when_the_engine_is_built(
    sdar_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "file" / "traces")}
    with pytest.raises(ValueError, match=r"profiler_config.torch_profiler_dir='.*traces' is invalid: .*cannot be"):
        Diffulex(str(sdar_dir), block_size=4, max_model_len=64, profiler_config=profiler)


# --- a trace that cannot be recorded or written costs the trace, never the requests ---------------------------


def test_a_trace_that_cannot_be_written_fails_no_request(sdar_dir: Path, tmp_path: Path, caplog) -> None:
    folder = tmp_path / "traces"
    profiler = {"profiler": "torch", "torch_profiler_dir": str(folder), "max_iterations": 1, "run_id": "run"}
    with Diffulex(str(sdar_dir), block_size=4, max_model_len=64, profiler_config=profiler) as llm:
        folder.rmdir()
        folder.write_text("")  # the folder is gone when the trace is written (as a full disk would fail it)
        with caplog.at_level(logging.WARNING, logger="diffulex"):
            out = llm.generate(["hello", "world"], GREEDY, use_tqdm=False)
        assert [len(t.token_ids) for t in out.trajectories] == [16, 16]
        assert [t.completion_reason for t in out.trajectories] == ["max_new_tokens_reached"] * 2
        assert "profiler trace could not be written" in caplog.text
        assert len(llm.generate(["again"], GREEDY, use_tqdm=False).trajectories[0].token_ids) == 16


def test_a_profiler_that_cannot_start_fails_no_request(sdar_dir: Path, tmp_path: Path, monkeypatch, caplog) -> None:
    class Broken:
        def __init__(self, **kwargs: object) -> None:
            pass

        def __enter__(self) -> None:
            raise RuntimeError("another profiler is running")

    monkeypatch.setattr(step_profiler, "profile", Broken)
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces")}
    with Diffulex(str(sdar_dir), block_size=4, max_model_len=64, profiler_config=profiler) as llm:
        with caplog.at_level(logging.WARNING, logger="diffulex"):
            out = llm.generate(["hello"], GREEDY, use_tqdm=False)
        assert len(out.trajectories[0].token_ids) == 16
        assert "profiler could not start" in caplog.text
