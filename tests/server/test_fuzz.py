"""A seeded HTTP fuzz (bounded in count and time): malformed JSON, wrong types, extreme numbers, unicode junk,
oversized bodies, every route. No request gets a 5xx, each bad one gets a 4xx naming its field, the engine is
healthy afterwards, and valid requests running alongside get the answers an idle server gives."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import RunningServer, start_server
from .fuzz_inputs import BASES, EXTREME_NUMBERS, MODEL_NAME, Case, random_cases

SEED = 2026
NUM_CASES = 400
TIME_BUDGET_S = 90.0
BODY_LIMIT = 64 * 1024
# Requests with one right answer (greedy, or sampled from a seed), sent alongside the fuzz.
VALID: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "The baker opened", "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Once upon", "max_tokens": 8, "temperature": 0.8,
                         "seed": 11}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello there"}],
                              "max_tokens": 8, "temperature": 0}),
    ("/generate", {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ["A lighthouse", "The sea"], "max_tokens": 6,
                         "temperature": 0, "stream": True}),
    # several seeded choices streamed with stop strings: one choice ends on a stop string, the other at its length
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Once upon", "max_tokens": 12, "temperature": 0.9, "seed": 3,
                         "n": 2, "stop": ["s", "\t"], "stream": True}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell a story"}],
                              "max_tokens": 12, "temperature": 0.9, "seed": 5, "n": 2, "stop": "a", "stream": True}),
]


def answer_of(http: httpx.Client, route: str, body: dict[str, Any]) -> Any:
    """What a valid request answered: the texts of its choices (streamed ones concatenated per choice)."""
    if body.get("stream"):
        texts: dict[int, str] = {}
        with http.stream("POST", route, json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    for choice in event["choices"]:
                        text = choice["text"] if "text" in choice else choice["delta"].get("content", "")
                        texts[choice["index"]] = texts.get(choice["index"], "") + text
        return [texts[k] for k in sorted(texts)]
    response = http.post(route, json=body)
    assert response.status_code == 200, response.text
    out = response.json()
    if route == "/generate":
        return out["token_ids"]
    return [c.get("text", c.get("message", {}).get("content")) for c in out["choices"]]


def check_answer(case: Case, response: httpx.Response) -> str | None:
    """Why the server's answer to ``case`` is wrong, or None if it is right."""
    status = response.status_code
    if status >= 500:
        return f"{status} {response.text[:300]}"
    try:
        response.content.decode("utf-8")
    except UnicodeDecodeError:
        return "the answer is not valid UTF-8"
    if status == 200:
        return None if case.expect == "maybe" else "200 for a bad request"
    if not 400 <= status < 500:
        return f"unexpected status {status}"
    error = response.json().get("error")
    if not isinstance(error, dict) or not error.get("message"):
        return f"no error message: {response.text[:300]}"
    if case.param is not None:
        if error.get("param") != case.param:
            return f"param {error.get('param')!r}, expected {case.param!r}: {error['message']}"
        if case.param not in error["message"]:
            return f"the message does not name {case.param!r}: {error['message']}"
    return None


def send(http: httpx.Client, case: Case) -> httpx.Response:
    headers = {"content-type": "application/json"} if case.body is not None else {}
    return http.request(case.method, case.route, content=case.body, headers=headers)


class HealthyServer:
    """One fuzz server shared by the tests of this module, replaced if a test left it unhealthy, so that each
    test's verdict is its own."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.running: RunningServer | None = None

    def get(self) -> RunningServer:
        if self.running is not None and self.running.thread.is_alive():
            try:
                if self.running.health()["status"] == "ok":
                    return self.running
            except httpx.HTTPError:
                pass
        self.stop()
        self.running = start_server(self.model_dir, max_model_len=64, max_body_bytes=BODY_LIMIT)
        return self.running

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()
            self.running = None


@pytest.fixture(scope="module")
def healthy_server(sdar_dir: Path) -> Iterator[HealthyServer]:
    holder = HealthyServer(sdar_dir)
    yield holder
    holder.stop()


@pytest.fixture
def fuzz_server(healthy_server: HealthyServer) -> RunningServer:
    return healthy_server.get()


@pytest.fixture
def idle_answers(fuzz_server: RunningServer) -> list[Any]:
    with fuzz_server.client() as http:
        return [answer_of(http, route, body) for route, body in VALID]


class ValidTraffic:
    """Sends the VALID requests in a loop on its own thread and records every answer that differs."""

    def __init__(self, server: RunningServer, expected: list[Any]) -> None:
        self.server, self.expected = server, expected
        self.done = threading.Event()
        self.sent = 0
        self.failures: list[str] = []
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with self.server.client() as http:
            while not self.done.is_set():
                k = self.sent % len(VALID)
                route, body = VALID[k]
                try:
                    got = answer_of(http, route, body)
                    if got != self.expected[k]:
                        self.failures.append(f"{route} {body}: {got!r} != {self.expected[k]!r}")
                except (AssertionError, httpx.HTTPError) as err:
                    self.failures.append(f"{route} {body}: {err!r}")
                self.sent += 1

    def __enter__(self) -> ValidTraffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(60)


def assert_healthy_and_idle(server: RunningServer) -> None:
    state = server.wait_idle()
    assert state["status"] == "ok", state
    assert (state["in_flight"], state["running"], state["waiting"], state["kv_pages_used"]) == (0, 0, 0, 0), state
    metrics = httpx.get(server.base_url + "/metrics").text
    assert 'rejected_total{status="5' not in metrics


def test_random_hostile_requests_get_4xx_naming_the_field_while_valid_ones_are_unaffected(
    fuzz_server: RunningServer, idle_answers: list[Any]
) -> None:
    cases = random_cases(SEED, NUM_CASES, BODY_LIMIT)
    wrong: list[str] = []
    started = time.monotonic()
    sent = 0
    with ValidTraffic(fuzz_server, idle_answers) as traffic, fuzz_server.client() as http:
        for case in cases:
            if time.monotonic() - started > TIME_BUDGET_S:
                break
            problem = check_answer(case, send(http, case))
            if problem is not None:
                wrong.append(f"{case.describe()} -> {problem}")
            sent += 1
    assert sent >= NUM_CASES // 2, f"only {sent} cases ran within {TIME_BUDGET_S} s"
    assert not wrong, "\n".join(wrong[:20])
    assert traffic.sent >= len(VALID) and not traffic.failures, traffic.failures[:5]
    assert_healthy_and_idle(fuzz_server)


@pytest.mark.parametrize("route", list(BASES))
@pytest.mark.parametrize("field", ["top_p", "temperature"])
def test_extreme_sampling_numbers_are_served_or_refused_and_the_engine_stays_healthy(
    fuzz_server: RunningServer, idle_answers: list[Any], route: str, field: str
) -> None:
    with fuzz_server.client() as http:
        for raw in EXTREME_NUMBERS:
            base = json.dumps({k: v for k, v in BASES[route].items() if k != field})
            case = Case("POST", route, (base[:-1] + f', "{field}": {raw}}}').encode(), "maybe", field, raw)
            problem = check_answer(case, send(http, case))
            assert problem is None, f"{case.describe()} -> {problem}"
        assert [answer_of(http, r, b) for r, b in VALID] == idle_answers
    assert_healthy_and_idle(fuzz_server)
