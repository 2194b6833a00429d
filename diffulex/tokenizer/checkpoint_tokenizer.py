"""The engine's tokenizer: a checkpoint's `tokenizers.Tokenizer` with the few things the engine, the server and the
chat front end ask of a tokenizer, and nothing of transformers.

Importing transformers and its auto classes costs seconds of every engine start, and the engine uses a small part
of a transformers tokenizer: encoding text (with and without the post-processor's special tokens), decoding (with
and without special tokens), token <-> id lookups, the special tokens and their ids, and the chat template. This
class offers exactly that, under the same names and with the same results as transformers' tokenizer over the same
files, so every caller works with either (the fallback for folders this module cannot build is transformers' own
tokenizer). Every method only reads the tokenizer: it may be used from several threads at once.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer

from diffulex.tokenizer.chat_template import ChatTemplate
from diffulex.tokenizer.tokenizer_config import DEFAULT_TEMPLATE_NAME, TokenizerConfig

TOOL_USE_TEMPLATE_NAME = "tool_use"


class _NamedToken:
    """``tokenizer.eos_token`` / ``tokenizer.eos_token_id``: a named special token's text or id (None if unset)."""

    def __init__(self, name: str, as_id: bool) -> None:
        self.name, self.as_id = name, as_id

    def __get__(self, tokenizer: CheckpointTokenizer | None, owner: type) -> Any:
        if tokenizer is None:
            return self
        content = tokenizer.special_tokens_map.get(self.name)
        if content is None or not self.as_id:
            return content
        return tokenizer.backend_tokenizer.token_to_id(content)


class CheckpointTokenizer:
    """A checkpoint folder's tokenizer, built by `diffulex.tokenizer.load_tokenizer` without transformers."""

    bos_token = _NamedToken("bos_token", as_id=False)
    eos_token = _NamedToken("eos_token", as_id=False)
    unk_token = _NamedToken("unk_token", as_id=False)
    sep_token = _NamedToken("sep_token", as_id=False)
    pad_token = _NamedToken("pad_token", as_id=False)
    cls_token = _NamedToken("cls_token", as_id=False)
    mask_token = _NamedToken("mask_token", as_id=False)
    bos_token_id = _NamedToken("bos_token", as_id=True)
    eos_token_id = _NamedToken("eos_token", as_id=True)
    unk_token_id = _NamedToken("unk_token", as_id=True)
    sep_token_id = _NamedToken("sep_token", as_id=True)
    pad_token_id = _NamedToken("pad_token", as_id=True)
    cls_token_id = _NamedToken("cls_token", as_id=True)
    mask_token_id = _NamedToken("mask_token", as_id=True)

    def __init__(self, backend: Tokenizer, config: TokenizerConfig, name_or_path: str, source: str) -> None:
        self._backend = backend
        self.name_or_path = name_or_path
        self.source = source  # the files it was built from, for logs and messages
        self.chat_template: str | dict[str, str] | None = config.chat_template
        self.special_tokens_map: dict[str, str] = dict(config.named_tokens)
        self.all_special_tokens: list[str] = config.special_contents
        self.all_special_ids: list[int] = [
            i for i in (backend.token_to_id(t) for t in self.all_special_tokens) if i is not None
        ]
        self._templates: dict[str, ChatTemplate] = {}
        self._templates_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CheckpointTokenizer({self.name_or_path!r}, {len(self)} ids, from {self.source})"

    # ----- vocabulary -----------------------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` underneath (read it, never change it: it is shared by every thread)."""
        return self._backend

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, without the added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._backend.get_added_tokens_decoder()

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """A token's id; one the vocabulary lacks is the unknown token's id (None without one)."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> int | None:
        found = self._backend.token_to_id(token)
        return found if found is not None else self.unk_token_id

    # ----- text <-> ids ---------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text in it becomes those tokens. `add_special_tokens` applies the
        checkpoint's post-processor (a BOS for the families that declare one)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, not {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # ----- chat -----------------------------------------------------------------------------------------------

    def _chat_template(self, chat_template: str | None, tools: Sequence[Any] | None) -> ChatTemplate:
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                source = templates[chat_template]
            elif chat_template is not None:
                source = chat_template
            elif tools is not None and TOOL_USE_TEMPLATE_NAME in templates:
                source = templates[TOOL_USE_TEMPLATE_NAME]
            elif DEFAULT_TEMPLATE_NAME in templates:
                source = templates[DEFAULT_TEMPLATE_NAME]
            else:
                raise ValueError(
                    f"chat_template=None is invalid for {self.name_or_path}: it has several chat templates and none "
                    f"is named {DEFAULT_TEMPLATE_NAME!r}; name one of {sorted(templates)}"
                )
        elif chat_template is not None:
            source = chat_template
        elif templates:
            source = templates
        else:
            raise ValueError(f"the tokenizer of {self.name_or_path} has no chat template")
        with self._templates_lock:
            template = self._templates.get(source)
            if template is None:
                template = self._templates[source] = ChatTemplate(source)
        return template

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        **template_variables: Any,
    ) -> str | list[int]:
        """The conversation rendered by the chat template (`diffulex.tokenizer.chat_template`), as text, or as
        token ids with ``tokenize=True`` (the rendering's special-token text becoming special tokens). Extra
        keywords are template variables (``enable_thinking=False``)."""
        if not conversation:
            raise ValueError("conversation is empty: a chat template needs at least one message")
        template = self._chat_template(chat_template, tools)
        text = template.render(
            conversation, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, documents=documents, variables={**self.special_tokens_map, **template_variables},
        )  # fmt: skip
        return self.encode(text, add_special_tokens=False) if tokenize else text
