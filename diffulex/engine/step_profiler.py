"""``profiler_config`` with ``profiler="torch"``: a torch.profiler trace of some engine steps.

Steps ``[delay_iterations, delay_iterations + max_iterations)`` are recorded (``max_iterations=0``: until the
engine exits) and written as a Chrome trace (open it in Perfetto or ``chrome://tracing``) to
``torch_profiler_dir/<run_id>.json``, with the operator table beside it (``<run_id>.txt``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from diffulex.config import ProfilerConfig

logger = logging.getLogger("diffulex")


class StepProfiler:
    def __init__(self, config: ProfilerConfig) -> None:
        self.config = config
        self.steps = 0
        self._profile: profile | None = None
        self._done = False

    def before_step(self) -> None:
        if self._done or self._profile is not None or self.steps < self.config.delay_iterations:
            return
        activities = [ProfilerActivity.CPU]
        if self.config.use_cuda and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        c = self.config
        self._profile = profile(
            activities=activities, record_shapes=c.record_shapes, profile_memory=c.profile_memory,
            with_stack=c.with_stack, with_modules=c.with_modules,
        )  # fmt: skip
        self._profile.__enter__()

    def after_step(self) -> None:
        self.steps += 1
        c = self.config
        if self._profile is not None and c.max_iterations and self.steps >= c.delay_iterations + c.max_iterations:
            self.close()

    def close(self) -> None:
        """Stop and write the trace, if one is being recorded. Safe to call twice."""
        if self._profile is None:
            return
        prof, self._profile, self._done = self._profile, None, True
        prof.__exit__(None, None, None)
        assert self.config.torch_profiler_dir is not None  # checked by ProfilerConfig
        folder = Path(self.config.torch_profiler_dir)
        folder.mkdir(parents=True, exist_ok=True)
        name = self.config.run_id or time.strftime("diffulex-%Y%m%d-%H%M%S")
        prof.export_chrome_trace(str(folder / f"{name}.json"))
        sort = "cuda_time_total" if any(a is ProfilerActivity.CUDA for a in prof.activities) else "cpu_time_total"
        (folder / f"{name}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
        logger.info("profiler trace of %d engine steps written to %s", self.steps, folder / f"{name}.json")
