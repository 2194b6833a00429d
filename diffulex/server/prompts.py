"""Prompts to token ids in the request handler, off the engine thread and bounded before any work is done.

The engine thread is shared by every request, so nothing that grows with one client's input may run there: chat
rendering and tokenization run on a small worker pool, and the engine receives token ids. Before a text is
tokenized at all it is measured against the longest prompt the model accepts (`diffulex.prompts.max_prompt_chars`),
here before it is even handed to the pool, and a conversation again once the chat template has rendered it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from typing import Any

from diffulex.prompts import check_prompt_chars, encode_prompt, max_prompt_chars
from diffulex.server.protocol import APIError, ChatMessage

TOKENIZER_WORKERS = 2


class PromptEncoder:
    """Renders chat messages and tokenizes prompts for the handlers; every refusal is a 400 naming ``prompt``."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_limit: int, mask_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.mask_token_id = mask_token_id
        self.max_model_len = max_model_len
        self.vocab_limit = vocab_limit
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)
        self._workers = concurrent.futures.ThreadPoolExecutor(TOKENIZER_WORKERS, thread_name_prefix="diffulex-tokenize")

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    def _check_chars(self, num_chars: int, param: str) -> None:
        try:
            check_prompt_chars(self.tokenizer, num_chars, self.max_model_len, param)
        except ValueError as err:
            raise APIError(400, str(err), param=param, code="prompt_too_long") from None

    async def render_chat(self, messages: list[ChatMessage], parse_special_tokens: bool = False) -> list[int]:
        """The conversation's token ids (`encode_prompt`: only the chat template's markup is special tokens, unless
        the request asks for special-token text in its messages to be parsed)."""
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        plain = [{"role": m.role, "content": m.text()} for m in messages]
        self._check_chars(sum(len(m["role"]) + len(m["content"]) for m in plain), "messages")
        return await self._off_loop(self._encode, plain, "messages", parse_special_tokens)

    def _encode(self, prompt: Any, param: str, parse_special_tokens: bool = False) -> list[int]:
        try:
            return encode_prompt(
                self.tokenizer, prompt, mask_token_id=self.mask_token_id, vocab_size=self.vocab_limit,
                parse_special_tokens=parse_special_tokens, max_model_len=self.max_model_len,
            )  # fmt: skip
        except ValueError as err:
            raise APIError(400, str(err), param=param) from None

    async def encode(
        self, prompt: str | Sequence[int], param: str = "prompt", parse_special_tokens: bool = False
    ) -> list[int]:
        """Token ids the engine will accept as they are: in the vocabulary, shorter than ``max_model_len``."""
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, f"{param}='' is invalid: must be a non-empty string or list of token ids",
                               param=param)
            self._check_chars(len(prompt), param)
            ids = await self._off_loop(self._encode, prompt, param, parse_special_tokens)
        else:
            ids = self._encode(prompt, param)
        if not ids:
            raise APIError(400, f"{param} is invalid: it encodes to zero tokens", param=param)
        if len(ids) >= self.max_model_len:
            raise APIError(
                400, f"{param} of {len(ids)} tokens is too long: must be shorter than max_model_len="
                f"{self.max_model_len} so that at least one token can be generated", param=param,
                code="prompt_too_long",
            )
        return ids
