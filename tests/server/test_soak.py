"""A CI-sized loopback soak: 8 clients for 30 s with random client drops and bad requests mixed in. Valid requests
never fail and get the answers an idle server gives; afterwards no page, request or table entry is left."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import RunningServer, start_server
from .fuzz_inputs import MODEL_NAME, random_cases
from .test_fuzz import VALID, answer_of, check_answer, send

SEED = 7
CLIENTS = 8
SOAK_SECONDS = 30.0
BODY_LIMIT = 64 * 1024
DROP_SHARE, BAD_SHARE = 0.15, 0.15
LONG = {"model": MODEL_NAME, "prompt": "The lighthouse keeper", "max_tokens": 100, "ignore_eos": True,
        "temperature": 0}
RSS_GROWTH_LIMIT = 256 * 1024 * 1024


@dataclass
class ClientLog:
    valid: int = 0
    dropped: int = 0
    bad: int = 0
    failures: list[str] = field(default_factory=list)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def drop_midway(server: RunningServer, rng: random.Random) -> None:
    """Leave a request before it ends: mid-stream, or by giving up on a non-streaming answer."""
    if rng.random() < 0.5:
        with server.client() as http, http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(rng.randint(1, 6)):
                next(lines)
        return
    try:
        httpx.post(server.base_url + "/v1/completions", json=LONG, timeout=rng.uniform(0.05, 0.5))
    except httpx.TimeoutException:
        pass


def client(server: RunningServer, index: int, expected: list[Any], deadline: float, log: ClientLog) -> None:
    rng = random.Random(SEED * 1000 + index)
    bad_cases = [c for c in random_cases(SEED + index, 200, BODY_LIMIT) if c.expect == "bad"]
    with server.client() as http:
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll < DROP_SHARE:
                    drop_midway(server, rng)
                    log.dropped += 1
                elif roll < DROP_SHARE + BAD_SHARE:
                    case = rng.choice(bad_cases)
                    problem = check_answer(case, send(http, case))
                    if problem is not None:
                        log.failures.append(f"bad request {case.describe()} -> {problem}")
                    log.bad += 1
                else:
                    k = rng.randrange(len(VALID))
                    got = answer_of(http, *VALID[k])
                    if got != expected[k]:
                        log.failures.append(f"valid request {VALID[k]}: {got!r} != {expected[k]!r}")
                    log.valid += 1
            except (AssertionError, httpx.HTTPError) as err:
                log.failures.append(f"client {index}: {err!r}")


@pytest.fixture(scope="module")
def soak_server(sdar_dir: Path) -> Iterator[RunningServer]:
    running = start_server(sdar_dir, max_model_len=128, max_body_bytes=BODY_LIMIT)
    yield running
    running.stop()


def test_loopback_soak_with_drops_and_bad_requests_leaves_the_server_as_idle(soak_server: RunningServer) -> None:
    with soak_server.client() as http:
        expected = [answer_of(http, route, body) for route, body in VALID]
    rss_before = rss_bytes()
    logs = [ClientLog() for _ in range(CLIENTS)]
    deadline = time.monotonic() + SOAK_SECONDS
    threads = [threading.Thread(target=client, args=(soak_server, i, expected, deadline, logs[i]))
               for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SOAK_SECONDS + 60)
    failures = [f for log in logs for f in log.failures]
    assert not failures, "\n".join(failures[:10])
    valid, dropped, bad = (sum(getattr(log, k) for log in logs) for k in ("valid", "dropped", "bad"))
    assert valid >= 5 * CLIENTS and dropped >= CLIENTS and bad >= CLIENTS, (valid, dropped, bad)

    state = soak_server.wait_idle(timeout=20)
    assert state["status"] == "ok", state
    assert (state["in_flight"], state["running"], state["waiting"], state["kv_pages_used"]) == (0, 0, 0, 0), state
    engine = soak_server.loop.engine
    assert soak_server.loop.num_tracked == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.scheduler.kv_cache.num_used_pages == 0
    assert rss_bytes() - rss_before < RSS_GROWTH_LIMIT
    with soak_server.client() as http:  # and the server still answers as it did when idle
        assert [answer_of(http, route, body) for route, body in VALID] == expected
