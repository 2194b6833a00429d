"""The token ids the engine derives from a tokenizer and its checkpoint: the stop set and the mask id.

Both are spread over several files whose contents disagree in real checkpoints (SDAR's ``added_tokens.json``
spells id 151669 ``<MASK>``, its ``tokenizer_config.json`` ``<|MASK|>``), so the rules that combine them are
written down here once. They work with either tokenizer `load_tokenizer` returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffulex.tokenizer.files import read_json, token_content


def _config_token_ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def stop_token_ids(tokenizer: Any, model_dir: str | Path) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS plus ``eos_token_id`` of ``config.json`` and of
    ``generation_config.json`` (each an int or a list). Chat models end turns with ``<|im_end|>``, which often
    appears only in ``generation_config.json``."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        data = read_json(Path(model_dir) / name)
        if isinstance(data, dict):
            ids |= _config_token_ids(data.get("eos_token_id"))
    return ids


def _lookup_token_id(tokenizer: Any, folder: Path, content: str) -> int | None:
    """The id of `content` in the tokenizer, else ``added_tokens.json``, else ``tokenizer_config.json``."""
    vocab = tokenizer.get_vocab()
    if content in vocab:
        return int(vocab[content])
    added = read_json(folder / "added_tokens.json")
    if isinstance(added, dict) and isinstance(added.get(content), int):
        return int(added[content])
    config = read_json(folder / "tokenizer_config.json")
    if isinstance(config, dict):
        for id_str, entry in (config.get("added_tokens_decoder") or {}).items():
            if token_content(entry) == content:
                return int(id_str)
    return None


def resolve_mask_token_id(
    tokenizer: Any, hf_config: Any, model_dir: str | Path, family_default: int | None
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
    special_map = read_json(folder / "special_tokens_map.json")
    if isinstance(special_map, dict):
        content = token_content(special_map.get("mask_token"))
        if content is not None:
            token_id = _lookup_token_id(tokenizer, folder, content)
            if token_id is not None:
                return token_id
    if family_default is not None and 0 <= family_default < len(tokenizer):
        return int(family_default)
    return None
