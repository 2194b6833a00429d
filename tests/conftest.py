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


COMPILE_LOG_ENV = "DIFFULEX_TRITON_COMPILE_LOG"


def pytest_configure(config: pytest.Config) -> None:
    """With DIFFULEX_TRITON_COMPILE_LOG=FILE, every Triton compile in this process is appended to FILE as a JSON line
    (kernel, microseconds, cache hit, the test that asked): what the GPU suite's time goes to (tools/gpu_tests.sh)."""
    import os

    path = os.environ.get(COMPILE_LOG_ENV)
    if not path:
        return
    import json

    try:
        import triton
    except ImportError:
        return
    current = {"test": ""}

    def log_compile(*, src, metadata, metadata_group, times, cache_hit) -> None:  # noqa: ANN001 (Triton's hook)
        micros = times.ir_initialization + sum(us for _, us in times.lowering_stages) + times.store_results
        kernel, variant = metadata.get("name", "?"), metadata.get("hash")
        line = {"kernel": kernel, "hash": variant, "us": micros, "hit": cache_hit, "test": current["test"]}
        with open(path, "a") as log:
            log.write(json.dumps(line) + "\n")

    triton.knobs.compilation.listener = log_compile
    config.pluginmanager.register(_TestTracker(current), "diffulex-compile-log-tracker")


class _TestTracker:
    def __init__(self, current: dict[str, str]) -> None:
        self.current = current

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.current["test"] = item.nodeid
