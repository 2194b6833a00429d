"""``diffulex serve --data-parallel-size 2``: one endpoint in front of two engine replicas (CPU processes here)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from diffulex import SamplingParams

from .conftest import start_server

# On a machine with CUDA the replicas take one GPU each; a single-GPU machine cannot hold two.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="two replicas need two GPUs here"
)
PROMPTS = ["one", "two three", "four five six", "seven", "eight nine", "ten", "eleven twelve", "thirteen"]


def complete(server, prompt: str, max_tokens: int, **extra) -> tuple[int, dict]:
    with server.client() as client:
        reply = client.post(
            "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
        )
    return reply.status_code, reply.json()


def test_two_replicas_answer_a_mixed_load_like_one_engine_and_survive_one_dying(sdar_dir: Path, reference_engine):
    server = start_server(sdar_dir, data_parallel_size=2)
    try:
        health = server.health()
        assert [r["alive"] for r in health["replicas"]] == [True, True]

        # a mixed load: every answer is the one a single engine gives that prompt alone, nothing is lost
        lengths = [4 + 3 * i for i in range(len(PROMPTS))]
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda args: complete(server, *args), zip(PROMPTS, lengths, strict=True)))
        for prompt, n, (status, body) in zip(PROMPTS, lengths, replies, strict=True):
            assert status == 200, body
            params = SamplingParams(temperature=0.0, max_tokens=n)
            alone = reference_engine.generate([prompt], params, use_tqdm=False, apply_chat_template=False)
            assert body["choices"][0]["text"] == alone.trajectories[0].text
        metrics = server.client().get("/metrics").text
        assert 'diffulex_replica_up{replica="0"} 1' in metrics and 'diffulex_replica_up{replica="1"} 1' in metrics

        # one replica dies under load: its requests fail with a clear error, the others are answered
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(complete, server, p, 400, ignore_eos=True) for p in PROMPTS[:4]]
            deadline = time.monotonic() + 60
            while not all(r["running"] for r in server.health()["replicas"]):
                assert time.monotonic() < deadline, "both replicas should be running requests"
                time.sleep(0.02)
            os.kill(server.loop.engine.replica_pids[0], signal.SIGKILL)
            outcomes = [f.result() for f in futures]
        failed = [body for status, body in outcomes if status != 200]
        assert 0 < len(failed) < len(outcomes)
        for body in failed:
            assert "data-parallel replica 0 died" in body["error"]["message"]

        # the replica left keeps serving, and /health and /metrics say which one is gone
        status, body = complete(server, "fourteen", 6)
        assert status == 200 and body["choices"][0]["text"]
        state = server.wait_idle()
        assert [r["alive"] for r in state["replicas"]] == [False, True]
        assert 'diffulex_replica_up{replica="0"} 0' in server.client().get("/metrics").text
    finally:
        server.stop()
