"""A stream's text chunk rendered from its template is the event the whole chunk encodes to."""

from __future__ import annotations

import json
import random

import pytest

from diffulex.server.sse import TEXT_SLOT, EventTemplate, sse


def completion_chunk(text: str) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m\u00e9",
            "choices": [{"index": 3, "text": text, "logprobs": None, "finish_reason": None}]}


def chat_chunk(text: str) -> dict:
    return {"id": "chat-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}


TEXTS = ["", " plain", 'quote " and \\ backslash', "line\nbreak\ttab\r", "\u00e9\u4e2d\U0001f600", "\u2028\u2029",
         "\x00\x01\x1f", "{\"text\":\"x\"}", "</script>", TEXT_SLOT[1:-1], "\ufffd"]


@pytest.mark.parametrize("payload", [completion_chunk, chat_chunk])
def test_a_rendered_chunk_is_the_event_of_the_whole_chunk(payload):
    template = EventTemplate(payload(TEXT_SLOT))
    draw = random.Random(0)
    alphabet = "ab \"\\\n\u00e9\u4e2d\U0001f600\x07/"
    texts = TEXTS + ["".join(draw.choice(alphabet) for _ in range(draw.randrange(30))) for _ in range(200)]
    for text in texts:
        rendered = template.render(text)
        assert rendered == sse(payload(text))
        assert json.loads(rendered.removeprefix("data: ")) == payload(text)


def test_a_template_needs_the_slot_exactly_once():
    with pytest.raises(ValueError, match="TEXT_SLOT exactly once"):
        EventTemplate(completion_chunk("no slot"))
    with pytest.raises(ValueError, match="TEXT_SLOT exactly once"):
        EventTemplate({"a": TEXT_SLOT, "b": TEXT_SLOT})
