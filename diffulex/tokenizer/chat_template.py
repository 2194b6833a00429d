"""Rendering a checkpoint's chat template, a Jinja program that came with the download, in a sandbox.

A chat template is untrusted code, so it runs in jinja2's immutable sandbox (no attribute starting with ``_``, no
mutation of the data it is given) and sees only plain JSON-like data. It is rendered the way transformers renders
it, so that a prompt is the same text whichever loader built the tokenizer: blocks trimmed (``trim_blocks``,
``lstrip_blocks``), ``break``/``continue`` allowed, a ``{% generation %}`` block rendered as its body, ``tojson``
without HTML escaping, and the globals ``raise_exception``, ``strftime_now``, ``namespace`` and ``dict``. The
variables are ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the tokenizer's named special
tokens (``bos_token``, ``eos_token``, ...), which keyword arguments may override (``enable_thinking``, ...).

jinja2 is imported on the first rendering, not when the tokenizer loads: an engine that never meets a conversation
never pays for it.
"""

from __future__ import annotations

import functools
import json
import secrets
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

# The oldest jinja2 whose sandbox has no known escape.
MIN_JINJA2_VERSION = (3, 1, 6)
# Names a message's reasoning may be given under; templates read the first (some the second).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@functools.cache
def _environment() -> Any:
    """The one sandboxed Jinja environment every chat template is compiled in (built on first use)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if _version_tuple(jinja2.__version__) < MIN_JINJA2_VERSION:
        raise ImportError(
            f"chat templates need jinja2>={'.'.join(map(str, MIN_JINJA2_VERSION))} (older sandboxes have known "
            f"escapes); installed: {jinja2.__version__}"
        )

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's part for training masks: here it is
        just its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses attribute names starting with ``_`` (the interpreter's internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            values = dict(*rest, **kwargs)
            for name in values:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, values)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    def make_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return dict(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=SafeNamespace,
                       dict=make_dict)  # fmt: skip
    return env


def plain_data(value: Any) -> Any:
    """`value` rebuilt from exact JSON types (str, int, float, bool, None, dict, list, tuple); anything else becomes
    a ``<TypeName>`` placeholder, so a template can reach no method of a caller's object."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    return f"<{type(value).__name__}>"


def _prepared_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain dicts without None values (a template handles a missing key, not ``None``), with a message's
    reasoning under each name templates read it by."""
    prepared = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}]={message!r} is invalid: must be a mapping with 'role' and 'content'")
        plain = {k: v for k, v in plain_data(message).items() if v is not None}
        reasoning = next((plain[k] for k in REASONING_FIELDS if k in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        prepared.append(plain)
    return prepared


class ChatTemplate:
    """One chat template's source and, once first rendered, its compiled form (compiled once, thread-safe)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._compiled: Any = None
        self._lock = threading.Lock()

    def _template(self) -> Any:
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = _environment().from_string(self.source)
        return self._compiled

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        documents: Sequence[Mapping[str, Any]] | None,
        variables: Mapping[str, Any],
    ) -> str:
        """The conversation as the template writes it. With `continue_final_message` the text ends where the last
        message's content ends (the model continues that message instead of starting a new one)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        chat = _prepared_messages(messages)
        for name, items in (("tools", tools), ("documents", documents)):
            for i, item in enumerate(items or ()):
                if not isinstance(item, Mapping):
                    raise ValueError(f"{name}[{i}] is invalid: must be a JSON-schema-like mapping, not {type(item)}")
        marker = final = None
        if continue_final_message:
            if not chat or not isinstance(chat[-1].get("content"), str):
                raise ValueError("continue_final_message needs a final message with text content")
            final = chat[-1]["content"]
            marker = f"DIFFULEXCONTINUE{secrets.token_hex(6)} "
            chat[-1] = {**chat[-1], "content": final + marker}
        reserved = {"messages", "tools", "documents", "add_generation_prompt"} & set(variables)
        if reserved:
            raise ValueError(f"template variables {sorted(reserved)} are set by the renderer, not by keyword")
        rendered = self._template().render(
            **plain_data(dict(variables)),
            messages=chat,
            tools=plain_data(list(tools)) if tools is not None else None,
            documents=plain_data(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
        )
        if marker is None:
            return rendered
        cut = rendered.rfind(marker.strip())
        if cut < 0 or final is None or final.strip() not in rendered:
            raise ValueError("continue_final_message: the chat template does not copy the final message's content")
        # A template that trims message content also trimmed the marker's space: trim what precedes it the same way.
        return rendered[:cut] if rendered.startswith(marker, cut) else rendered[:cut].rstrip()
