"""Shared fixtures: tiny checkpoints in the real SDAR on-disk format, written once per test session."""

from __future__ import annotations

from collections.abc import Iterator
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


COMPILE_LOG_ENV = "DIFFULEX_TRITON_COMPILE_LOG"  # `diffulex.kernels.compile_log.LOG_ENV`, named without importing it


def pytest_configure(config: pytest.Config) -> None:
    """With DIFFULEX_TRITON_COMPILE_LOG=FILE, every Triton compile of this process and of the compile helpers its
    engines start is appended to FILE (`diffulex.kernels.compile_log`), with the test that ran: what the GPU suite's
    time goes to (tools/gpu_tests.sh, tools/compile_time_report.py)."""
    import os

    if not os.environ.get(COMPILE_LOG_ENV):
        return
    try:  # the kernels package needs triton
        from diffulex.kernels.compile_log import log_compiles_from_env
    except ImportError:
        return
    if log_compiles_from_env("test process"):
        config.pluginmanager.register(_TestTracker(), "diffulex-compile-log-tracker")


class _TestTracker:
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        import os

        from diffulex.kernels.compile_log import TEST_ENV

        os.environ[TEST_ENV] = item.nodeid  # read by this process's log and inherited by the helpers it starts


@pytest.fixture(autouse=True)
def split_counters_left_zeroed() -> Iterator[None]:
    """Every test leaves the split kernels' arrival counters zeroed (`diffulex.kernels.split_counters`): a launch
    that left one non-zero would make a later launch of the process combine its partials too early, a wrong result
    in some other test. Checked after each test that used them, and zeroed again, so that only the test that left
    them dirty reports it."""
    yield
    import sys

    module = sys.modules.get("diffulex.kernels.split_counters")
    if module is None:
        return
    for device, counters in list(module._COUNTERS.items()):
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        dirty = counters.nonzero().flatten()
        if dirty.numel():
            counters.zero_()
            raise AssertionError(f"split counters left non-zero on {device} at {dirty[:8].tolist()}")
