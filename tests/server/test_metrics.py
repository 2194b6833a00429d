"""The server's /metrics text: what it exports of the engine's load."""

from __future__ import annotations

from diffulex.engine.engine_load import EngineLoad
from diffulex.server.metrics import ServerMetrics


def _value(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.split()[0] == name)


def test_the_steps_continued_on_the_device_are_exported_from_the_engines_load() -> None:
    metrics = ServerMetrics("m")
    metrics.set_state(EngineLoad(3, 0, 5, 10, steps=40, continued_steps=31))
    text = metrics.render()
    assert "# TYPE diffulex_continued_steps_total counter" in text
    assert _value(text, "diffulex_continued_steps_total") == 31


def test_replicas_steps_and_continued_steps_add_up() -> None:
    total = EngineLoad.total([EngineLoad(1, 0, 2, 8, steps=10, continued_steps=4),
                              EngineLoad(2, 1, 3, 8, steps=20, continued_steps=15)])
    assert (total.steps, total.continued_steps) == (30, 19)
    assert (total.running, total.kv_pages_total) == (3, 16)


def test_the_steps_the_host_launched_itself_are_exported_by_reason() -> None:
    metrics = ServerMetrics("m")
    metrics.set_state(EngineLoad(3, 0, 5, 10, steps=40, continued_steps=31,
                                 refused_continuations={"admission": 6, "rows_change": 3}))
    text = metrics.render()
    assert "# TYPE diffulex_continuation_refusals_total counter" in text
    assert _value(text, 'diffulex_continuation_refusals_total{reason="admission"}') == 6
    assert _value(text, 'diffulex_continuation_refusals_total{reason="rows_change"}') == 3


def test_replicas_refusals_add_up_by_reason() -> None:
    total = EngineLoad.total([EngineLoad(1, 0, 2, 8, refused_continuations={"admission": 2}),
                              EngineLoad(2, 1, 3, 8, refused_continuations={"admission": 1, "running_set": 4})])
    assert total.refused_continuations == {"admission": 3, "running_set": 4}


def test_occupancy_reads_the_last_steps_requests_and_the_tokens_decoded_so_far() -> None:
    metrics = ServerMetrics("m")
    metrics.observe_step(0.01, num_tokens=5, batch_size=4)
    metrics.set_state(EngineLoad(4, 2, 5, 10))
    metrics.observe_step(0.01, num_tokens=3, batch_size=4)
    assert metrics.occupancy() == (4, 2, 8, 2)


def test_continuations_computed_and_never_applied_are_exported() -> None:
    metrics = ServerMetrics("m")
    metrics.set_state(EngineLoad.total([EngineLoad(1, 0, 2, 8, dropped_continuations=2),
                                        EngineLoad(1, 0, 2, 8, dropped_continuations=3)]))
    assert _value(metrics.render(), "diffulex_dropped_continuations_total") == 5


def test_the_seconds_the_replicas_waited_for_their_devices_add_up_and_are_exported() -> None:
    metrics = ServerMetrics("m")
    metrics.set_state(EngineLoad.total([EngineLoad(1, 0, 2, 8, device_wait_s=1.25),
                                        EngineLoad(1, 0, 2, 8, device_wait_s=0.5)]))
    text = metrics.render()
    assert "# TYPE diffulex_device_wait_seconds_total counter" in text
    assert _value(text, "diffulex_device_wait_seconds_total") == 1.75
