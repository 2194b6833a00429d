"""What the engine reports of itself (`EngineLoad`): here, the time its host spent waiting for the device."""

from __future__ import annotations

import time
from pathlib import Path

from diffulex import Diffulex, SamplingParams

DEVICE_STEP_S = 0.02


class SlowDevice:
    """A step's `ready` event whose device takes `DEVICE_STEP_S` to finish it."""

    def synchronize(self) -> None:
        time.sleep(DEVICE_STEP_S)


def test_the_engine_counts_the_seconds_it_waits_for_each_steps_result(sdar_dir: Path) -> None:
    with Diffulex(str(sdar_dir), max_model_len=128, max_num_reqs=4) as llm:
        launch = llm.runner.launch

        def slow_launch(batch, micro_batch=0):
            pending = launch(batch, micro_batch)
            pending.ready = SlowDevice()
            return pending

        llm.runner.launch = slow_launch
        start = time.perf_counter()
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        elapsed = time.perf_counter() - start
        load = llm.load()
    assert load.steps > 0
    assert DEVICE_STEP_S * load.steps <= load.device_wait_s <= elapsed
