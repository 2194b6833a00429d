"""Server-sent events as the streams write them: one ``data: <json>`` per event, compact JSON, text as UTF-8.

The chunks of one stream differ only in their text: id, object, creation time, model and choice index repeat in
every one. At 64-128 streams the event loop writes a chunk per stream at each commit, on the one thread that also
hands the engine's updates to every stream, so a stream's text chunk is rendered from a template made once (its
JSON around a slot) and only the new text is encoded per chunk. The result is the text the whole chunk would
encode to.
"""

from __future__ import annotations

import json
from typing import Any

# What a template's caller puts where the text goes: a string no chunk carries (JSON writes it escaped).
TEXT_SLOT = "\x00diffulex-text-slot\x00"


def dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse(payload: dict[str, Any] | str) -> str:
    """One event: a payload encoded as JSON, or a string (``[DONE]``) as it is."""
    data = payload if isinstance(payload, str) else dumps(payload)
    return f"data: {data}\n\n"


class EventTemplate:
    """The event of a payload with `TEXT_SLOT` in the place of one string: `render` puts a text there."""

    def __init__(self, payload: dict[str, Any]) -> None:
        encoded, slot = sse(payload), dumps(TEXT_SLOT)
        if encoded.count(slot) != 1:
            raise ValueError(f"an event template needs TEXT_SLOT exactly once in its payload, got {payload!r}")
        self._head, self._tail = encoded.split(slot)

    def render(self, text: str) -> str:
        return self._head + dumps(text) + self._tail
