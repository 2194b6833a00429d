"""The package's front door: what ``import diffulex`` offers a user (tab completion, ``dir``, ``import *``)."""

from __future__ import annotations

import subprocess
import sys


def test_the_package_namespace_holds_its_public_names_and_no_typing_helpers() -> None:
    """In a fresh interpreter (other tests import submodules, which then appear as attributes): every name of
    ``dir(diffulex)`` that is not a dunder or a submodule is in ``__all__``, and ``__all__`` resolves."""
    code = (
        "import types, diffulex\n"
        "names = [n for n in dir(diffulex) if not n.startswith('__')"
        " and not isinstance(getattr(diffulex, n), types.ModuleType)]\n"
        "print(sorted(names)); print(sorted(n for n in diffulex.__all__ if not n.startswith('__')))\n"
        "assert all(hasattr(diffulex, n) for n in diffulex.__all__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == out[1], f"dir(diffulex) has names beyond __all__: {out[0]} against {out[1]}"
