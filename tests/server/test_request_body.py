"""The request body at the edge: over the size limit is a 413 before parsing; values no field can mean are 400s
that name the field and never echo unencodable text."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from diffulex.server.limits import DEFAULT_MAX_BODY_BYTES
from diffulex.server.protocol import APIError, escaped
from diffulex.server.request_body import INT64_MAX, BodyGuard, check_values, parse_json_body

from .conftest import MODEL_NAME, RunningServer

GOOD = {"model": MODEL_NAME, "prompt": "The baker opened his door", "max_tokens": 6, "temperature": 0}


def refusal(body: bytes | str) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_json_body(body.encode() if isinstance(body, str) else body)
    return caught.value


def test_valid_json_parses_to_the_same_document_as_json_loads() -> None:
    body = json.dumps({"prompt": ["a", "b\u00e9\U0001f600"], "max_tokens": INT64_MAX, "temperature": 1e-40,
                       "stop": None, "ignore_eos": True})
    assert parse_json_body(body.encode()) == json.loads(body)


@pytest.mark.parametrize(("body", "param", "shown"), [
    ('{"prompt": "a\\ud800b"}', "prompt", "\\ud800"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages", "messages[0].content"),
    ('{"stop": ["ok", "\\ud83d"]}', "stop", "stop[1]"),
    ('{"\\ud800": 1}', "\\ud800", "\\ud800"),
    ('{"max_tokens": ' + "9" * 400 + "}", "max_tokens", "(400 digits)"),
    ('{"seed": 18446744073709551616}', "seed", "out of range"),
    ('{"temperature": NaN}', "temperature", "finite"),
    ('{"temperature": -Infinity}', "temperature", "finite"),
    ('{"top_p": 1e400}', "top_p", "finite"),
])
def test_values_no_field_can_mean_are_refused_naming_the_field(body: str, param: str, shown: str) -> None:
    err = refusal(body)
    assert (err.status, err.param) == (400, param)
    assert shown in err.message
    err.message.encode("utf-8")  # the message itself can always be sent


@pytest.mark.parametrize(("body", "reason"), [
    (b"{not json", "malformed JSON"),
    (b'{"prompt": "\xff"}', "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed JSON"),
])
def test_bodies_that_are_not_json_are_refused_without_a_param(body: bytes, reason: str) -> None:
    err = refusal(body)
    assert err.status == 400 and err.param is None and reason in err.message


def test_a_huge_integer_literal_is_never_converted() -> None:
    started = time.perf_counter()
    err = refusal('{"max_tokens": ' + "7" * 1_000_000 + "}")
    assert err.param == "max_tokens"
    assert len(err.message) < 300
    assert time.perf_counter() - started < 2.0


def test_check_values_walks_nested_documents() -> None:
    check_values({"a": [{"b": "fine"}, 1.5, -3, None, True]})
    with pytest.raises(APIError, match=r"a\[1\]\.b"):
        check_values({"a": [{}, {"b": float("nan")}]})


def test_escaped_text_is_always_encodable_and_bounded() -> None:
    assert escaped("ab\ud800cd") == "ab\\ud800cd"
    assert escaped("x" * 100, limit=10) == "x" * 10 + "..."
    assert escaped("x" * 100, limit=None) == "x" * 100


def test_a_body_over_the_limit_is_refused_with_413_from_its_declared_length(server: RunningServer) -> None:
    body = json.dumps({**GOOD, "prompt": "a" * DEFAULT_MAX_BODY_BYTES}).encode()
    with server.client() as http:
        started = time.monotonic()
        response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["code"] == "body_too_large" and str(DEFAULT_MAX_BODY_BYTES) in error["message"]
        assert time.monotonic() - started < 5
    with server.client() as http:
        assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_a_chunked_body_over_the_limit_is_refused_while_it_is_read(server: RunningServer) -> None:
    piece = b"a" * 65536
    count = DEFAULT_MAX_BODY_BYTES // len(piece) + 16

    def chunks() -> Iterator[bytes]:  # no Content-Length: only counting the bytes can tell
        yield b'{"prompt": "'
        for _ in range(count):
            yield piece
        yield b'"}'

    with server.client() as http:
        response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert server.health()["status"] == "ok"


def test_a_body_under_the_limit_is_replayed_whole_to_the_route(server: RunningServer) -> None:
    body = json.dumps({**GOOD, "stop": ["zz"], "user": "u" * 200_000})
    with server.client() as http:
        response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain",
                                          "multipart/form-data"])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_a_json_body_without_a_json_content_type_is_refused_saying_what_to_send(
    server: RunningServer, route: str, content_type: str | None
) -> None:
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    if route == "/generate":
        del body["messages"]
    headers = {} if content_type is None else {"content-type": content_type}
    with server.client() as http:  # like `curl -d '{...}'`: a JSON text sent as a form
        response = http.post(route, content=json.dumps(body).encode(), headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type" and error["param"] is None
    assert "Content-Type: application/json" in error["message"]
    assert "b'" not in error["message"]
    if content_type is not None:
        assert content_type in error["message"]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
def test_a_json_content_type_with_parameters_or_any_case_is_accepted(server: RunningServer, content_type: str) -> None:
    with server.client() as http:
        response = http.post("/v1/completions", content=json.dumps(GOOD), headers={"content-type": content_type})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("charset", ["latin-1", "ISO-8859-1", '"utf-16"'])
def test_a_json_body_declared_in_another_charset_than_utf8_is_refused_naming_it(server: RunningServer,
                                                                                 charset: str) -> None:
    """JSON between systems is UTF-8 (RFC 8259): a body declared latin-1 would be read as UTF-8 and its accented
    letters changed or refused as bytes; the declaration itself is refused, naming the charset."""
    body = json.dumps({**GOOD, "prompt": "café"}, ensure_ascii=False).encode("latin-1")
    with server.client() as http:
        response = http.post("/v1/completions", content=body,
                             headers={"content-type": f"application/json; charset={charset}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type"
    assert charset.strip('"') in error["message"] and "UTF-8" in error["message"]


def _guarded(messages: list[dict]) -> tuple[list[bytes], list[dict]]:
    """Runs one ``POST /v1/completions`` whose client sends ``messages`` through `BodyGuard`: the bodies the route
    was handed, and what was sent back."""
    handed: list[bytes] = []
    sent: list[dict] = []

    async def route(scope, receive, send) -> None:
        handed.append((await receive())["body"])

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]}
    asyncio.run(BodyGuard(route, max_body_bytes=1024, json_paths=["/v1/completions"])(scope, receive, send))
    return handed, sent


def test_a_body_cut_short_by_a_disconnect_is_never_served_even_when_the_part_sent_parses() -> None:
    # Content-Length says 100 bytes; the client sends a complete-looking JSON object of 15, then leaves.
    handed, sent = _guarded([{"type": "http.request", "body": b'{"prompt": "a"}', "more_body": True},
                             {"type": "http.disconnect"}])
    assert handed == [] and sent == []
    # the same bytes as the whole body reach the route
    handed, sent = _guarded([{"type": "http.request", "body": b'{"prompt": "a"}', "more_body": False}])
    assert handed == [b'{"prompt": "a"}'] and sent == []


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_an_empty_body_is_refused_saying_it_is_empty(server: RunningServer, route: str) -> None:
    with server.client() as http:
        response = http.post(route, content=b"", headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_json", None)
    assert error["message"] == "the request body is empty: it must be a JSON object"
