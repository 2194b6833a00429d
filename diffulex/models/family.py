"""A model family: everything the engine needs to know about one kind of checkpoint, registered in one place.

A family names its model class, the reader of its ``config.json``, how a checkpoint says it belongs to the family
(``model_type`` values and architecture names), the mask token it falls back to, the strategy it decodes with by
default, and the rules of its authors' decoder that the strategies honour (where the logits of a position come
from, whether every block must take a token per step, which sampling modes and strategies it supports). Each
family module ends with one `register_family` call; a plugin adds a family the same way (`Family.renamed` makes an
alias of an existing one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffulex.registry import Registry


@dataclass(frozen=True)
class Family:
    name: str
    model: type  # the nn.Module built from the typed config: ``model(read_config(folder))``
    read_config: Callable[[str | Path], Any]  # checkpoint folder -> the typed config the model is built from
    mask_token_id: int | None  # used when neither the user nor the checkpoint's files name the mask token
    default_strategy: str  # the decoding strategy its checkpoints were trained for
    # config.json ``model_type`` values that identify the family on their own
    model_types: tuple[str, ...] = ()
    # substrings of config.json ``architectures`` entries; they are checked before ``model_type``, because some
    # families reuse a generic model_type (Stable-DiffCoder says "llama")
    architectures: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other model_name values of the same family (checkpoint names of it)
    # the hidden state at p - 1 predicts the token at p (Dream-style): the engine samples the row before a position
    logits_shift: bool = False
    # its authors' decoder commits at least one token per step in every sampled block, not only in the oldest
    force_every_block: bool = False
    sampling_modes: tuple[str, ...] = ("naive",)  # "edit": its decoder may also rewrite decoded tokens
    # the strategies it runs with (None: any strategy that accepts it); another one is replaced by the default
    strategies: tuple[str, ...] | None = None
    # tokens of the one canvas it denoises at a time, when the model fixes the block size (None: it does not)
    canvas_size: int | None = None
    # the block_size used when neither the user nor config.json names one (None: the engine's default, 32)
    default_block_size: int | None = None
    # its layers split across tensor- and expert-parallel ranks (`tensor_parallel_check.check_parallel_layout`)
    tensor_parallel: bool = True

    def renamed(
        self, name: str, *, model_types: tuple[str, ...] = (), architectures: tuple[str, ...] = ()
    ) -> Family:
        """The same family under another name, detected by other ``model_type`` / architecture names."""
        return dataclasses.replace(
            self, name=name, model_types=model_types, architectures=architectures, aliases=()
        )


# Reading the table imports the package's families (importing `diffulex.models` registers every one of them).
FAMILIES: Registry[Family] = Registry("model_name", builtins="diffulex.models", kind="model family")


def register_family(family: Family) -> Family:
    """Make ``family`` known under its name and its aliases. The package's families are registered first; a name
    one of them (or any earlier registration) holds is refused, and nothing is registered."""
    return FAMILIES.add(family.name, family, names=family.aliases)


def model_type_to_model_name(model_type: str | None, architectures: list[str] | None) -> str | None:
    """The ``model_name`` a checkpoint's ``model_type`` / ``architectures`` name; None if no family claims them.

    An architecture match wins over a ``model_type`` match, and among architecture matches the longest needle (the
    most specific name) does.
    """
    best: tuple[int, str] | None = None
    families = FAMILIES.values()
    for arch in architectures or []:
        for family in families:
            for needle in family.architectures:
                if needle in arch and (best is None or len(needle) > best[0]):
                    best = (len(needle), family.name)
    if best is not None:
        return best[1]
    for family in families:
        if model_type is not None and model_type in family.model_types:
            return family.name
    return None


def load_hf_config(model_dir: str | Path, model_name: str) -> Any:
    """The typed config of the checkpoint in ``model_dir``, read by the reader of family ``model_name``."""
    return FAMILIES.get(model_name).read_config(model_dir)
