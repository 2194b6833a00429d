"""Prompts to token ids: the one place where text, chat conversations and token-id lists become what the engine runs.

Special tokens are the model's control signals: ``<|im_end|>`` ends a turn, the mask token marks a position still to
be decoded. Text typed by a user must never produce them, or one message could close its own turn and write the
next one, or plant masks that the engine would then "decode" inside the prompt. So text is encoded with special-token
parsing off (``<|im_end|>`` typed in a message becomes the tokens of the characters ``<``, ``|``, ``im``, ...), and
only the chat template's own markup is encoded as special tokens. A caller that really means to send special
tokens inside text (a prompt it rendered itself, benchmark contexts) opts in with ``parse_special_tokens=True``.
A token-id list is the caller's own tokenization and is taken as it is, except for the mask id, which no prompt may
hold.

Conversations are rendered with the tokenizer's chat template twice: once with the messages as given, once with
each message's content replaced by a unique placeholder. When the two agree (the template copies content verbatim),
the placeholder rendering says exactly which characters are template markup and which are content, and the markup's
special tokens are the only ones encoded. The tokenizer splits text at special tokens before anything else, so the
pieces between them are encoded exactly as a whole-string encoding would encode them.

Given ``max_model_len``, a text is measured before it is tokenized (a prompt, and a conversation once rendered: a
checkpoint's chat template may write far more than the messages hold): no token covers more characters than the
longest vocabulary entry, so a text longer than ``max_model_len`` such entries cannot fit whatever it holds, and
refusing it costs nothing where tokenizing it would cost about a second per megabyte. The bound is loosened by
`NORMALIZATION_SLACK` because a tokenizer's normalizer may shorten text before splitting it (NFC composes up to
three code points into one).

`encode_prompt` may be called from any thread: nothing here changes the tokenizer it is given (the text-only
encoder is a separate copy of the tokenizer's backend, built once per tokenizer).
"""

from __future__ import annotations

import operator
import re
import secrets
import threading
import weakref
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Message = Mapping[str, Any]
Prompt = str | Sequence[int] | Sequence[Message]

# How much of a prompt an error message quotes.
PREVIEW_CHARS = 60
# Characters a tokenizer's normalizer may fold into one before splitting (see the module docstring).
NORMALIZATION_SLACK = 4
# The conversation format for tokenizers without a chat template (what the server has always used).
PLAIN_TURN = "{role}: {content}\n"
PLAIN_GENERATION_PROMPT = "assistant:"


def is_conversation(prompt: object) -> bool:
    """A list of chat messages (mappings with ``role`` and ``content``), as opposed to text or token ids."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (str, bytes))
        and len(prompt) > 0
        and all(isinstance(m, Mapping) for m in prompt)
    )


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer is a chat model's: it carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def preview(prompt: object) -> str:
    """A short repr of a prompt for error messages (without building the repr of a huge one)."""
    if isinstance(prompt, (str, bytes, list, tuple)) and len(prompt) > PREVIEW_CHARS:
        prompt = prompt[:PREVIEW_CHARS]
    text = repr(prompt)
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "..."


@dataclass(frozen=True)
class _SpecialTokens:
    """What `encode_prompt` needs of one tokenizer: where its special tokens are in a text, and a way to encode
    text that ignores them."""

    pattern: re.Pattern[str] | None  # one named group per special token (``s<i>``), longest first
    ids: tuple[int, ...]  # the id of group ``s<i>``
    text_backend: Any  # a `tokenizers.Tokenizer` that never parses special tokens, or None (slow tokenizer)
    longest_token: int  # characters of the longest vocabulary entry (`max_prompt_chars`)

    def find(self, text: str) -> list[tuple[int, int, int]]:
        """``(start, end, id)`` of every special token in ``text``, left to right."""
        if self.pattern is None:
            return []
        return [(m.start(), m.end(), self.ids[int(m.lastgroup[1:])]) for m in self.pattern.finditer(text)]


_special_tokens_of: weakref.WeakKeyDictionary[Any, _SpecialTokens] = weakref.WeakKeyDictionary()
_special_tokens_lock = threading.Lock()


def _special_tokens(tokenizer: Any) -> _SpecialTokens:
    try:
        with _special_tokens_lock:
            found = _special_tokens_of.get(tokenizer)
            if found is None:
                found = _special_tokens_of[tokenizer] = _build_special_tokens(tokenizer)
            return found
    except TypeError:  # an object that cannot be weakly referenced (a stand-in tokenizer): nothing to remember
        return _build_special_tokens(tokenizer)


def _build_special_tokens(tokenizer: Any) -> _SpecialTokens:
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    entries = [(token_id, token) for token_id, token in added.items() if getattr(token, "special", False)]
    if not entries:  # a tokenizer that does not describe its added tokens: its declared special tokens
        declared = getattr(tokenizer, "all_special_tokens", [])
        entries = [(tokenizer.convert_tokens_to_ids(content), content) for content in declared]
    alternatives: list[tuple[int, str, int]] = []
    for token_id, token in entries:
        content = getattr(token, "content", token)
        if not isinstance(content, str) or not content or token_id is None:
            continue
        # A token declared with lstrip/rstrip takes the whitespace next to it with it, as the tokenizer does.
        left = r"\s*" if getattr(token, "lstrip", False) else ""
        right = r"\s*" if getattr(token, "rstrip", False) else ""
        alternatives.append((len(content), left + re.escape(content) + right, int(token_id)))
    alternatives.sort(key=lambda a: -a[0])  # longest first: the tokenizer's leftmost-longest match
    pattern = re.compile("|".join(f"(?P<s{i}>{a[1]})" for i, a in enumerate(alternatives))) if alternatives else None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text_backend = _text_only_copy(backend) if backend is not None else None
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    longest_token = max((len(token) for token in vocab), default=1)
    return _SpecialTokens(pattern, tuple(a[2] for a in alternatives), text_backend, longest_token)


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a text that encodes to fewer than ``max_model_len`` tokens can have."""
    return NORMALIZATION_SLACK * _special_tokens(tokenizer).longest_token * max_model_len


def check_prompt_chars(tokenizer: Any, num_chars: int, max_model_len: int | None, name: str = "prompt") -> None:
    """Refuse a text too long for any prompt of fewer than ``max_model_len`` tokens, before tokenizing it."""
    if max_model_len is None:
        return
    limit = max_prompt_chars(tokenizer, max_model_len)
    if num_chars > limit:
        raise ValueError(
            f"{name} of {num_chars} characters is too long: max_model_len={max_model_len} tokens cannot hold more "
            f"than {limit} characters"
        )


def _text_only_copy(backend: Any) -> Any:
    """A `tokenizers.Tokenizer` that encodes like ``backend`` but never parses special tokens.

    It shares the backend's model and pipeline objects (read-only here) instead of copying them: a serialized copy
    of a 150k-entry BPE takes seconds. Its added tokens are re-added in id order; if that does not reproduce every
    id (added ids with gaps), the serialized copy is the fallback.
    """
    from tokenizers import Tokenizer

    copy = Tokenizer(backend.model)
    copy.normalizer = backend.normalizer
    copy.pre_tokenizer = backend.pre_tokenizer
    copy.post_processor = backend.post_processor
    copy.decoder = backend.decoder
    added = backend.get_added_tokens_decoder()
    for token_id in sorted(added):
        token = added[token_id]
        (copy.add_special_tokens if token.special else copy.add_tokens)([token])
    if any(copy.token_to_id(token.content) != token_id for token_id, token in added.items()):
        copy = Tokenizer.from_str(backend.to_str())
    copy.encode_special_tokens = True
    return copy


def _check_unicode(text: str, name: str) -> None:
    """Text must be valid Unicode: a lone surrogate (``"\\ud800"``) is no character any tokenizer can encode (the
    fast tokenizers raise a TypeError on it, which would escape the per-prompt rejection)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{name} is invalid: it is not valid Unicode text ({err.reason} at character {err.start})"
        ) from None


def _encode_text(tokenizer: Any, text: str, parse_special_tokens: bool) -> list[int]:
    if parse_special_tokens:
        return list(tokenizer.encode(text, add_special_tokens=False))
    specials = _special_tokens(tokenizer)
    if specials.text_backend is not None:
        return list(specials.text_backend.encode(text, add_special_tokens=False).ids)
    if specials.pattern is None:  # a tokenizer without special tokens has none to parse
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _check_messages(tokenizer: Any, messages: Sequence[Message]) -> list[dict[str, Any]]:
    plain = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role={preview(role)} is invalid: must be a non-empty string")
        if _special_tokens(tokenizer).find(role):  # the template writes roles as markup: they must be plain words
            raise ValueError(f"messages[{i}].role={preview(role)} is invalid: it holds a special token of this model")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content={preview(content)} is invalid: must be a string")
        _check_unicode(role, f"messages[{i}].role")
        _check_unicode(content, f"messages[{i}].content")
        plain.append(dict(message))
    return plain


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # a template may raise on roles or orders it does not support
        raise ValueError(f"messages are invalid: the chat template rejected them: {err}") from None


def _encode_conversation(
    tokenizer: Any, messages: list[dict[str, Any]], parse_special_tokens: bool, max_model_len: int | None = None
) -> list[int]:
    if not has_chat_template(tokenizer):
        text = "".join(PLAIN_TURN.format(role=m["role"], content=m["content"]) for m in messages)
        check_prompt_chars(tokenizer, len(text), max_model_len, "the conversation")
        return _encode_text(tokenizer, text + PLAIN_GENERATION_PROMPT, parse_special_tokens)
    rendered = _render(tokenizer, messages)
    check_prompt_chars(tokenizer, len(rendered), max_model_len, "the conversation rendered by the chat template")
    if parse_special_tokens:
        return _encode_text(tokenizer, rendered, True)
    specials = _special_tokens(tokenizer)
    nonce = secrets.token_hex(8)
    holders = [f"DIFFULEX{nonce}M{i}E" for i in range(len(messages))]
    marked = _render(tokenizer, [{**m, "content": h} for m, h in zip(messages, holders, strict=True)])
    contents = {h: m["content"] for h, m in zip(holders, messages, strict=True)}
    holder_pattern = re.compile("|".join(holders))
    verbatim = all(marked.count(h) == 1 for h in holders) and (
        holder_pattern.sub(lambda m: contents[m.group()], marked) == rendered
    )
    if not verbatim:
        # The template rewrites content (strips it, branches on it): the placeholders cannot say where content is.
        # Without special-token text in any message nothing can be misread, so the rendering is encoded whole.
        for i, m in enumerate(messages):
            found = specials.find(m["content"])
            if found:
                start, end, _ = found[0]
                raise ValueError(
                    f"messages[{i}].content contains {m['content'][start:end]!r}, a special token of this model, and "
                    "the chat template rewrites message content, so it cannot be kept as plain text: remove it, or "
                    "pass parse_special_tokens=True to let it act as a special token"
                )
        return _encode_text(tokenizer, rendered, True)
    ids: list[int] = []
    position = 0
    for start, end, token_id in [*specials.find(marked), (len(marked), len(marked), None)]:
        piece = holder_pattern.sub(lambda m: contents[m.group()], marked[position:start])
        if piece:
            ids += _encode_text(tokenizer, piece, False)
        if token_id is not None:
            ids.append(token_id)
        position = end
    return ids


def all_plain_ints(values: Sequence[Any]) -> bool:
    """Whether every value is exactly an ``int`` (not a bool, not a subclass): the common case of a token-id
    prompt, checked at C speed (a 32k-token prompt checked token by token in Python cost milliseconds of the
    engine's time before its first token; counting the exact types, with C's identity test, beats a set of them by a
    third). False sends the caller to its per-token check and its error."""
    return operator.countOf(map(type, values), int) == len(values)


def _int64_values(ids: list[int]) -> np.ndarray | None:
    """Plain int ids as one int64 array, converted at C speed, or None when one does not fit in 64 bits: the range
    and mask checks of a 32k-token prompt then take one conversion instead of three passes of Python comparisons."""
    try:
        return np.frombuffer(array("q", ids), dtype=np.int64)
    except OverflowError:
        return None


def _check_token_ids(prompt: Sequence[Any], vocab_size: int | None) -> tuple[list[int], np.ndarray | None]:
    """The ids of a token-id prompt, checked, and their int64 values where they fit (for the mask check)."""
    ids = list(prompt)
    if all_plain_ints(ids):
        values = _int64_values(ids)
        if vocab_size is None or not ids or (values is not None and values.min() >= 0 and values.max() < vocab_size):
            return ids, values
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(
                f"prompt {preview(prompt)} is invalid: token {position} is {token!r}, but token ids must be integers"
            )
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise ValueError(f"prompt token id {token} is invalid: must be within [0, {vocab_size})")
    return ids, None


def encode_prompt(
    tokenizer: Any,
    prompt: Prompt,
    *,
    mask_token_id: int | None,
    vocab_size: int | None = None,
    apply_chat_template: bool = False,
    parse_special_tokens: bool = False,
    max_model_len: int | None = None,
) -> list[int]:
    """The token ids of one prompt: `encode_prompt_values` without the int64 values."""
    return encode_prompt_values(
        tokenizer, prompt, mask_token_id=mask_token_id, vocab_size=vocab_size,
        apply_chat_template=apply_chat_template, parse_special_tokens=parse_special_tokens,
        max_model_len=max_model_len,
    )[0]  # fmt: skip


def encode_prompt_values(
    tokenizer: Any,
    prompt: Prompt,
    *,
    mask_token_id: int | None,
    vocab_size: int | None = None,
    apply_chat_template: bool = False,
    parse_special_tokens: bool = False,
    max_model_len: int | None = None,
) -> tuple[list[int], np.ndarray | None]:
    """The token ids of one prompt, and for a token-id prompt the int64 array its check converted them to (None
    otherwise): the engine keeps it as the request's prompt array instead of converting a long prompt again.

    A prompt is text, a conversation (a list of ``{"role", "content"}`` messages) or token ids.

    * text: encoded as plain text; with ``apply_chat_template`` and a tokenizer that has a chat template, it is
      the one user message of a conversation instead;
    * a conversation: rendered with the chat template (with the generation prompt), or as ``role: content`` lines
      when the tokenizer has none; only the template's markup becomes special tokens;
    * token ids: checked (integers, within ``vocab_size`` when given) and taken as they are.

    ``parse_special_tokens`` lets special-token text inside text and messages act as special tokens. Whatever the
    prompt, the result must not hold ``mask_token_id``. With ``max_model_len``, a text too long for that many tokens
    is refused before it is tokenized (`check_prompt_chars`); the caller still checks the token count. Raises
    ValueError naming the prompt for anything else.
    """
    values = None  # a token-id prompt's int64 values (`_check_token_ids`)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt='' is invalid: must be a non-empty string, a list of token ids or of messages")
        check_prompt_chars(tokenizer, len(prompt), max_model_len)
        _check_unicode(prompt, f"prompt {preview(prompt)}")
        if apply_chat_template and has_chat_template(tokenizer):
            user_turn = [{"role": "user", "content": prompt}]
            ids = _encode_conversation(tokenizer, user_turn, parse_special_tokens, max_model_len)
        else:
            ids = _encode_text(tokenizer, prompt, parse_special_tokens)
    elif is_conversation(prompt):
        messages = _check_messages(tokenizer, prompt)  # type: ignore[arg-type]
        chars = sum(len(m["role"]) + len(m["content"]) for m in messages)
        check_prompt_chars(tokenizer, chars, max_model_len, "messages")
        ids = _encode_conversation(tokenizer, messages, parse_special_tokens, max_model_len)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        ids, values = _check_token_ids(prompt, vocab_size)
    else:
        raise ValueError(
            f"prompt {preview(prompt)} is invalid: must be a string, a list of token ids or a list of chat messages "
            f"({{'role': ..., 'content': ...}}), not {type(prompt).__name__}"
        )
    if not ids:
        raise ValueError(f"prompt {preview(prompt)} is invalid: it encodes to zero tokens")
    if mask_token_id is not None and (
        mask_token_id in ids if values is None else bool((values == mask_token_id).any())
    ):
        raise ValueError(
            f"prompt {preview(prompt)} is invalid: it holds the mask token id {mask_token_id} at position "
            f"{ids.index(mask_token_id)}; the mask token marks positions still to be decoded and cannot be part of a "
            "prompt"
        )
    return ids, values
