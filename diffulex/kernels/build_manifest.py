"""The Triton kernel variants an engine's build launched, remembered beside Triton's on-disk cache.

Why: the build finds what its warm-ups will compile by running them dry first (`diffulex.kernels.parallel_compile`),
which costs seconds even when every variant is cached already (about 3 to 4 s of a 9 s warm build of the SDAR-1.7B
geometry on an H100). The next build of the same engine on the same machine launches the same variants, so once a
build has launched them all, the list (the manifest) tells the next one at once, by a cache lookup per variant,
that nothing is left to compile: it skips the dry pass.

A manifest holds only what the real warm-ups launched (`parallel_compile.compile_locks`), never what a dry pass
merely recorded. It is named by everything that decides which variants a build launches (`manifest_key`): the
engine's fields, the model's geometry, the dtype, the device, and the versions of torch and triton. A variant whose
kernel source changed is no longer found in the cache, and the build then runs its dry pass as without a manifest;
a build whose code launches variants its manifest lacks compiles them in its warm-ups and adds them. A stale or
unreadable manifest costs only that: the warm-ups compile whatever they lack.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diffulex.kernels.parallel_compile import KernelVariant, cached_or_unknown_false

MANIFEST_FOLDER = "diffulex-build-manifests"  # inside Triton's cache folder, beside the variants it names


def manifest_key(fields: Mapping[str, Any]) -> str:
    """The manifest's name for a build described by `fields` (JSON-able values; key order does not matter)."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def manifest_path(cache_dir: str | os.PathLike[str], key: str) -> Path:
    return Path(cache_dir) / MANIFEST_FOLDER / f"{key}.json"


def load_manifest(path: Path) -> list[KernelVariant] | None:
    """The variants a manifest names, or None where there is none or it cannot be read as one."""
    try:
        entries = json.loads(path.read_text())
        return [KernelVariant(**entry) for entry in entries]
    except (OSError, ValueError, TypeError):
        return None


def save_manifest(path: Path, variants: Iterable[KernelVariant]) -> None:
    """Write the manifest whole or not at all (a temporary file renamed over it): builds on one machine may write
    the same one at once, and a reader must never see half of it. A failure is left unsaid: the next build only
    runs its dry pass."""
    unique = list(dict.fromkeys(variants))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump([asdict(variant) for variant in unique], out)
        os.replace(tmp, path)
    except OSError:
        return


def all_cached(variants: Iterable[KernelVariant], target: Any) -> bool:
    """Whether Triton's on-disk cache holds every one of `variants` for `target` (an empty list holds nothing to
    trust: False)."""
    variants = list(variants)
    return bool(variants) and all(cached_or_unknown_false(variant, target) for variant in variants)


@dataclass
class BuildManifest:
    """One build's manifest: where it lives, what it named when the build began (None: nothing usable), and
    whether all of that is cached for the build's target (`ready`: the build may skip its dry pass)."""

    path: Path
    variants: list[KernelVariant] | None
    ready: bool

    @classmethod
    def open(cls, cache_dir: str | os.PathLike[str], fields: Mapping[str, Any], target: Any) -> BuildManifest:
        path = manifest_path(cache_dir, manifest_key(fields))
        variants = load_manifest(path)
        return cls(path, variants, variants is not None and all_cached(variants, target))

    def record(self, launched: Iterable[KernelVariant]) -> None:
        """Remember what this build's warm-ups launched: added to what a ready manifest named (a variant already
        loaded in this process launches without showing, so a second build in one process sees fewer), else
        instead of it (a manifest that was not ready may name variants whose kernels have changed since)."""
        launched = list(launched)
        if not launched:
            return
        kept = self.variants if self.ready and self.variants else []
        if kept and set(launched) <= set(kept):
            return
        save_manifest(self.path, [*kept, *launched])
