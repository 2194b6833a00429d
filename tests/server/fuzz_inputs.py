"""Seeded generators of hostile HTTP requests for the fuzz and soak tests, each with what the server must answer.

A case says how the server may answer: ``bad`` (a 4xx; ``param`` names the field when the fault is one field's)
or ``maybe`` (a value at the edge of a field's range: 200, or a 400 naming the field). Nothing may ever get a 5xx.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

MODEL_NAME = "tiny-sdar"
BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "The baker", "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                             "temperature": 0},
    "/generate": {"prompt": "The baker", "max_tokens": 4, "temperature": 0},
}
INT_FIELDS = ("max_tokens", "top_k", "n", "seed", "max_nfe", "max_repetition_run", "top_logprobs", "best_of")
FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
BOOL_FIELDS = ("ignore_eos", "echo", "stream")
TEXT_FIELDS = ("model", "user", "suffix", "stop", "prompt")
# Raw JSON literals: Python's json reads NaN/Infinity, and 1e400 overflows to infinity.
EXTREME_NUMBERS = ("1e-40", "1e-320", "1e308", "-1e308", "1e400", "Infinity", "-Infinity", "NaN", "-1", "0",
                   "1e30", str(10**30), str(-(10**30)), str(2**63), str(2**64 + 1), "9" * 500, "0.5", "-0.0")
WRONG_TYPES: dict[str, tuple[str, ...]] = {
    "int": ('"ten"', "[1]", '{"a": 1}', "true", "1.5", '""'),
    "float": ('"hot"', "[0.5]", "{}", "true", '"1e-40"'),
    "bool": ('"yes"', "1", "0", "[]", "{}", '"true"'),
    "text": ("42", "{}", "true", "[1.5]", "[[1, 2], \"a\"]", '{"text": "x"}'),
}
UNICODE_JUNK = ("\ud800", "a\udfffb", "\ud83d", "\x00\x01\x1f", "\u202eRTL\u202c", "e\u0301\u0301\u0301",
                "\U0001f600" * 50, "\u2028\u2029", "\ufeff\ufffe", "<|im_end|>", "\\u0000", "\U0010ffff")
MALFORMED = ("", " ", "{", "{\"prompt\": }", "{'prompt': 'x'}", "[1, 2", "\"abc", "{\"a\": 1,}", "nul", "{}}", ",",
             "{\"prompt\": \"x\" \"max_tokens\": 4}", "\x00", "{\"prompt\": \"\\x\"}")
# Stop values: text the stream must hold back or cut on, and values of the wrong shape or size (at most 16
# strings of at most 256 characters).
STOP_VALUES: tuple[Any, ...] = (
    "s", ["s", "\t"], "\x00", " ", "\ufffd", "<|im_end|>", "\U0001f600", "e\u0301", ["a"] * 16, ["a"] * 17,
    "x" * 256, "x" * 257, [""], "", [], ["ok", ""], [["a"]], ["a", 1], [None], {"a": "b"}, 7, True,
    ["\u202e", "\u2028"], ["a" * 256] * 16,
)
N_VALUES = (0, -1, 1, 2, 3, 8, 16, 17, 2**31, 2**63 - 1)
NOT_OBJECTS = ("[]", "42", "\"prompt\"", "null", "true", "[{\"prompt\": \"x\"}]")


@dataclass
class Case:
    method: str
    route: str
    body: bytes | None
    expect: str  # "bad" or "maybe"
    param: str | None = None
    what: str = ""

    def describe(self) -> str:
        shown = (self.body or b"")[:120]
        return f"{self.what}: {self.method} {self.route} {shown!r}"


def _with_field(route: str, field: str, raw_value: str) -> bytes:
    """The route's valid base body with ``field`` set to a raw JSON literal (which json.dumps cannot write)."""
    base = {k: v for k, v in BASES[route].items() if k != field}
    text = json.dumps(base)
    return (text[:-1] + f', "{field}": {raw_value}}}').encode()


def _fields_of(route: str) -> list[str]:
    fields = list(INT_FIELDS + FLOAT_FIELDS + BOOL_FIELDS + TEXT_FIELDS)
    if route == "/v1/chat/completions":
        fields.remove("prompt")
        fields += ["messages", "max_completion_tokens"]
    if route == "/generate":  # the native route has no model field: a model sent there is ignored
        fields.remove("model")
        fields += ["stream_mode", "messages"]
    return fields


def _kind(field: str) -> str:
    if field in INT_FIELDS or field == "max_completion_tokens":
        return "int"
    if field in FLOAT_FIELDS:
        return "float"
    if field in BOOL_FIELDS:
        return "bool"
    return "text"


def wrong_type_case(rng: random.Random, route: str) -> Case:
    field = rng.choice([f for f in _fields_of(route) if f not in ("messages", "stream_mode")])
    raw = rng.choice(WRONG_TYPES[_kind(field)])
    if field == "prompt" and raw.startswith("[[1, 2]"):
        raw = '[[1, 2], 3]'
    return Case("POST", route, _with_field(route, field, raw), "bad", field, "wrong type")


def extreme_number_case(rng: random.Random, route: str) -> Case:
    field = rng.choice([f for f in _fields_of(route) if _kind(f) in ("int", "float")])
    return Case("POST", route, _with_field(route, field, rng.choice(EXTREME_NUMBERS)), "maybe", field, "extreme number")


def unicode_case(rng: random.Random, route: str) -> Case:
    junk = "".join(rng.choice(UNICODE_JUNK) for _ in range(rng.randint(1, 3)))
    raw = json.dumps(junk)  # ASCII with \u escapes, lone surrogates included
    if route == "/v1/chat/completions" or (route == "/generate" and rng.random() < 0.3):
        where = rng.choice(["content", "role", "stop", "user", "model"])
        if where in ("content", "role"):
            message = {"role": "user", "content": "hi"}
            base = {k: v for k, v in BASES["/v1/chat/completions"].items() if k not in ("messages", "model")}
            text = json.dumps({**base, "messages": [message]})
            text = text.replace(f'"{where}": "{message[where]}"', f'"{where}": {raw}')
            return Case("POST", route, text.encode(), "maybe", "messages", "unicode junk")
        return Case("POST", route, _with_field(route, where, raw), "maybe", where, "unicode junk")
    field = rng.choice(["prompt", "stop", "user", "model"])
    return Case("POST", route, _with_field(route, field, raw), "maybe", field, "unicode junk")


def stop_case(rng: random.Random, route: str) -> Case:
    """A stop value (streamed or not): served, or refused naming ``stop``."""
    body = {**BASES[route], "stop": rng.choice(STOP_VALUES), "stream": rng.random() < 0.5}
    return Case("POST", route, json.dumps(body).encode(), "maybe", "stop", "stop value")


def choices_case(rng: random.Random, route: str) -> Case:
    """Several choices (``n``, and lists of prompts on /v1/completions): at most 16 completions per request, and
    /generate answers one; a refusal names ``n``, or ``prompt`` when only the prompts are too many."""
    n = rng.choice(N_VALUES)
    body = {**BASES[route], "n": n, "stream": rng.random() < 0.5}
    prompts = 1
    if route == "/v1/completions" and rng.random() < 0.5:
        prompts = rng.choice([1, 2, 5, 16, 17])
        body["prompt"] = [f"The baker {k}" for k in range(prompts)]
    if (route == "/generate" and n != 1) or n < 1 or prompts * n > 16:
        param = "n" if n != 1 else "prompt"
        return Case("POST", route, json.dumps(body).encode(), "bad", param, "too many or too few choices")
    return Case("POST", route, json.dumps(body).encode(), "maybe", "n", "several choices")


def malformed_case(rng: random.Random, route: str) -> Case:
    choice = rng.random()
    if choice < 0.4:
        body = rng.choice(MALFORMED).encode()
    elif choice < 0.7:
        text = json.dumps(BASES[route]).encode()
        body = text[: rng.randint(1, len(text) - 1)]
    elif choice < 0.85:
        body = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    else:
        return Case("POST", route, rng.choice(NOT_OBJECTS).encode(), "bad", None, "not an object")
    return Case("POST", route, body, "bad", None, "malformed JSON")


def oversized_case(rng: random.Random, route: str, limit: int) -> Case:
    padding = "x" * (limit + rng.randint(1, 4096))
    body = json.dumps({**BASES[route], "user": padding}).encode()
    return Case("POST", route, body, "bad", None, "oversized body")


def other_route_case(rng: random.Random) -> Case:
    method, route = rng.choice([
        ("POST", "/health"), ("POST", "/v1/models"), ("POST", "/metrics"), ("GET", "/v1/completions"),
        ("DELETE", "/generate"), ("GET", "/v2/nothing"), ("POST", "/v1/completions/extra"), ("PUT", "/"),
        ("GET", "/page-config"), ("GET", "/health"), ("GET", "/v1/models"),
    ])
    body = rng.choice([None, b"{", b'{"prompt": "\\ud800"}', b"[]"])
    expect = "maybe" if method == "GET" and route in ("/health", "/v1/models", "/page-config") else "bad"
    return Case(method, route, body if method != "GET" else None, expect, None, "other route")


def random_cases(seed: int, count: int, body_limit: int) -> list[Case]:
    """``count`` hostile requests over every route, the same ones for the same seed."""
    rng = random.Random(seed)
    makers = [wrong_type_case, extreme_number_case, unicode_case, malformed_case, stop_case, choices_case]
    cases = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.05:
            cases.append(other_route_case(rng))
            continue
        route = rng.choice(list(BASES))
        if roll < 0.08:
            cases.append(oversized_case(rng, route, body_limit))
        else:
            cases.append(rng.choice(makers)(rng, route))
    return cases
