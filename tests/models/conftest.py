"""Each family's tiny checkpoints, written once per session and shared by `test_families.py` and the family modules;
the Triton interpreter on a machine without CUDA.

A family module names its family in ``FAMILY``; its ``ckpt`` and ``peaky`` fixtures are then that family's
checkpoints (see `family_harness.write_family_checkpoint`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from family_harness import CASES, write_family_checkpoint

# Model paths that run Triton kernels (DiffusionGemma's fused experts) run them under the interpreter on the CPU;
# set before triton is imported. Nothing else here runs a kernel on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

FamilyCheckpoint = Callable[[str, str], Path]


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> FamilyCheckpoint:
    """``family_checkpoint(name, "small" | "peaky")``: the folder of that checkpoint, written on first use."""
    cases = {case.name: case for case in CASES}
    written: dict[tuple[str, str], Path] = {}

    def get(name: str, kind: str) -> Path:
        if (name, kind) not in written:
            folder = tmp_path_factory.mktemp(name) / kind
            written[name, kind] = write_family_checkpoint(folder, cases[name], kind)
        return written[name, kind]

    return get


@pytest.fixture
def ckpt(request: pytest.FixtureRequest, family_checkpoint: FamilyCheckpoint) -> Path:
    return family_checkpoint(request.module.FAMILY, "small")


@pytest.fixture
def peaky(request: pytest.FixtureRequest, family_checkpoint: FamilyCheckpoint) -> Path:
    return family_checkpoint(request.module.FAMILY, "peaky")
