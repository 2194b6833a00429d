"""Turning engine step updates into what clients see: append-only text deltas and denoising snapshots.

A diffusion model does not write left to right one token at a time: positions of the running blocks fill in any
order and only a committed block is final. Text streamed to OpenAI clients must never be taken back, so it
follows the committed tokens only; the rest of the answer arrives when the request finishes. The ``denoise``
stream of ``/generate`` instead shows the working buffer itself, masks included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from diffulex.engine.request_update import RequestUpdate
from diffulex.strategy.request import StepRecord

logger = logging.getLogger("diffulex.server")

REPLACEMENT_CHAR = "\ufffd"


def _byte_level_table() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2 style): printable stand-in character -> byte it encodes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def _byte_level_bytes(tokenizer: Any, token_id: int) -> str | None:
    """``\\xe2\\x82``-style text for a byte-level BPE token, or None if the tokenizer is not byte-level."""
    try:
        raw = tokenizer.convert_ids_to_tokens(token_id)
    except Exception:
        return None
    if not isinstance(raw, str) or not raw or any(ch not in _BYTE_LEVEL for ch in raw):
        return None
    data = bytes(_BYTE_LEVEL[ch] for ch in raw)
    return data.decode("utf-8", errors="backslashreplace")


class TextStream:
    """Append-only text of a growing list of final token ids.

    Text is held back while it ends in what may be an incomplete UTF-8 sequence (a trailing U+FFFD) or in what
    could be the start of a stop string, since the final answer is cut before a stop string and nothing sent can
    be unsent.
    """

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.sent = ""
        self.num_tokens = 0
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        # Decoding the whole answer at every chunk costs O(answer) per chunk, O(answer^2) per request, all of it on
        # the event loop beside every other stream. So only a window is decoded: `_text` is the text of
        # token_ids[:_read], and each update decodes token_ids[_prefix:] against token_ids[_prefix:_read] (the
        # tokens read last time, decoded again so that the new ones are decoded in context: byte-level and
        # SentencePiece decoders give exactly the whole decode). A decoder that rewrites text already decoded (a
        # space clean-up) is caught inside the window and decoded whole again; one reaching further left is not,
        # and, as with whole decoding, what was sent cannot be unsent.
        self._text = ""
        self._prefix = 0
        self._read = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _text_of(self, token_ids: list[int]) -> str:
        """``decode(token_ids)`` (an incomplete character at the end as one U+FFFD) from a window decode."""
        settled = self._decode(token_ids[self._prefix : self._read]) if self._read > self._prefix else ""
        window = self._decode(token_ids[self._prefix :])
        if not window.startswith(settled):
            # a decoder that rewrites text across the window's start (a space clean-up): start over from the first
            self._text, self._prefix, self._read = "", 0, 0
            settled, window = "", self._decode(token_ids)
        text = self._text + window[len(settled) :]
        if not window.endswith(REPLACEMENT_CHAR):  # complete: the next window starts at the tokens read now
            self._text, self._prefix, self._read = text, self._read, len(token_ids)
        return text

    def update(self, token_ids: list[int]) -> str:
        """The new text that ``token_ids`` (the final tokens so far; the previous ones plus more) makes safe."""
        if len(token_ids) == self.num_tokens:
            return ""
        self.num_tokens = len(token_ids)
        text = self._text_of(token_ids)
        end = len(text)
        if end and text[-1] == REPLACEMENT_CHAR:
            # An incomplete UTF-8 sequence at the end decodes to one U+FFFD that the next token may complete.
            end -= 1
        end -= self._stop_prefix_len(text[max(end - self._longest_stop, 0) : end])
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def finish(self, final_text: str) -> str:
        """The rest of the answer once the request has finished with ``final_text``."""
        if final_text.startswith(self.sent):
            rest = final_text[len(self.sent) :]
            self.sent = final_text
            return rest
        # Cannot happen for byte-level tokenizers; if it does, the streamed text differs from the final text.
        logger.warning("streamed text is not a prefix of the final text; sending nothing more")
        return ""


@dataclass
class DenoiseView:
    """Builds ``/generate`` ``stream_mode="denoise"`` snapshots of one request's block buffer.

    Each snapshot lists the running blocks with one cell per position: its token text and a state, ``prompt``,
    ``mask`` (not decoded yet), ``new`` (filled by this step), ``decoded`` (filled earlier, block not committed)
    or ``committed`` (final). Text before the buffer is final and sent as an append-only ``stable_delta``.
    """

    tokenizer: Any
    mask_token_id: int
    block_size: int
    prompt_len: int
    max_tokens: int
    stable: TextStream = field(init=False)
    _previous: dict[int, int] = field(init=False, default_factory=dict)
    _piece_cache: dict[int, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.stable = TextStream(self.tokenizer)

    def piece(self, token_id: int) -> str:
        """The text of one token; a token that is only part of a UTF-8 character shows its bytes (``\\xe2``)."""
        text = self._piece_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if REPLACEMENT_CHAR in text:
                text = _byte_level_bytes(self.tokenizer, token_id) or text
            if len(self._piece_cache) < 65536:
                self._piece_cache[token_id] = text
        return text

    def snapshot(self, update: RequestUpdate) -> dict[str, Any]:
        record = update.record
        assert record is not None
        mask = self.mask_token_id
        start = _running_start(record, self.block_size, self.prompt_len)
        generation_end = self.prompt_len + self.max_tokens
        committed_end = self.prompt_len + len(update.committed_token_ids)
        stable_ids = update.answer_token_ids[: max(start - self.prompt_len, 0)]
        blocks = []
        current: dict[int, int] = {}
        for offset, token in enumerate(record.running_token_ids):
            pos = start + offset
            if pos >= generation_end:
                break
            block_index = record.running_block_ids[(pos - start) // self.block_size]
            if not blocks or blocks[-1]["index"] != block_index:
                blocks.append({"index": block_index, "cells": []})
            if pos < self.prompt_len:
                state, text = "prompt", self.piece(token)
            elif token == mask:
                state, text = "mask", None
            elif self._previous.get(pos, mask) == mask:
                state, text = "new", self.piece(token)  # even if this step also committed its block
            elif pos < committed_end:
                state, text = "committed", self.piece(token)
            else:
                state, text = "decoded", self.piece(token)
            current[pos] = token
            blocks[-1]["cells"].append({"id": token if token != mask else None, "text": text, "state": state})
        self._previous = current
        return {
            "event": "denoise",
            "stable_delta": self.stable.update(stable_ids),
            "token_offset": start - self.prompt_len,
            "blocks": blocks,
            "num_new_tokens": record.num_new_tokens,
        }


def _running_start(record: StepRecord, block_size: int, prompt_len: int) -> int:
    """The position of a record's first running token."""
    if record.running_start is not None:
        return record.running_start
    return record.running_block_ids[0] * block_size if record.running_block_ids else prompt_len
