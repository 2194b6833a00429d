"""The request body at the edge: a size limit enforced before anything is parsed, and JSON the engine can use.

Python's ``json`` accepts things a generation request must never carry: ``NaN``/``Infinity`` (and ``1e400``,
which becomes infinity), integers of thousands of digits, and ``\\ud800``-style escapes that decode to lone
surrogates, text no encoder can write back out. `BodyGuard` reads each body once, refuses a body over the limit
with 413 (from ``Content-Length`` alone when the client declares it), and refuses such values with a 400 that
names the field, so that no handler, tokenizer or error message ever meets them.

A JSON route also needs ``Content-Type: application/json``, as vLLM's OpenAI server does: without it the body
would reach the route as raw bytes (``curl -d`` sends form-urlencoded), and the client would get an error about a
Python bytes value instead of one about its header.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from diffulex.server.protocol import APIError, escaped

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# An integer literal longer than this cannot be within the 64-bit range: it is kept as text, never converted.
MAX_INT_DIGITS = len(str(INT64_MIN))


@dataclass(frozen=True)
class _OversizedInt:
    """An integer literal too long to convert: what the client wrote, reported instead of parsed."""

    literal: str


def _parse_int(literal: str) -> int | _OversizedInt:
    if len(literal) > MAX_INT_DIGITS:
        return _OversizedInt(literal)
    return int(literal)


def _walk(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every leaf and every object key of a parsed JSON value, with its path (``messages[0].content``)."""
    if isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            yield child, key
            yield from _walk(item, child)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _walk(item, f"{path}[{index}]")
    else:
        yield path, value


def _top_field(path: str) -> str | None:
    head = path.split(".", 1)[0].split("[", 1)[0]
    return escaped(head) if head else None


def check_values(document: Any) -> None:
    """Raise a 400 naming the field of the first value no request may carry (see the module docstring)."""
    for path, value in _walk(document, ""):
        where = escaped(path or "body")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(
                    400, f"{where} is invalid: it contains a lone surrogate ({escaped(value)}); text must be valid "
                    "Unicode (a \\ud800-\\udfff escape is allowed only as half of a surrogate pair)",
                    param=_top_field(path), code="invalid_value",
                ) from None
        elif isinstance(value, _OversizedInt):
            digits = value.literal.lstrip("-")
            raise APIError(
                400, f"{where}={escaped(value.literal, 20)} ({len(digits)} digits) is out of range: integers must be "
                f"within [{INT64_MIN}, {INT64_MAX}]", param=_top_field(path), code="invalid_value",
            )
        elif isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            raise APIError(400, f"{where}={value} is out of range: integers must be within [{INT64_MIN}, {INT64_MAX}]",
                           param=_top_field(path), code="invalid_value")
        elif isinstance(value, float) and not math.isfinite(value):
            raise APIError(400, f"{where}={value} is invalid: numbers must be finite (NaN, Infinity and values "
                           "beyond the float range such as 1e400 are refused)", param=_top_field(path),
                           code="invalid_value")


def parse_json_body(body: bytes) -> Any:
    """The parsed body, or a 400: not UTF-8, not JSON, or carrying a value `check_values` refuses."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the body is not valid UTF-8 (byte {err.start}: {body[err.start:err.start + 1]!r})",
                       code="invalid_json") from None
    try:
        document = json.loads(text, parse_int=_parse_int)
    except (json.JSONDecodeError, RecursionError) as err:
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply"
        where = f" at line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else ""
        raise APIError(400, f"malformed JSON body: {reason}{where}", code="invalid_json") from None
    check_values(document)
    return document


class BodyGuard:
    """ASGI middleware: the body-size limit (413) on every route, then strict JSON checks on ``json_paths``.

    The body is read here once, bounded, and replayed to the application; after the replay, ``receive`` is the
    client's again so that disconnects are still seen.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        json_paths: Collection[str],
        on_reject: Callable[[int], None] | None = None,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes} is invalid: must be an integer >= 1")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.json_paths = frozenset(json_paths)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        json_route = scope["path"] in self.json_paths
        try:
            if json_route and scope["method"] == "POST":
                _check_json_content_type(scope)
            declared = _content_length(scope)
            if declared is not None and declared > self.max_body_bytes:
                raise self._too_large(f"{declared} bytes")
            body = await self._read(receive)
            if body is None:  # the client left before its body ended: nothing to serve, no one to answer
                return
            if json_route and scope["method"] == "POST":
                if not body:
                    raise APIError(400, "the request body is empty: it must be a JSON object",
                                   code="invalid_json")
                parse_json_body(body)
        except APIError as err:
            if self.on_reject is not None:
                self.on_reject(err.status)
            # The unread rest of an oversized body is not drained: the server closes the connection after this.
            await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"the request body ({size}) is over this server's limit of {self.max_body_bytes} bytes "
                        "(--max-body-bytes)", code="body_too_large")

    async def _read(self, receive: Receive) -> bytes | None:
        """The whole body, or None if the client disconnected before sending all of it: a body cut short (its
        ``Content-Length`` not reached, its chunks not ended) may still parse, and must not be served as if whole."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large(f"more than {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


# The charset values of a JSON Content-Type that say what JSON is anyway (RFC 8259: UTF-8).
JSON_CHARSETS = ("utf-8", "utf8")


def _check_json_content_type(scope: Scope) -> None:
    """A 400 unless the request says its body is JSON (``application/json``, parameters such as charset allowed)."""
    value = _header(scope, b"content-type")
    if value is None:
        raise APIError(400, "the request has no Content-Type header: the body must be JSON, sent with "
                       "Content-Type: application/json", code="unsupported_media_type")
    text = value.decode("latin-1")
    media_type, *parameters = text.split(";")
    if media_type.strip().lower() != "application/json":
        raise APIError(400, f"Content-Type {escaped(text)!r} is not supported: the body must be JSON, sent with "
                       "Content-Type: application/json", code="unsupported_media_type")
    for parameter in parameters:
        name, _, charset = parameter.partition("=")
        charset = charset.strip().strip('"')
        if name.strip().lower() == "charset" and charset.lower() not in JSON_CHARSETS:
            # RFC 8259: JSON exchanged between systems is UTF-8; a body in another encoding would be read wrongly
            raise APIError(400, f"Content-Type {escaped(text)!r} is not supported: a JSON body is UTF-8 (charset="
                           f"{escaped(charset)!r} given); send it as UTF-8, with Content-Type: application/json",
                           code="unsupported_media_type")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                raise APIError(400, f"the Content-Length header {escaped(value.decode('latin-1'))!r} is not a "
                               "number", code="invalid_header") from None
    return None


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
