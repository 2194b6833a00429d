"""A real server on 127.0.0.1 (uvicorn in a background thread, a free port) around a tiny SDAR engine."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from diffulex import Diffulex  # noqa: E402
from diffulex.server.app import create_app  # noqa: E402
from diffulex.server.engine_loop import EngineLoop  # noqa: E402
from diffulex.server.engine_placement import build_served_engine  # noqa: E402
from diffulex.server.runner import GracefulServer  # noqa: E402

MODEL_NAME = "tiny-sdar"
ENGINE_FIELDS: dict[str, Any] = dict(
    block_size=4, page_size=8, buffer_size=2, max_model_len=512, max_num_batched_tokens=1024, max_num_reqs=32,
)


@dataclass
class RunningServer:
    base_url: str
    loop: EngineLoop
    server: Any
    thread: threading.Thread

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30.0, **kwargs)

    def health(self) -> dict[str, Any]:
        return httpx.get(self.base_url + "/health", timeout=5.0).json()

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """Poll /health until nothing is in flight and no KV page is used (bounded in time)."""
        deadline = time.monotonic() + timeout
        state = self.health()
        while time.monotonic() < deadline:
            state = self.health()
            if state["in_flight"] == 0 and state["running"] == 0 and state["kv_pages_used"] == 0:
                return state
            time.sleep(0.05)
        return state

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(
    model_dir: Path, *, max_waiting: int = 64, queue_policy: str = "reject", max_body_bytes: int | None = None,
    shutdown_grace_s: float = 5.0, engine_placement: str = "thread", **fields: Any,
) -> RunningServer:
    engine = build_served_engine(str(model_dir), {**ENGINE_FIELDS, **fields}, engine_placement)
    loop = EngineLoop(engine, max_waiting=max_waiting, queue_policy=queue_policy, queue_timeout=5.0)
    limits = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
    app = create_app(loop, MODEL_NAME, shutdown_grace_s=shutdown_grace_s, **limits)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning")
    server = GracefulServer(config, loop, shutdown_grace_s=shutdown_grace_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return RunningServer(f"http://127.0.0.1:{port}", loop, server, thread)


@pytest.fixture(scope="session")
def server(sdar_dir: Path) -> Iterator[RunningServer]:
    running = start_server(sdar_dir)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def reference_engine(sdar_dir: Path) -> Iterator[Any]:
    """A second engine on the same checkpoint, for "what generate returns for this request alone"."""
    engine = Diffulex(str(sdar_dir), **ENGINE_FIELDS)
    yield engine
    engine.exit()
