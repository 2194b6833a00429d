"""An engine, and a server answering a chat request, start without importing transformers (seconds of every cold
start) for a checkpoint whose tokenizer diffulex builds itself. Each check runs in a fresh interpreter, since this
one has long imported transformers for other tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diffulex.testing import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT_S = 300


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_an_engine_generates_from_a_chat_without_importing_transformers(tiny) -> None:
    out = _run(
        """
        import sys
        import diffulex

        llm = diffulex.Diffulex(model=sys.argv[1], block_size=4, max_model_len=256)
        outputs = llm.generate([[{"role": "user", "content": "What is 3 + 4?"}]],
                               diffulex.SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        print(type(llm.tokenizer).__name__, len(outputs.trajectories), "transformers" in sys.modules)
        """,
        str(tiny),
    )
    assert out.split() == ["CheckpointTokenizer", "1", "False"]


def test_a_server_streams_a_chat_answer_without_importing_transformers(tiny) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    out = _run(
        """
        import json, sys
        sys.path.insert(0, sys.argv[2])
        from conftest import MODEL_NAME, start_server

        server = start_server(sys.argv[1])
        try:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                    "stream": True}
            with server.client() as client:
                response = client.post("/v1/chat/completions", json=body)
            chunks = [line for line in response.text.splitlines() if line.startswith("data: ")]
        finally:
            server.stop()
        print(response.status_code, chunks[-1], "transformers" in sys.modules)
        """,
        str(tiny),
        str(REPO / "tests" / "server"),
    )
    assert out.split() == ["200", "data:", "[DONE]", "False"]
