"""The measured peaks the benchmarks' floors divide by."""

from __future__ import annotations

import pytest
import torch

from diffulex.bench import hardware


def test_the_copy_rate_is_the_best_of_readings_spaced_apart(monkeypatch) -> None:
    """A reading taken while the device is still busy freeing an engine's memory reads low; the peak is the best
    reading, not the first."""
    seconds_per_copy = iter([2.0, 1.0, 4.0])
    monkeypatch.setattr(hardware, "time_per_call", lambda fn, device, iters: next(seconds_per_copy))
    pauses: list[float] = []
    monkeypatch.setattr(hardware.time, "sleep", pauses.append)
    rate = hardware.measure_copy_bandwidth(torch.device("cpu"), 1000, iters=1, readings=3, spacing_s=0.5)
    assert rate == 2 * 1000 / 1.0
    assert pauses == [0.5, 0.5]


def test_a_copy_rate_is_measured_for_real_on_the_cpu() -> None:
    assert hardware.measure_copy_bandwidth(torch.device("cpu"), 1 << 20, iters=2, readings=2) > 0


def test_a_checked_config_is_priced_against_its_floor_and_a_wrong_or_unwritten_output_is_refused():
    from diffulex.bench.hardware import time_checked_config

    expected = torch.ones(4, 3)
    out = torch.empty(4, 3)

    def writes(value: float | None):
        def timed() -> float:
            if value is not None:  # None: the launch leaves the output unwritten
                out.fill_(value)
            return 2e-3

        return timed

    row = time_checked_config(writes(1.0), out, expected, flops=4e9, flops_per_s=1e12, tolerance=1e-3)
    assert row == {"max_abs_error": 0.0, "ms": 2.0, "floor_ms": 4.0, "tflops": 2.0, "x_floor": 0.5}
    assert "max_abs_error" not in time_checked_config(writes(5.0), out, None, 4e9, 1e12, 1e-3)  # not checked
    for value in (1.5, None):
        with pytest.raises(RuntimeError, match="max abs error"):
            time_checked_config(writes(value), out, expected, 4e9, 1e12, 1e-3)
