"""The measured peaks the benchmarks' floors divide by."""

from __future__ import annotations

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
