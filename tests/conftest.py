"""Shared fixtures: tiny checkpoints in the real SDAR on-disk format, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffulex.testing.checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="session")
def sdar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny SDAR checkpoint with flat predictions (about one token accepted per step)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar-flat", family="sdar", seed=0)


@pytest.fixture(scope="session")
def peaky_sdar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny SDAR checkpoint whose predictions are confident, so several tokens pass thresholds."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "sdar-peaky", family="sdar", seed=1, init_std=1.0
    )
