"""Bad input gets a 4xx with an OpenAI-style error body and the next good request succeeds; clients that leave
free their pages; a full queue answers 429; shutdown ends in-flight requests cleanly."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from diffulex import SamplingParams

from .conftest import MODEL_NAME, RunningServer, start_server

GOOD = {"model": MODEL_NAME, "prompt": "The baker opened his door", "max_tokens": 6, "temperature": 0}
LONG_PROMPT = "lighthouse " * 1000  # far over max_model_len=512

# (route, raw body, expected status, expected param or None)
BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", json.dumps({**GOOD, "model": "gpt-9"}), 404, "model"),
    ("/v1/completions", json.dumps({**GOOD, "max_tokens": "ten"}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({**GOOD, "temperature": "hot"}), 400, "temperature"),
    ("/v1/completions", json.dumps({**GOOD, "ignore_eos": "yes"}), 400, "ignore_eos"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": 42}), 400, "prompt"),
    ("/v1/completions", json.dumps({k: v for k, v in GOOD.items() if k != "prompt"}), 400, "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "temperature": -0.5}), 400, "temperature"),
    ("/v1/completions", json.dumps({**GOOD, "top_p": 1.5}), 400, "top_p"),
    ("/v1/completions", json.dumps({**GOOD, "top_k": -3}), 400, "top_k"),
    ("/v1/completions", json.dumps({**GOOD, "max_tokens": 0}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({**GOOD, "max_nfe": 0}), 400, "max_nfe"),
    ("/v1/completions", json.dumps({**GOOD, "max_repetition_run": -1}), 400, "max_repetition_run"),
    ("/v1/completions", json.dumps({**GOOD, "seed": -1}), 400, "seed"),
    ("/v1/completions", json.dumps({**GOOD, "stop": [""]}), 400, "stop"),
    ("/v1/completions", json.dumps({**GOOD, "stop": ["x"] * 17}), 400, "stop"),
    ("/v1/completions", json.dumps({**GOOD, "stop": "x" * 257}), 400, "stop"),
    ("/v1/completions", json.dumps({**GOOD, "n": 0}), 400, "n"),
    ("/v1/completions", json.dumps({**GOOD, "n": 1000}), 400, "n"),
    ("/v1/completions", json.dumps({**GOOD, "logprobs": 3}), 400, "logprobs"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": ""}), 400, "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": []}), 400, "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": [1, 999999]}), 400, "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": LONG_PROMPT}), 400, "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": LONG_PROMPT, "stream": True}), 400, "prompt"),
    ("/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": []}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": [{"content": "hi"}]}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": "hi"}), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": LONG_PROMPT}]}),
     400, "messages"),
    ("/v1/completions", json.dumps({**GOOD, "stream_options": {"include_usage": True}}), 400, "stream_options"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": False,
                                         "stream_options": {"include_usage": True}}), 400, "stream_options"),
    ("/generate", json.dumps({"prompt": "hi", "stream_mode": "sideways"}), 400, "stream_mode"),
    ("/generate", json.dumps({"max_tokens": 4}), 400, "prompt"),
    ("/generate", json.dumps({"prompt": "hi", "max_tokens": 1.5}), 400, "max_tokens"),
    # Text no encoder can write (a lone surrogate), in every field that carries text.
    ("/v1/completions", json.dumps({**GOOD, "model": "\ud800"}), 400, "model"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": "To be \udfff"}), 400, "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": ["ok", "\ud800"]}), 400, "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "stop": ["\ud83d"]}), 400, "stop"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}), 400, "messages"),
    ("/generate", json.dumps({"prompt": "hi", "user": "\udc00"}), 400, "user"),
    # Numbers outside what any field can mean.
    ("/v1/completions", json.dumps({**GOOD, "max_tokens": 10**400}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({**GOOD, "seed": 2**64}), 400, "seed"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": [1, -(2**70)]}), 400, "prompt"),
    ("/v1/completions", json.dumps({**GOOD, "temperature": float("inf")}), 400, "temperature"),
    ("/v1/completions", json.dumps({**GOOD, "top_p": float("nan")}), 400, "top_p"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}', 400,
     "temperature"),
    ("/v1/completions", json.dumps({**GOOD, "prompt": "x" * 100_000}), 400, "prompt"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(server: RunningServer, route, body, status, param) -> None:
    with server.client() as http:
        response = http.post(route, content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]
        response.content.decode("utf-8")  # whatever the input, the answer is valid UTF-8 (nothing echoed raw)
        if param is not None:
            assert error["param"] == param, error
        good = http.post("/v1/completions", json=GOOD)
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["finish_reason"] in ("stop", "length")


# A field of several types (a union) refused: the message names every type the field takes and the value sent.
WRONG_TYPES_OF_UNION_FIELDS = [
    ("/v1/completions", {**GOOD, "stop": ["a", 1]}, "stop", 'stop: must be str or list[str] (got ["a", 1])'),
    ("/v1/completions", {**GOOD, "stop": 5}, "stop", "stop: must be str or list[str] (got 5)"),
    ("/v1/completions", {**GOOD, "prompt": [True]}, "prompt",
     "prompt: must be str or list[int] or list[str] or list[list[int]] (got [true])"),
    ("/v1/completions", {**GOOD, "logprobs": "yes"}, "logprobs", 'logprobs: must be bool or int (got "yes")'),
    ("/generate", {"prompt": {"text": "hi"}}, "prompt", 'prompt: must be str or list[int] (got {"text": "hi"})'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages",
     "messages.0.content: must be str or list[dict[str,any]] (got 5)"),
]


@pytest.mark.parametrize(("route", "body", "param", "message"), WRONG_TYPES_OF_UNION_FIELDS)
def test_a_wrong_type_for_a_field_of_several_types_names_them_all(
    server: RunningServer, route: str, body: dict, param: str, message: str
) -> None:
    with server.client() as http:
        response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["message"]) == (param, message)


@pytest.mark.parametrize("n", [0, -1, 2])
def test_generate_refuses_any_n_but_one_saying_what_is_allowed(server: RunningServer, n: int) -> None:
    with server.client() as http:
        response = http.post("/generate", json={"prompt": "hi", "max_tokens": 2, "n": n})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n"
    assert error["message"].startswith(f"n={n} is invalid on /generate: it answers one completion, so n must be 1")


def test_max_completion_tokens_out_of_range_is_refused_naming_max_completion_tokens(server: RunningServer) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}
    with server.client() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_completion_tokens"
    assert error["message"].startswith("max_completion_tokens=-3 is invalid")
    assert "max_tokens" not in error["message"].replace("max_completion_tokens", "")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_any_valid_seed_works_with_any_n_the_choice_seeds_wrapping_modulo_2_63(server: RunningServer, route) -> None:
    """Choice i samples with (seed + i) mod 2**63: the last valid seed's second choice is seed 0's first."""
    if route == "/v1/completions":
        base = {"model": MODEL_NAME, "prompt": "Once upon", "max_tokens": 6, "temperature": 1.0}
    else:
        base = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Once upon"}], "max_tokens": 6,
                "temperature": 1.0}

    def texts(seed: int, n: int) -> list[str]:
        with server.client() as http:
            response = http.post(route, json={**base, "seed": seed, "n": n})
        assert response.status_code == 200, response.text
        return [c.get("text", c.get("message", {}).get("content")) for c in response.json()["choices"]]

    assert len(texts(2**63 - 2, 3)) == 3
    assert texts(2**63 - 1, 2)[1] == texts(0, 1)[0]


def test_head_answers_like_get_without_a_body(server: RunningServer) -> None:
    """Load balancers health-check with HEAD: every GET route answers it with the GET's status and headers."""
    with server.client() as http:
        for path in ("/health", "/metrics", "/", "/v1/models", "/page-config"):
            got, head = http.get(path), http.head(path)
            assert head.status_code == got.status_code == 200, path
            assert head.content == b"", path
            assert head.headers["content-type"] == got.headers["content-type"], path
        for path in ("/", "/v1/models", "/page-config"):  # the same body every time: the same length
            assert http.head(path).headers["content-length"] == http.get(path).headers["content-length"], path
        assert http.head("/v1/completions").status_code == 405  # as its GET
        assert http.head("/v2/nothing").status_code == 404


def test_unknown_route_and_method(server: RunningServer) -> None:
    with server.client() as http:
        assert http.get("/v2/nothing").status_code == 404
        assert http.get("/v1/completions").status_code == 405
        assert "error" in http.get("/v2/nothing").json()


def test_stop_string_cuts_the_answer_and_the_stream(server: RunningServer, reference_engine) -> None:
    free = reference_engine.generate(["One, two, three"], SamplingParams(temperature=0, max_tokens=24),
                                     use_tqdm=False, apply_chat_template=False).trajectories[0].text
    stop = free[5:7]
    assert stop and stop in free
    body = {**GOOD, "prompt": "One, two, three", "max_tokens": 24, "stop": stop}
    with server.client() as http:
        out = http.post("/v1/completions", json=body).json()["choices"][0]
        assert out["diffulex_completion_reason"] == "stop_string_matched"
        assert out["finish_reason"] == "stop"
        assert out["text"] == free[: free.index(stop)]
        streamed = _stream_text(http, "/v1/completions", {**body, "stream": True})
    assert streamed == out["text"]


def _stream_text(http: httpx.Client, route: str, body: dict) -> str:
    text = ""
    with http.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice.get("text", "")
    return text


def test_disconnect_mid_stream_aborts_and_frees_pages(server: RunningServer) -> None:
    body = {**GOOD, "max_tokens": 480, "ignore_eos": True, "stream": True}
    before = _aborted(server)
    with server.client() as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data: ") for line in got)
            busy = server.health()
            assert busy["in_flight"] == 1
        # Leaving the block closes the connection in the middle of the stream.
    state = server.wait_idle()
    assert (state["in_flight"], state["running"], state["waiting"], state["kv_pages_used"]) == (0, 0, 0, 0)
    assert _aborted(server) == before + 1
    with server.client() as http:
        assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_disconnect_of_a_non_streaming_request_aborts_it(server: RunningServer) -> None:
    body = {**GOOD, "max_tokens": 480, "ignore_eos": True}  # seconds of work
    before = _aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.3)
    state = server.wait_idle()
    assert (state["in_flight"], state["kv_pages_used"]) == (0, 0)
    assert _aborted(server) == before + 1


def _aborted(server: RunningServer) -> int:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith('diffulex_requests_finished_total{reason="aborted"}'):
            return int(line.split()[-1])
    return 0


def test_full_queue_answers_429_then_recovers(sdar_dir: Path) -> None:
    running = start_server(sdar_dir, max_waiting=1, max_num_reqs=1)  # capacity: 1 running + 1 waiting
    try:
        # More completions than the server can ever hold is a 400 (a retry cannot succeed), not a 429.
        for body, param in (({**GOOD, "n": 3}, "n"), ({**GOOD, "prompt": ["a", "b", "c"]}, "prompt")):
            never = httpx.post(running.base_url + "/v1/completions", json=body, timeout=10)
            assert never.status_code == 400, never.text
            assert never.json()["error"]["param"] == param
            assert "at most 2" in never.json()["error"]["message"]
        slow = {**GOOD, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=running.base_url, timeout=30) as a, httpx.Client(base_url=running.base_url,
                                                                                     timeout=30) as b:
            with a.stream("POST", "/v1/completions", json=slow) as first, \
                    b.stream("POST", "/v1/completions", json=slow) as second:
                assert first.status_code == second.status_code == 200
                refused = httpx.post(running.base_url + "/v1/completions", json=GOOD, timeout=10)
                assert refused.status_code == 429
                assert refused.json()["error"]["type"] == "rate_limit_error"
        running.wait_idle()
        assert httpx.post(running.base_url + "/v1/completions", json=GOOD, timeout=30).status_code == 200
        rejected = httpx.get(running.base_url + "/metrics").text
        assert 'diffulex_requests_rejected_total{status="429"} 1' in rejected
        assert 'diffulex_requests_rejected_total{status="400"} 2' in rejected
    finally:
        running.stop()


def test_wait_policy_queues_instead_of_refusing(sdar_dir: Path) -> None:
    running = start_server(sdar_dir, max_waiting=0, max_num_reqs=1, queue_policy="wait")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=running.base_url, timeout=30) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=GOOD) for _ in range(4)))

    try:
        responses = asyncio.run(burst())
        assert [r.status_code for r in responses] == [200] * 4
    finally:
        running.stop()


def test_shutdown_lets_in_flight_requests_finish_within_the_grace_period(sdar_dir: Path) -> None:
    running = start_server(sdar_dir, shutdown_grace_s=60.0)  # far more than the request needs, even on a busy CPU
    body = {**GOOD, "max_tokens": 240, "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(base_url=running.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            events.append(next(lines))
            t0 = time.monotonic()
            running.server.should_exit = True  # like SIGTERM
            events.extend(lines)
    running.thread.join(30)
    assert not running.thread.is_alive()
    events = [e for e in events if e]
    assert events[-1] == "data: [DONE]", "the in-flight request should finish within the grace period"
    final = json.loads([e for e in events if e.startswith("data: {")][-1][6:])
    assert final["choices"][0]["finish_reason"] == "length"
    assert time.monotonic() - t0 < 60
    assert not running.loop.running
    assert running.loop.engine._closed


def test_nulls_mean_defaults_as_in_openai(server: RunningServer) -> None:
    body = {**GOOD, "temperature": None, "top_p": None, "n": None, "stream": None, "presence_penalty": None,
            "frequency_penalty": 0, "echo": False, "logprobs": None, "stop": None, "seed": None, "user": "u1",
            "some_future_field": {"x": 1}}
    with server.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


def test_a_null_stream_mode_streams_the_default_denoise_snapshots(server: RunningServer) -> None:
    body = {"prompt": "The baker", "max_tokens": 8, "temperature": 0, "stream": True, "stream_mode": None}
    with server.client() as http, http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    kinds = [json.loads(e)["event"] for e in events[:-1]]
    assert kinds[-1] == "final" and set(kinds[:-1]) == {"denoise"}
