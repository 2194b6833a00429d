"""Files of a checkpoint folder, resolved so that nothing outside the folder is ever opened.

A checkpoint folder is downloaded from strangers. Its index file names shard paths, and any entry may be a symbolic
link; following ``../../secrets.safetensors`` or a link to ``/home/user/...`` would read files the user never handed
to the engine (and echo parts of them in error messages). Every file the model, config and tokenizer loaders open is
therefore resolved here first, and refused with a ``ValueError`` naming it when it lands outside the folder. Links
that stay inside the folder are followed as usual.

One layout is inside by construction: the Hugging Face hub cache, where ``models--org--name/snapshots/<revision>/``
holds only links into the same repository's ``blobs/`` store. A link from a snapshot folder into its own
repository's ``blobs/`` is accepted; any other target is not.
"""

from __future__ import annotations

import os
from pathlib import Path

HUB_SNAPSHOTS_DIR = "snapshots"
HUB_BLOBS_DIR = "blobs"


def allowed_roots(folder: str | Path) -> tuple[Path, ...]:
    """The resolved folders a file of `folder` may live in: the folder itself and, for a hub-cache snapshot, its
    repository's blob store."""
    root = Path(folder).resolve()
    roots = [root]
    if root.parent.name == HUB_SNAPSHOTS_DIR:
        blobs = root.parent.parent / HUB_BLOBS_DIR
        if blobs.is_dir():
            roots.append(blobs.resolve())
    return tuple(roots)


def checkpoint_path(folder: str | Path, name: str) -> Path:
    """``folder / name``, after checking that `name` is a relative path that, links followed, stays inside
    `folder` (see `allowed_roots`). The path is returned as named (not resolved), so messages show the user's names.

    Raises ``ValueError`` naming the file and why: an absolute path, a path that climbs out with ``..``, or a
    symbolic link (of the file or of a folder on its way) to a place outside, or links that loop. Whether the file
    exists is left to the caller.
    """
    folder = Path(folder)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{folder}: a checkpoint file name must be a non-empty string, got {name!r}")
    if os.path.isabs(name):
        raise ValueError(f"{folder}: {name!r} is an absolute path; checkpoint files must be inside the folder")
    path = folder / name
    roots = allowed_roots(folder)
    lexical = Path(os.path.normpath(roots[0] / name))
    if not lexical.is_relative_to(roots[0]):
        raise ValueError(f"{path}: the name {name!r} leads outside the checkpoint folder {folder}")
    try:
        target = path.resolve()
    except (RuntimeError, OSError) as err:  # a loop of links: RuntimeError up to Python 3.12, OSError after
        raise ValueError(f"{path}: its symbolic links cannot be followed ({err}); a link must lead to a file") from None
    if not any(target.is_relative_to(root) for root in roots):
        raise ValueError(
            f"{path}: is a symbolic link (or lies under one) to {target}, outside the checkpoint folder {folder}; "
            "copy the file into the folder instead"
        )
    return path


def check_entries_inside(folder: str | Path, names: tuple[str, ...]) -> None:
    """`checkpoint_path` for each of `names` that exists in `folder` (as a file, a folder or a link, even a broken
    one), and for everything under those that are folders."""
    folder = Path(folder)
    for name in names:
        path = folder / name
        if not (path.exists() or path.is_symlink()):
            continue
        checkpoint_path(folder, name)
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                checkpoint_path(folder, str(child.relative_to(folder)))
