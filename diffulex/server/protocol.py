"""Request and response shapes of the HTTP API, and the OpenAI-style error body.

Request models are strict (a string where a number belongs is a 400, not silently converted) and ignore unknown
fields, because OpenAI clients send fields that have no meaning here. Fields that would change the result but are
not supported (``logprobs``, ``tools``, penalties, ...) are declared so that a non-default value is refused
clearly instead of ignored.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from diffulex.sampling_params import SamplingParams

# Engine completion reasons -> OpenAI finish_reason. The engine's own name travels in `diffulex_completion_reason`.
FINISH_REASONS = {
    "eos_token_generated": "stop",
    "stop_string_matched": "stop",
    "max_new_tokens_reached": "length",
    "max_model_len_reached": "length",
    "max_nfe_reached": "length",
    "max_repetition_run_reached": "length",
    "aborted": "abort",
}

# Most completions one HTTP request may ask for (prompts x n): one request must not be able to fill the queue.
MAX_CHOICES_PER_REQUEST = 16
# Stop strings are searched on the engine thread after every step, so their number and length are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
SHOWN_CHARS = 40  # how much of a client's value an error message quotes
# Seeds are in [0, SEED_SPAN - 1] (what SamplingParams accepts); the per-choice seeds of n > 1 wrap around in it.
SEED_SPAN = 2**63


def openai_finish_reason(completion_reason: str | None) -> str:
    return FINISH_REASONS.get(completion_reason or "", "stop")


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002  (the OpenAI field name)
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:  # noqa: A002
    """The error object; its text is escaped, since a message may quote what a client sent."""
    return {"error": {"message": escaped(message, limit=None), "type": type,
                      "param": None if param is None else escaped(param), "code": code}}


def escaped(text: str, limit: int | None = SHOWN_CHARS) -> str:
    """``text`` safe to put in any response: unencodable characters as ``\\udXXX`` escapes, optionally shortened."""
    shown = text if limit is None or len(text) <= limit else text[:limit] + "..."
    return shown.encode("utf-8", "backslashreplace").decode("utf-8")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """The sampling fields every generation route accepts (OpenAI names, plus the Diffulex extras)."""

    # Clients send ``null`` for "the default" (OpenAI allows it), so every field accepts None.
    max_tokens: int | None = None
    temperature: float | None = None  # 1.0, as OpenAI
    top_p: float | None = None  # 1.0
    top_k: int | None = None  # 0 = off
    stop: str | list[str] | None = None
    n: int | None = None  # 1
    seed: int | None = None
    # Diffulex extras.
    max_nfe: int | None = None
    ignore_eos: bool | None = None
    max_repetition_run: int | None = None
    # Special-token text in the prompt or messages (``<|im_end|>``) is plain text unless this asks otherwise.
    parse_special_tokens: bool | None = None
    # Declared only to be refused when set: they would change the answer and are not implemented.
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def answer_length(self) -> tuple[str, int | None]:
        """The field that limits the answer's length, named as the client sent it, and its value (None: unset)."""
        return "max_tokens", self.max_tokens

    def as_sent(self, message: str) -> tuple[str, str | None]:
        """An engine error message and the field it is about, in the client's words: the engine knows the answer
        length only as ``max_tokens``, while a chat client may have set it as ``max_completion_tokens``."""
        param = param_of(message)
        name = self.answer_length()[0]
        if param == "max_tokens" and name != "max_tokens":
            return re.sub(r"\bmax_tokens\b", name, message), name
        return message, param

    def choice_seed(self, choice: int) -> int | None:
        """The seed of choice ``choice``: ``seed + choice``, so that the choices differ yet stay reproducible,
        wrapped modulo 2**63 so that every valid seed works with any ``n`` (choice 0 always uses ``seed`` itself).
        A seed outside the valid range is passed on as it is, for SamplingParams to refuse naming it."""
        if self.seed is None or not 0 <= self.seed < SEED_SPAN:
            return self.seed
        return (self.seed + choice) % SEED_SPAN

    def reject_unsupported(self) -> None:
        """Fields accepted by OpenAI that we cannot honour: a clear 400 instead of a silently different answer."""
        checks = [
            ("logprobs", self.logprobs not in (None, False, 0)),
            ("top_logprobs", self.top_logprobs not in (None, 0)),
            ("presence_penalty", self.presence_penalty not in (None, 0.0)),
            ("frequency_penalty", self.frequency_penalty not in (None, 0.0)),
            ("logit_bias", bool(self.logit_bias)),
            ("best_of", self.best_of not in (None, 1)),
            ("echo", bool(self.echo)),
            ("suffix", self.suffix is not None),
            ("tools", bool(self.tools)),
            ("response_format", self.response_format not in (None, {"type": "text"})),
        ]
        for name, bad in checks:
            if bad:
                raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        # the OpenAI routes' stream_options shape a stream; on an answer sent whole they would be ignored, as OpenAI
        # and vLLM refuse them
        if getattr(self, "stream_options", None) is not None and not getattr(self, "stream", None):
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")

    def _check_stop_size(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop has {len(stops)} strings: at most {MAX_STOP_STRINGS} are allowed", param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise APIError(400, f"stop has a string of {longest} characters: at most {MAX_STOP_CHARS} are allowed",
                           param="stop")

    def sampling_params(self, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """Validated engine parameters for one choice; a ValueError from SamplingParams becomes a 400 naming the field.

        With ``n > 1`` and a seed, choice ``i`` uses `choice_seed` (``seed + i`` modulo 2**63).
        """
        self.reject_unsupported()
        self._check_stop_size()
        if self.num_choices < 1:
            raise APIError(400, f"n={self.n} is invalid: must be an integer >= 1", param="n")
        max_tokens = self.answer_length()[1]
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                max_nfe=self.max_nfe,
                ignore_eos=bool(self.ignore_eos),
                max_repetition_run=self.max_repetition_run,
                seed=self.choice_seed(choice),
                stop=self.stop,
            )
        except ValueError as err:
            message, param = self.as_sent(str(err))
            raise APIError(400, message, param=param) from None


def param_of(message: str) -> str | None:
    """The field an engine message is about: they start with ``field=value`` or ``prompt ...``."""
    if message.startswith("prompt"):
        return "prompt"
    if "KV pages" in message:  # the one request-size refusal the engine makes: the answer budget is too large
        return "max_tokens"
    head = message.split("=", 1)[0].strip()
    return head if head.isidentifier() else None


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    model_config = ConfigDict(strict=True, extra="allow")

    def text(self) -> str:
        """The message text; OpenAI's list-of-parts form is accepted when every part is text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    def answer_length(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            return "max_completion_tokens", self.max_completion_tokens
        return super().answer_length()


class GenerateRequest(SamplingFields):
    """The Diffulex-native route: a raw prompt (or chat messages), with block-level streaming modes."""

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    stream: bool | None = None
    stream_mode: Literal["denoise", "block_append"] | None = None  # None: denoise
    user: str | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "diffulex"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)
