"""What a tokenizer folder's small JSON files declare beside the vocabulary: special tokens, added tokens, the chat
template and a few switches.

The rules follow what transformers' loader does with the same files, so that a folder means the same thing to both:

* named special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``,
  ``mask_token``, and any other ``*_token`` key holding a string, such as Gemma's ``image_token``) come from
  ``tokenizer_config.json``; ``special_tokens_map.json`` fills in only for a config without
  ``added_tokens_decoder`` (older folders);
* extra special tokens are ``extra_special_tokens`` (a list, or a dict of more named tokens), else
  ``additional_special_tokens``;
* added tokens are ``added_tokens_decoder`` (id -> token with its flags); an older config without it has them in
  ``added_tokens.json`` (special when declared special);
* the chat template is ``chat_template.jinja``, else the config's ``chat_template`` (a string, or a list of named
  templates), plus any ``additional_chat_templates/*.jinja``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffulex.checkpoint_folder import checkpoint_path
from diffulex.tokenizer.files import added_token_id, json_object, read_text, token_content

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ADDED_TOKEN_FLAGS = ("special", "normalized", "lstrip", "rstrip", "single_word")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
DEFAULT_TEMPLATE_NAME = "default"


@dataclass(frozen=True)
class AddedTokenEntry:
    """One added token as the config files write it."""

    content: str
    special: bool
    normalized: bool = False
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False


@dataclass(frozen=True)
class TokenizerConfig:
    """The declarations of one tokenizer folder (`read_tokenizer_config`)."""

    tokenizer_class: str | None = None
    # name -> token text, in the order transformers adds them (the standard names first)
    named_tokens: dict[str, str] = field(default_factory=dict)
    named_flags: dict[str, AddedTokenEntry] = field(default_factory=dict)  # tokens written with their flags
    extra_special_tokens: tuple[str, ...] = ()
    added_tokens: dict[int, AddedTokenEntry] = field(default_factory=dict)
    chat_template: str | dict[str, str] | None = None
    split_special_tokens: bool = False
    clean_up_tokenization_spaces: bool = False
    add_bos_token: bool = False
    add_eos_token: bool = False

    @property
    def special_contents(self) -> list[str]:
        """Every declared special token's text, named ones first, without repeats."""
        return list(dict.fromkeys([*self.named_tokens.values(), *self.extra_special_tokens]))


def _flag(entry: dict[str, Any], name: str, default: bool) -> bool:
    value = entry.get(name, default)
    return value if isinstance(value, bool) else default


def _entry(value: Any, special_default: bool) -> AddedTokenEntry | None:
    content = token_content(value)
    if content is None:
        return None
    if not isinstance(value, dict):
        return AddedTokenEntry(content, special=special_default, normalized=not special_default)
    special = _flag(value, "special", special_default)
    return AddedTokenEntry(
        content, special=special, normalized=_flag(value, "normalized", not special),
        lstrip=_flag(value, "lstrip", False), rstrip=_flag(value, "rstrip", False),
        single_word=_flag(value, "single_word", False),
    )  # fmt: skip


def _bool_setting(config: dict[str, Any], path: Path, name: str) -> bool:
    value = config.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{path}: {name}={value!r} is invalid: must be true or false")
    return value


def _chat_template(folder: Path, config: dict[str, Any], path: Path) -> str | dict[str, str] | None:
    templates: dict[str, str] = {}
    from_file = read_text(folder, CHAT_TEMPLATE_FILE)
    if from_file is not None:
        templates[DEFAULT_TEMPLATE_NAME] = from_file
    named_dir = checkpoint_path(folder, CHAT_TEMPLATE_DIR)
    if named_dir.is_dir():
        for template_file in sorted(named_dir.glob("*.jinja")):
            text = read_text(named_dir, template_file.name)
            if text is not None:
                templates[template_file.name.removesuffix(".jinja")] = text
    if templates:
        return templates[DEFAULT_TEMPLATE_NAME] if list(templates) == [DEFAULT_TEMPLATE_NAME] else templates
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(
        f"{path}: chat_template is invalid: must be a string or a list of {{'name': ..., 'template': ...}} objects"
    )


def read_tokenizer_config(folder: Path) -> TokenizerConfig:
    """The declarations of `folder`'s ``tokenizer_config.json``, ``special_tokens_map.json`` and
    ``added_tokens.json``. Raises ValueError naming the file for anything malformed."""
    config_path = folder / "tokenizer_config.json"
    config = json_object(config_path)
    decoder = config.get("added_tokens_decoder")
    if decoder is not None and not isinstance(decoder, dict):
        raise ValueError(f"{config_path}: added_tokens_decoder must be an object of id -> token")
    declared: dict[str, Any] = dict(config)
    if decoder is None:  # an older folder: its special tokens map says what the config does not
        for key, value in json_object(folder / "special_tokens_map.json").items():
            declared.setdefault(key, value)

    named: dict[str, str] = {}
    named_flags: dict[str, AddedTokenEntry] = {}
    for key in NAMED_SPECIAL_TOKENS:
        entry = _entry(declared.get(key), special_default=True)
        if entry is not None:
            named[key] = entry.content
            if isinstance(declared.get(key), dict):
                named_flags[key] = entry
    for key, value in declared.items():
        if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS and isinstance(value, str):
            named[key] = value
    extra = declared.get("extra_special_tokens") or declared.get("additional_special_tokens") or []
    if isinstance(extra, dict):
        for key, value in extra.items():
            content = token_content(value)
            if content is not None:
                named[key] = content
        extra = []
    if not isinstance(extra, list):
        raise ValueError(f"{config_path}: extra_special_tokens must be a list of tokens or an object of named tokens")
    extra_tokens = tuple(c for c in (token_content(v) for v in extra) if c is not None)

    added: dict[int, AddedTokenEntry] = {}
    for id_text, value in (decoder or {}).items():
        entry = _entry(value, special_default=True)
        if entry is None:
            raise ValueError(f"{config_path}: added_tokens_decoder[{id_text!r}] is not a token")
        added[added_token_id(config_path, id_text)] = entry
    if decoder is None:
        specials = {*named.values(), *extra_tokens}
        added_path = folder / "added_tokens.json"
        for content, token_id in json_object(added_path).items():
            special = content in specials
            added.setdefault(
                added_token_id(added_path, token_id), AddedTokenEntry(content, special=special, normalized=not special)
            )

    tokenizer_class = config.get("tokenizer_class")
    return TokenizerConfig(
        tokenizer_class=tokenizer_class if isinstance(tokenizer_class, str) else None,
        named_tokens=named,
        named_flags=named_flags,
        extra_special_tokens=extra_tokens,
        added_tokens=dict(sorted(added.items())),
        chat_template=_chat_template(folder, config, config_path),
        split_special_tokens=_bool_setting(config, config_path, "split_special_tokens"),
        clean_up_tokenization_spaces=_bool_setting(config, config_path, "clean_up_tokenization_spaces"),
        add_bos_token=_bool_setting(config, config_path, "add_bos_token"),
        add_eos_token=_bool_setting(config, config_path, "add_eos_token"),
    )
