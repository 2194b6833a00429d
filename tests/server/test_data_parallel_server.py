"""``diffulex serve --data-parallel-size 2``: one endpoint in front of two engine replicas (CPU processes here)."""

from __future__ import annotations

import json
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


def stream(server, prompt: str, max_tokens: int, stop: str) -> tuple[str, str | None, list[dict], str]:
    """A streamed completion: its text, finish reason, in-band errors, and its last event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stop": stop,
            "stream": True}
    text, finish, errors, last = "", None, [], ""
    with server.client() as client, client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last == "[DONE]":
                continue
            event = json.loads(last)
            if "error" in event:
                errors.append(event["error"])
                continue
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish, errors, last


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

        # one replica dies under load, streams with stop strings among its requests: its requests fail with a
        # clear error (a stream in-band, then [DONE]), the others are answered in full, stop strings applied
        streamed = PROMPTS[4:8]
        free = [reference_engine.generate([p], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                                          use_tqdm=False, apply_chat_template=False).trajectories[0].text
                for p in streamed]
        stops = [text[300:303] for text in free]  # late in the answer: the streams are still running at the kill
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(complete, server, p, 400, ignore_eos=True) for p in PROMPTS[:4]]
            streams = [pool.submit(stream, server, p, 400, stop) for p, stop in zip(streamed, stops, strict=True)]
            deadline = time.monotonic() + 60
            while not all(r["running"] for r in server.health()["replicas"]):
                assert time.monotonic() < deadline, "both replicas should be running requests"
                time.sleep(0.02)
            os.kill(server.loop.engine.replica_pids[0], signal.SIGKILL)
            outcomes = [f.result() for f in futures]
            stream_outcomes = [f.result() for f in streams]
        # which of the eight lands on the dead replica is the order they arrive in (each goes to the replica holding
        # fewer): the completions alone may all land on one replica, the eight together land on both
        failed = [body for status, body in outcomes if status != 200]
        for body in failed:
            assert "data-parallel replica 0 died" in body["error"]["message"]
        stream_failures = 0
        for text, finish, errors, last, reference, stop in zip(
                *zip(*stream_outcomes, strict=True), free, stops, strict=True):  # fmt: skip
            assert last == "[DONE]"
            if errors:
                stream_failures += 1
                assert [e["code"] for e in errors] == ["engine_error"]
                assert "data-parallel replica 0 died" in errors[0]["message"]
            else:
                assert (text, finish) == (reference[: reference.index(stop)], "stop")
        assert 0 < stream_failures + len(failed) < len(outcomes) + len(stream_outcomes)

        # the replica left keeps serving, and /health and /metrics say which one is gone
        status, body = complete(server, "fourteen", 6)
        assert status == 200 and body["choices"][0]["text"]
        state = server.wait_idle()
        assert [r["alive"] for r in state["replicas"]] == [False, True]
        # a dead replica runs and holds nothing: not its last figures before it died
        assert [(r["running"], r["waiting"], r["kv_pages_used"]) for r in state["replicas"]] == [(0, 0, 0)] * 2
        metrics = server.client().get("/metrics").text
        assert 'diffulex_replica_up{replica="0"} 0' in metrics
        assert 'diffulex_replica_requests_running{replica="0"} 0' in metrics
        assert 'diffulex_replica_kv_pages_used{replica="0"} 0' in metrics
    finally:
        server.stop()
