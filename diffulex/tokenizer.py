"""Loading a checkpoint's tokenizer without remote code, and the token ids the engine derives from it.

``load_tokenizer`` uses ``transformers.AutoTokenizer`` with ``trust_remote_code=False``. Many diffusion-LM
folders (SDAR, Dream, Fast-dLLM v2) ship only the Qwen2 ``vocab.json`` + ``merges.txt`` and point
``auto_map`` at a Python tokenizer file; transformers builds the fast tokenizer from the vocabulary files
itself, and if that ever fails we build the same byte-level BPE with the ``tokenizers`` library.

The stop set and the mask id are spread over several files whose contents disagree in real checkpoints
(SDAR's ``added_tokens.json`` spells id 151669 ``<MASK>``, its ``tokenizer_config.json`` ``<|MASK|>``), so the
rules that combine them are written down here once.

Every tokenizer file is confined to its folder (`diffulex.checkpoint_folder`): a link out of the folder is refused
before transformers opens anything. When loading fails, the error names the file at fault (invalid JSON, a
``tokenizer.json`` the tokenizers library rejects) rather than the generic "no tokenizer found".
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from diffulex.checkpoint_folder import check_entries_inside, checkpoint_path

# The pre-tokenization regex of Qwen2/Qwen2.5/Qwen3 (digits split one by one).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


# Files transformers or `build_qwen2_tokenizer` may read from a tokenizer folder (the last one a folder).
JSON_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "chat_template.json",
    "config.json",
    "generation_config.json",
)
TOKENIZER_FILES = (
    *JSON_TOKENIZER_FILES,
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "additional_chat_templates",
)


def _read_json(path: Path) -> Any:
    """The parsed JSON file `path` of a checkpoint folder, None if absent; refused if it leads out of the folder."""
    path = checkpoint_path(path.parent, path.name)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """AutoTokenizer first tries to read ``config.json`` as a model config; for model types transformers does
    not know (``sdar``) that prints a misleading warning. Silence it for the duration of the load."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(previous)


def _broken_tokenizer_file(folder: Path) -> str | None:
    """Why a tokenizer file of `folder` cannot be read, naming it, or None if every one parses: JSON files must be
    valid JSON and ``tokenizer.json`` must be accepted by the tokenizers library. Asked only after a failed load,
    so a good folder never pays for the second parse."""
    from tokenizers import Tokenizer

    for name in JSON_TOKENIZER_FILES:
        try:
            _read_json(folder / name)
        except ValueError as e:
            return str(e)
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.is_file():
        try:
            Tokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # the tokenizers library raises a bare Exception
            return f"{tokenizer_json} is not a valid tokenizer file: {e}"
    return None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint folder (never running code from the folder, never reading outside it).

    Raises ``ValueError`` naming the file when a tokenizer file leads outside the folder, is not valid JSON, or is
    a ``tokenizer.json`` the tokenizers library rejects; else naming what the folder holds when it has no
    tokenizer at all.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
    check_entries_inside(folder, TOKENIZER_FILES)
    try:
        with _quiet_transformers():
            return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as auto_error:
        broken = _broken_tokenizer_file(folder)
        if broken is not None:
            raise ValueError(f"cannot load a tokenizer from {folder}: {broken}") from auto_error
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            return build_qwen2_tokenizer(folder)
        present = sorted(p.name for p in folder.iterdir())
        raise ValueError(
            f"cannot load a tokenizer from {folder}: AutoTokenizer failed ({auto_error}) and there is "
            f"neither a tokenizer.json nor vocab.json + merges.txt to build one from; the folder holds: "
            f"{', '.join(present) or 'nothing'}"
        ) from auto_error


def _token_content(entry: Any) -> str | None:
    """A token as written in the tokenizer JSON files: a string or ``{"content": ...}``."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def build_qwen2_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """A Qwen2-style byte-level BPE fast tokenizer from ``vocab.json`` + ``merges.txt`` (+ added tokens).

    Same pipeline as Qwen2TokenizerFast: NFC, regex split (`QWEN2_SPLIT_PATTERN`), byte-level mapping, BPE,
    byte-level decoding. Added tokens come from ``tokenizer_config.json`` ``added_tokens_decoder`` (which
    carries the ``special`` flag) and then ``added_tokens.json`` for ids not covered there.
    """
    from tokenizers import AddedToken as TkAddedToken
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    folder = Path(folder)
    check_entries_inside(folder, TOKENIZER_FILES)
    missing = [name for name in ("vocab.json", "merges.txt") if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"cannot build a BPE tokenizer from {folder}: missing {', '.join(missing)}")
    try:
        bpe = models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"), unk_token=None)
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ValueError(
            f"cannot build a BPE tokenizer from {folder}: vocab.json + merges.txt are not a valid BPE model: {e}"
        ) from None
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()

    config = _json_object(folder / "tokenizer_config.json")
    added: dict[int, dict[str, Any]] = {}
    decoder = config.get("added_tokens_decoder") or {}
    for id_str, entry in (decoder if isinstance(decoder, dict) else {}).items():
        if _token_content(entry) is not None:
            added[_added_id(folder / "tokenizer_config.json", id_str)] = (
                entry if isinstance(entry, dict) else {"content": entry}
            )
    for content, token_id in _json_object(folder / "added_tokens.json").items():
        added.setdefault(_added_id(folder / "added_tokens.json", token_id), {"content": content})
    for token_id in sorted(added):
        entry = added[token_id]
        content, special = entry["content"], bool(entry.get("special", True))
        if tok.token_to_id(content) is not None:
            continue
        next_id = tok.get_vocab_size(with_added_tokens=True)
        if token_id != next_id:
            raise ValueError(
                f"{folder}: added token {content!r} has id {token_id}, but the next free id is {next_id} "
                "(added ids must follow the BPE vocabulary without gaps)"
            )
        token = TkAddedToken(
            content,
            special=special,
            normalized=bool(entry.get("normalized", False)),
            lstrip=bool(entry.get("lstrip", False)),
            rstrip=bool(entry.get("rstrip", False)),
            single_word=bool(entry.get("single_word", False)),
        )
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])

    special_map = _json_object(folder / "special_tokens_map.json")
    kwargs: dict[str, Any] = {}
    for key in ("eos_token", "pad_token", "bos_token", "unk_token", "mask_token"):
        content = _token_content(config.get(key)) or _token_content(special_map.get(key))
        if content is not None:
            kwargs[key] = content
    chat_template = checkpoint_path(folder, "chat_template.jinja")
    if chat_template.is_file():
        kwargs["chat_template"] = chat_template.read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        kwargs["chat_template"] = config["chat_template"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)


def _json_object(path: Path) -> dict[str, Any]:
    """A tokenizer JSON file that must hold an object ({} when absent)."""
    data = _read_json(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _added_id(path: Path, value: Any) -> int:
    """An added token's id as written in `path` (an int, or a decimal string as a JSON key)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise ValueError(f"{path}: added token id {value!r} is not a non-negative integer")


def _config_token_ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS plus ``eos_token_id`` of ``config.json`` and of
    ``generation_config.json`` (each an int or a list). Chat models end turns with ``<|im_end|>``, which often
    appears only in ``generation_config.json``."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        data = _read_json(Path(model_dir) / name)
        if isinstance(data, dict):
            ids |= _config_token_ids(data.get("eos_token_id"))
    return ids


def _lookup_token_id(tokenizer: PreTrainedTokenizerBase, folder: Path, content: str) -> int | None:
    """The id of `content` in the tokenizer, else ``added_tokens.json``, else ``tokenizer_config.json``."""
    vocab = tokenizer.get_vocab()
    if content in vocab:
        return int(vocab[content])
    added = _read_json(folder / "added_tokens.json")
    if isinstance(added, dict) and isinstance(added.get(content), int):
        return int(added[content])
    config = _read_json(folder / "tokenizer_config.json")
    if isinstance(config, dict):
        for id_str, entry in (config.get("added_tokens_decoder") or {}).items():
            if _token_content(entry) == content:
                return int(id_str)
    return None


def resolve_mask_token_id(
    tokenizer: PreTrainedTokenizerBase,
    hf_config: Any,
    model_dir: str | Path,
    family_default: int | None,
) -> int | None:
    """The id the engine writes into undecoded positions. First match wins:

    1. ``hf_config.mask_token_id`` (what the model was trained with);
    2. ``tokenizer.mask_token_id``;
    3. ``special_tokens_map.json`` ``mask_token`` looked up in the vocabulary / ``added_tokens.json`` /
       ``tokenizer_config.json`` ``added_tokens_decoder``;
    4. the family default, if it is a valid id of this tokenizer (``< len(tokenizer)``);
    5. None (the caller must then ask the user).
    """
    config_id = getattr(hf_config, "mask_token_id", None)
    if config_id is not None:
        return int(config_id)
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    folder = Path(model_dir)
    special_map = _read_json(folder / "special_tokens_map.json")
    if isinstance(special_map, dict):
        content = _token_content(special_map.get("mask_token"))
        if content is not None:
            token_id = _lookup_token_id(tokenizer, folder, content)
            if token_id is not None:
                return token_id
    if family_default is not None and 0 <= family_default < len(tokenizer):
        return int(family_default)
    return None
