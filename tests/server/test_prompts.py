"""Prompts are measured before they are tokenized, tokenized off the engine thread, and refused with a 400 naming
``prompt``; a huge prompt is refused at once while other requests keep being served."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

from diffulex.prompts import NORMALIZATION_SLACK
from diffulex.server.prompts import PromptEncoder
from diffulex.server.protocol import APIError, ChatMessage

from .conftest import MODEL_NAME, RunningServer


class RecordingTokenizer:
    """One character per token; remembers which thread tokenized what."""

    def __init__(self, longest_token: int = 3) -> None:
        self.vocab = {"a" * k: k for k in range(1, longest_token + 1)}
        self.calls: list[tuple[str, int]] = []

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = False, **_: Any) -> list[int]:
        self.calls.append((threading.current_thread().name, len(text)))
        return [1] * len(text)


def refusal(coro: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        asyncio.run(coro)
    return caught.value


def test_the_length_bound_follows_the_longest_token_and_max_model_len() -> None:
    encoder = PromptEncoder(RecordingTokenizer(longest_token=3), max_model_len=10, vocab_limit=50)
    assert encoder.max_prompt_chars == NORMALIZATION_SLACK * 3 * 10
    encoder.close()


def test_a_text_over_the_bound_is_refused_without_being_tokenized() -> None:
    tokenizer = RecordingTokenizer()
    encoder = PromptEncoder(tokenizer, max_model_len=10, vocab_limit=50)
    err = refusal(encoder.encode("a" * (encoder.max_prompt_chars + 1)))
    assert (err.status, err.param, err.code) == (400, "prompt", "prompt_too_long")
    assert tokenizer.calls == []
    encoder.close()


def test_text_is_tokenized_on_a_worker_thread_never_the_caller() -> None:
    tokenizer = RecordingTokenizer()
    encoder = PromptEncoder(tokenizer, max_model_len=10, vocab_limit=50)
    assert asyncio.run(encoder.encode("abc")) == [1, 1, 1]
    (thread, _), = tokenizer.calls
    assert thread.startswith("diffulex-tokenize") and thread != threading.current_thread().name
    encoder.close()


@pytest.mark.parametrize(("prompt", "message"), [
    ("", "prompt=''"),
    ([], "zero tokens"),
    ([1, 50], "token id 50"),
    ([-1], "token id -1"),
    ([1] * 10, "10 tokens"),
    ("a" * 10, "10 tokens"),
])
def test_bad_prompts_are_refused_naming_the_prompt(prompt: Any, message: str) -> None:
    encoder = PromptEncoder(RecordingTokenizer(), max_model_len=10, vocab_limit=50)
    err = refusal(encoder.encode(prompt))
    assert (err.status, err.param) == (400, "prompt") and message in err.message
    encoder.close()


def test_a_conversation_over_the_bound_is_refused_before_rendering() -> None:
    encoder = PromptEncoder(RecordingTokenizer(), max_model_len=10, vocab_limit=50)
    messages = [ChatMessage(role="user", content="a" * encoder.max_prompt_chars)]
    err = refusal(encoder.render_chat(messages))
    assert (err.status, err.param) == (400, "messages")
    rendered = asyncio.run(encoder.render_chat([ChatMessage(role="user", content="hi")]))
    assert rendered == [1] * len("user: hi\nassistant:")
    encoder.close()


def test_a_huge_prompt_is_refused_quickly_while_another_request_is_served(server: RunningServer) -> None:
    """3.5 MB of prompt (under the body limit): refused from its length alone, and a running stream never stalls."""
    huge = json.dumps({"model": MODEL_NAME, "prompt": "lighthouse keeper " * 200_000, "max_tokens": 4})
    gaps: list[float] = []
    streaming_done = threading.Event()

    def stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "The baker", "max_tokens": 480, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with server.client() as http, http.stream("POST", "/generate", json={**body, "stream_mode": "denoise"}) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
        streaming_done.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    try:
        while not gaps:
            time.sleep(0.01)
        refusals = []
        for _ in range(3):
            started = time.monotonic()
            response = httpx.post(server.base_url + "/v1/completions", content=huge,
                                  headers={"content-type": "application/json"}, timeout=30)
            refusals.append(time.monotonic() - started)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "prompt"
            assert not streaming_done.is_set(), "the stream should still be running while the huge prompts arrive"
    finally:
        streamer.join(60)
    assert max(refusals) < 2.0, refusals
    assert len(gaps) > 50 and max(gaps[1:]) < 1.0, max(gaps[1:])
