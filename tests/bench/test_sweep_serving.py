"""The serving target's measure of a batch held: tokens/s over the time every slot is taken and a request waits."""

from __future__ import annotations

import itertools
import time

import pytest

from diffulex.bench.sweep_serving import Occupancy, OccupancySampler, saturated_rate
from diffulex.server.metrics import ServerMetrics


def test_the_window_runs_from_every_slot_taken_to_the_last_request_queued() -> None:
    samples = [
        Occupancy(0.0, 0, 0, 0, 0),  # arrivals fill the slots: not the batch yet
        Occupancy(1.0, 2, 0, 10, 5),
        Occupancy(2.0, 4, 3, 30, 10),  # every slot taken
        Occupancy(3.0, 3, 1, 60, 20),  # a slot refilled late counts against the window
        Occupancy(4.0, 4, 1, 100, 30),  # the last sample with a request queued
        Occupancy(5.0, 2, 0, 200, 40),  # the batch drains: not counted
    ]
    window = saturated_rate(samples, concurrency=4)
    assert window["seconds"] == pytest.approx(2.0)
    assert window["tokens_per_s"] == pytest.approx((100 - 30) / 2.0)
    assert window["mean_running"] == pytest.approx((4 + 3) / 2)
    assert window["ms_per_step"] == pytest.approx(1e3 * 2.0 / 20)
    assert window["tokens_per_step"] == pytest.approx(70 / 20)


@pytest.mark.parametrize(
    "samples",
    [
        [Occupancy(0.0, 2, 1, 0, 0), Occupancy(1.0, 3, 0, 10, 1)],  # the queue emptied before the slots filled
        [Occupancy(0.0, 4, 0, 0, 0), Occupancy(1.0, 4, 0, 10, 1)],  # nothing ever waited
        [],
    ],
)
def test_a_run_that_never_held_the_batch_with_a_queue_has_no_rate(samples: list[Occupancy]) -> None:
    window = saturated_rate(samples, concurrency=4)
    assert window["tokens_per_s"] is None and window["seconds"] == 0.0 and window["ms_per_step"] is None


def test_the_sampler_reads_the_servers_occupancy_until_it_is_left() -> None:
    metrics = ServerMetrics("m")
    with OccupancySampler(metrics) as sampler:
        metrics.observe_step(0.01, num_tokens=7, batch_size=1)
        time.sleep(0.05)
    count = len(sampler.samples)
    time.sleep(0.02)
    assert len(sampler.samples) == count >= 2
    assert sampler.samples[-1].tokens == 7
    assert all(a.seconds <= b.seconds for a, b in itertools.pairwise(sampler.samples))
