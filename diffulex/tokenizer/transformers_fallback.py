"""transformers' AutoTokenizer, for the tokenizer folders `diffulex.tokenizer.backend` does not build (a
sentencepiece-only ``tokenizer.model``, a vocabulary of another tokenizer class).

transformers is imported here only, on the first such folder: an engine over any supported family never imports it.
Remote code stays off (``trust_remote_code=False``): a tokenizer class shipped in the folder is never run.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """AutoTokenizer first tries to read ``config.json`` as a model config; for model types transformers does not
    know (``sdar``) that prints a misleading warning. Silence it for the duration of the load."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(previous)


def load_with_transformers(folder: Path) -> Any:
    """``AutoTokenizer.from_pretrained(folder, trust_remote_code=False)``; its exception propagates."""
    from transformers import AutoTokenizer

    with _quiet_transformers():
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
