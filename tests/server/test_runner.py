"""Shutdown keeps its promises on a real server process on loopback: past the grace period a waiting client gets
the documented JSON error, a stream gets an error event then ``[DONE]``; a second signal exits at once; an engine
that fails as a whole stops the process with exit code 1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from diffulex.engine.request_update import RequestUpdate
from diffulex.outputs import Trajectory
from diffulex.server.app import create_app
from diffulex.server.engine_loop import EngineLoop
from diffulex.server.runner import GracefulServer
from diffulex.testing.distributed import free_port

from .test_engine_loop import FakeEngine

LONG = {"model": "runner-test", "prompt": "The baker", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


class ServerProcess:
    def __init__(self, model_dir: Path, grace_s: float, session: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "diffulex.server", "--model", str(model_dir), "--port", str(self.port),
               "--served-model-name", "runner-test", "--block-size", "4", "--page-size", "8", "--buffer-size", "2",
               "--max-model-len", "2048", "--shutdown-grace", str(grace_s), "--log-level", "warning"]
        # ``session``: a process group of its own, as a service manager or a shell's job gives the server
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ},
                                     start_new_session=session)  # fmt: skip
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read().decode()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)

    def in_flight(self) -> int:
        return httpx.get(self.url + "/health", timeout=5).json()["in_flight"]

    def wait_in_flight(self, n: int, timeout_s: float = 30) -> None:
        """Until the server holds at least ``n`` requests in flight."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight() < n:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def server_process(sdar_dir: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    proc = ServerProcess(sdar_dir, grace_s=request.param)
    yield proc
    proc.kill()


def _in_background(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as err:  # reported by the test's assertions
            out["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.mark.parametrize("server_process", [0.5], indirect=True)
def test_past_the_grace_period_every_open_request_gets_the_documented_error(server_process: ServerProcess) -> None:
    url = server_process.url

    def waiting() -> httpx.Response:
        return httpx.post(url + "/v1/completions", json=LONG, timeout=60)

    def streaming() -> list[str]:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                **{k: v for k, v in LONG.items() if k != "prompt"}, "stream": True,
                "messages": [{"role": "user", "content": "Hi"}]}) as response:
            return [line for line in response.iter_lines() if line]

    plain, plain_out = _in_background(waiting)
    stream, stream_out = _in_background(streaming)
    server_process.wait_in_flight(2)
    server_process.proc.send_signal(signal.SIGTERM)
    plain.join(30)
    stream.join(30)
    assert server_process.proc.wait(timeout=30) == 0

    response = plain_out["value"]
    assert response.status_code == 503
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"] == {"message": "the request was aborted (server shutting down)",
                                        "type": "server_error", "param": None, "code": "aborted"}
    events = stream_out["value"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "aborted"


@pytest.mark.parametrize("server_process", [120.0], indirect=True)
def test_a_second_signal_exits_at_once(server_process: ServerProcess) -> None:
    client, out = _in_background(lambda: httpx.post(server_process.url + "/v1/completions", json=LONG, timeout=60))
    server_process.wait_in_flight(1)
    server_process.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert server_process.proc.poll() is None, "the first signal waits for the grace period"
    started = time.monotonic()
    server_process.proc.send_signal(signal.SIGINT)
    code = server_process.proc.wait(timeout=10)
    assert time.monotonic() - started < 5
    assert code == 128 + signal.SIGINT
    client.join(30)


def test_sigterm_to_the_whole_process_group_still_drains_the_requests_in_flight(sdar_dir: Path) -> None:
    """systemd's default stop, ``timeout``, ``kill -TERM -PGID``: the engine's process (the server's replica) gets
    the signal too, and must leave the ending to the server, which finishes what it holds first."""
    server = ServerProcess(sdar_dir, grace_s=60.0, session=True)
    try:
        request = {**LONG, "max_tokens": 96}
        client, out = _in_background(lambda: httpx.post(server.url + "/v1/completions", json=request, timeout=90))
        server.wait_in_flight(1)
        os.killpg(server.proc.pid, signal.SIGTERM)
        client.join(90)
        assert server.proc.wait(timeout=60) == 0, server.proc.stdout.read().decode()
        response = out["value"]
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"
    finally:
        server.kill()


def test_an_engine_that_fails_as_a_whole_stops_the_server_with_exit_code_1() -> None:
    engine = FakeEngine(fail_at_step=2)
    loop = EngineLoop(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = GracefulServer(uvicorn.Config(create_app(loop, "fake"), log_level="critical"), loop, 1.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        failed = httpx.post(url + "/v1/completions", json={"prompt": "a b", "max_tokens": 5}, timeout=10)
        assert failed.status_code == 503 and "device lost" in failed.json()["error"]["message"]
        thread.join(30)
        assert not thread.is_alive(), "the server should stop by itself"
        assert server.exit_code == 1
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_request_the_engine_failed_alone_gets_a_500_and_the_engine_serves_on() -> None:
    """The engine fails one step's requests (their trajectories carry the error) and goes on: only they fail."""

    class FailingOneRequest(FakeEngine):
        def step(self) -> list[RequestUpdate]:  # a request whose prompt is [9] fails in the next step
            failing = [req_id for req_id, req in self.requests.items() if req["ids"] == [9]]
            for req_id in failing:
                del self.requests[req_id]
            updates = super().step()
            for req_id in failing:
                traj = Trajectory(0, req_id, [9], [], "", "error", 1, error="RuntimeError('bad step')")
                updates.append(RequestUpdate(req_id, None, True, [], [], traj))
            return updates

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        loop = EngineLoop(FailingOneRequest())
        loop.start()
        app = create_app(loop, "fake", manage_engine_loop=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            bad = await http.post("/v1/completions", json={"prompt": [9], "max_tokens": 5})
            good = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5})
            health = await http.get("/health")
        await loop.shutdown(1.0)
        return bad, good, health

    bad, good, health = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert bad.status_code == 500
    assert bad.json()["error"]["code"] == "engine_error" and "bad step" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == "xxxxx"
    assert health.status_code == 200 and health.json()["status"] == "ok"

