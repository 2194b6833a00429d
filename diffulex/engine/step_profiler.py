"""``profiler_config`` with ``profiler="torch"``: a torch.profiler trace of some engine steps.

Steps ``[delay_iterations, delay_iterations + max_iterations)`` are recorded (``max_iterations=0``: until the
engine exits) and written as a Chrome trace (open it in Perfetto or ``chrome://tracing``) to
``torch_profiler_dir/<run_id>.json``, with the operator table beside it (``<run_id>.txt``).

The directory is created when the engine is built, so that one that cannot be fails the build, naming the field,
instead of a generation. A profile is stopped and written by whichever comes first: its last step, the engine's
``exit()``, the engine being collected, or the interpreter's exit (an atexit hook: a torch profiler still running
when the interpreter tears down crashes the process). Profiling never costs a request: a profiler that cannot start
or a trace that cannot be written (a full disk) is a logged warning, and the engine goes on serving.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from diffulex.config import ProfilerConfig
from diffulex.validation import invalid_value

logger = logging.getLogger("diffulex")


def prepare_dir(config: ProfilerConfig) -> Path:
    """Create ``torch_profiler_dir`` (``ProfilerConfig`` has checked the path itself); a ValueError naming the field
    if it cannot be created or written to."""
    assert config.torch_profiler_dir is not None  # checked by ProfilerConfig
    folder = Path(config.torch_profiler_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise invalid_value(
            "profiler_config.torch_profiler_dir", config.torch_profiler_dir, f"cannot be created ({err})"
        ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise invalid_value(
            "profiler_config.torch_profiler_dir", config.torch_profiler_dir, "cannot be written to (permission denied)"
        )
    return folder


class StepProfiler:
    def __init__(self, config: ProfilerConfig) -> None:
        self.config = config
        self.folder = prepare_dir(config)
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
        try:
            prof = profile(
                activities=activities, record_shapes=c.record_shapes, profile_memory=c.profile_memory,
                with_stack=c.with_stack, with_modules=c.with_modules,
            )  # fmt: skip
            prof.__enter__()
        except Exception as err:  # noqa: BLE001  (profiling is never worth a request)
            self._done = True
            logger.warning("the torch profiler could not start (%s: %s); the engine runs without it",
                           type(err).__name__, err)  # fmt: skip
            return
        self._profile = prof
        atexit.register(self.close)  # stopped before interpreter teardown, even if exit() is never called

    def after_step(self) -> None:
        self.steps += 1
        c = self.config
        if self._profile is not None and c.max_iterations and self.steps >= c.delay_iterations + c.max_iterations:
            self.close()

    def close(self) -> None:
        """Stop and write the trace, if one is being recorded. Safe to call twice; never raises (a trace that
        cannot be written is a logged warning)."""
        if self._profile is None:
            return
        prof, self._profile, self._done = self._profile, None, True
        atexit.unregister(self.close)
        name = self.config.run_id or time.strftime(f"diffulex-%Y%m%d-%H%M%S-{os.getpid()}")
        trace = self.folder / f"{name}.json"
        try:
            prof.__exit__(None, None, None)
            self.folder.mkdir(parents=True, exist_ok=True)  # in case it was removed since the build
            prof.export_chrome_trace(str(trace))
            sort = "cuda_time_total" if any(a is ProfilerActivity.CUDA for a in prof.activities) else "cpu_time_total"
            (self.folder / f"{name}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
        except Exception as err:  # noqa: BLE001  (the requests must not pay for a lost trace)
            logger.warning("the profiler trace could not be written to %s (%s: %s); the engine goes on serving",
                           trace, type(err).__name__, err)  # fmt: skip
            return
        logger.info("profiler trace of %d engine steps written to %s", self.steps, trace)
