"""The tokenizer files of a checkpoint folder, read as untrusted input.

Every file is confined to its folder (`diffulex.checkpoint_folder`): a link out of the folder is refused before
anything opens it, and a file that is not what it claims to be (invalid JSON, a JSON list where an object belongs)
is named with its problem instead of surfacing later as "no tokenizer found".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffulex.checkpoint_folder import checkpoint_path

# The JSON files a tokenizer loader (ours or transformers') may read from a tokenizer folder.
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
# Every entry such a loader may open (the last one a folder of named chat templates).
TOKENIZER_FILES = (
    *JSON_TOKENIZER_FILES,
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "additional_chat_templates",
)


def read_json(path: Path) -> Any:
    """The parsed JSON file `path` of a checkpoint folder, None if absent; refused if it leads out of the folder."""
    path = checkpoint_path(path.parent, path.name)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def json_object(path: Path) -> dict[str, Any]:
    """A tokenizer JSON file that must hold an object ({} when absent)."""
    data = read_json(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def read_text(folder: Path, name: str) -> str | None:
    """A text file of the folder (a chat template), None if absent."""
    path = checkpoint_path(folder, name)
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from None


def token_content(entry: Any) -> str | None:
    """A token as written in the tokenizer JSON files: a string or ``{"content": ...}``."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def added_token_id(path: Path, value: Any) -> int:
    """An added token's id as written in `path` (an int, or a decimal string as a JSON key)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise ValueError(f"{path}: added token id {value!r} is not a non-negative integer")


def folder_listing(folder: Path) -> str:
    """What a folder holds, for an error message."""
    return ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
