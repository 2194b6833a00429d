"""Loading a checkpoint's tokenizer without remote code and, for every family we serve, without transformers.

`load_tokenizer` builds a `CheckpointTokenizer` (``tokenizers.Tokenizer`` underneath, chat templates rendered by
our own sandboxed jinja2 environment) from a ``tokenizer.json`` or a Qwen2-style ``vocab.json`` + ``merges.txt``;
importing transformers and its auto classes would add seconds to every engine start. A folder in another layout
(sentencepiece only, another tokenizer class) goes to transformers' AutoTokenizer, still with
``trust_remote_code=False``. The log says which one was used.

Every tokenizer file is confined to its folder (`diffulex.checkpoint_folder`): a link out of the folder is refused
before anything opens it. A damaged file is named with its problem (invalid JSON, a ``tokenizer.json`` the
tokenizers library rejects) rather than reported as "no tokenizer found".
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from diffulex.checkpoint_folder import check_entries_inside
from diffulex.tokenizer.backend import (
    QWEN2_SPLIT_PATTERN,
    UnsupportedTokenizerFolder,
    build_backend,
    finish_backend,
    qwen2_bpe,
)
from diffulex.tokenizer.checkpoint_tokenizer import CheckpointTokenizer
from diffulex.tokenizer.files import TOKENIZER_FILES, folder_listing
from diffulex.tokenizer.special_ids import resolve_mask_token_id, stop_token_ids
from diffulex.tokenizer.tokenizer_config import read_tokenizer_config

logger = logging.getLogger("diffulex")

__all__ = [
    "QWEN2_SPLIT_PATTERN",
    "TOKENIZER_FILES",
    "CheckpointTokenizer",
    "build_checkpoint_tokenizer",
    "build_qwen2_tokenizer",
    "load_tokenizer",
    "resolve_mask_token_id",
    "stop_token_ids",
]


def build_checkpoint_tokenizer(path: str | Path) -> CheckpointTokenizer:
    """Our tokenizer of a checkpoint folder. Raises ValueError naming the file at fault for a damaged folder, and
    `UnsupportedTokenizerFolder` for a layout it does not build."""
    folder = Path(path)
    check_entries_inside(folder, TOKENIZER_FILES)
    config = read_tokenizer_config(folder)
    backend, source = build_backend(folder, config)
    return CheckpointTokenizer(backend, config, str(folder), source)


def build_qwen2_tokenizer(path: str | Path) -> CheckpointTokenizer:
    """The Qwen2 byte-level BPE tokenizer of ``vocab.json`` + ``merges.txt`` (+ the declared added tokens),
    whatever tokenizer class the folder names and even beside a ``tokenizer.json``."""
    folder = Path(path)
    check_entries_inside(folder, TOKENIZER_FILES)
    config = read_tokenizer_config(folder)
    backend = qwen2_bpe(folder)
    finish_backend(backend, folder, config, from_tokenizer_json=False)
    return CheckpointTokenizer(backend, config, str(folder), "vocab.json + merges.txt (Qwen2 byte-level BPE)")


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a checkpoint folder (never running code from the folder, never reading outside it):
    a `CheckpointTokenizer` where the folder's layout allows, else transformers' AutoTokenizer.

    Raises ``ValueError`` naming the file when a tokenizer file leads outside the folder, is not valid JSON, or is
    a ``tokenizer.json`` the tokenizers library rejects; else naming what the folder holds when it has no
    tokenizer at all.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
    try:
        tokenizer = build_checkpoint_tokenizer(folder)
    except UnsupportedTokenizerFolder as unsupported:
        reason = str(unsupported)
    else:
        logger.info("tokenizer of %s: diffulex's, from %s", folder, tokenizer.source)
        return tokenizer
    from diffulex.tokenizer.transformers_fallback import load_with_transformers

    try:
        tokenizer = load_with_transformers(folder)
    except Exception as auto_error:
        raise ValueError(
            f"cannot load a tokenizer from {folder}: it has {reason}, and transformers' AutoTokenizer failed too "
            f"({auto_error}); the folder holds: {folder_listing(folder)}"
        ) from auto_error
    logger.info("tokenizer of %s: transformers' %s (%s)", folder, type(tokenizer).__name__, reason)
    return tokenizer
