"""What every target of ``diffulex bench sweep`` shares: its settings and budget, the context handed to each target
(device, measured peaks, checkpoint folders, log), and the helpers of their tables and plots. Apart from the driver
(`diffulex.bench.sweep`) so that the target modules it runs import these without importing it back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TARGETS = ("batch", "prefill", "strategies", "moe", "start", "serving", "dp")
# The parts of the ``prefill`` target (``--prefill-parts``): time to first token with the prefix-cache hit, and
# decoders beside a chunked prefill.
PREFILL_PARTS = ("ttft", "beside")
# What a sweep without --targets runs: every target a one-device machine can run (``dp`` needs two devices).
DEFAULT_TARGETS = ("batch", "prefill", "strategies", "moe", "start", "serving")
# Each target's share of ``--total-seconds``: about the engines it builds (builds dominate a short sweep): batch 4,
# prefill 4, strategies 10, moe 2 of the largest geometries (weighed as 4), start 2 fresh processes, serving 3,
# dp 2 servers of 1 and 2 replicas (weighed as 4).
TARGET_WEIGHTS = {"batch": 4.0, "prefill": 4.0, "strategies": 10.0, "moe": 4.0, "start": 3.0, "serving": 3.0,
                  "dp": 4.0}
DEFAULT_TARGET_SECONDS = 120.0
QUICK_TARGET_SECONDS = 60.0


class Budget:
    """The seconds one target may spend: configurations start only while some are left."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.perf_counter()

    @property
    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    @property
    def spent(self) -> bool:
        return self.left <= 0


@dataclass
class SweepSettings:
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    out: str = "sweep"
    quick: bool = False
    max_seconds: float = DEFAULT_TARGET_SECONDS  # per target
    total_seconds: float | None = None  # the whole sweep: each target gets at most its share of what is left
    data_dir: str | None = None  # SDAR-4B-Chat config and tokenizer (the GPU geometries)
    engine_overrides: dict[str, Any] = field(default_factory=dict)  # applied to every engine the sweep builds
    prefill_parts: list[str] = field(default_factory=lambda: list(PREFILL_PARTS))  # what the prefill target runs

    def __post_init__(self) -> None:
        from diffulex.validation import check_number

        if not self.targets:
            raise ValueError(f"targets is empty: give at least one of {', '.join(TARGETS)}")
        for target in self.targets:
            if target not in TARGETS:
                raise ValueError(f"targets: {target!r} is invalid: must be one of {', '.join(TARGETS)}")
        self.targets = [t for t in TARGETS if t in self.targets]  # one order, each once
        if not self.prefill_parts or any(part not in PREFILL_PARTS for part in self.prefill_parts):
            raise ValueError(f"prefill_parts={self.prefill_parts!r} is invalid: must name one or more of "
                             f"{', '.join(PREFILL_PARTS)}")
        self.prefill_parts = [p for p in PREFILL_PARTS if p in self.prefill_parts]
        check_number("max_seconds", self.max_seconds, low=0.0, low_open=True)
        if self.total_seconds is not None:
            check_number("total_seconds", self.total_seconds, low=0.0, low_open=True)

    def target_seconds(self, elapsed: float, targets_left: Sequence[str]) -> float:
        """The budget of the next target (the first of `targets_left`): ``max_seconds``, or less with
        ``total_seconds``: its share (`TARGET_WEIGHTS`) of the time left among the targets left, so time a target
        did not use, or overran, moves to the others."""
        if self.total_seconds is None:
            return self.max_seconds
        share = TARGET_WEIGHTS[targets_left[0]] / sum(TARGET_WEIGHTS[t] for t in targets_left)
        return min(self.max_seconds, max(self.total_seconds - elapsed, 0.0) * share)


@dataclass
class SweepContext:
    """What every target shares: the device, its measured peaks, the checkpoint folders, the log."""

    settings: SweepSettings
    device: torch.device
    peaks: Any  # diffulex.bench.hardware.HardwarePeaks
    workdir: Path
    log: Callable[[str], None] = print
    budget: Budget = field(default_factory=lambda: Budget(DEFAULT_TARGET_SECONDS))
    _folders: dict[str, Path] = field(default_factory=dict)

    @property
    def quick(self) -> bool:
        return self.settings.quick

    def checkpoint(self, name: str) -> tuple[Path, str]:
        """The folder of geometry `name` (`diffulex.bench.sweep_models.MODELS`), written once per run, and the
        load format to build it with."""
        from diffulex.bench.sweep_models import write_model

        if name not in self._folders:
            self._folders[name] = write_model(name, self.workdir / name, self.settings.data_dir)
        folder = self._folders[name]
        return folder, "safetensors" if any(folder.glob("*.safetensors")) else "dummy"

    def flops_per_s(self, dtype: torch.dtype) -> float:
        from diffulex.bench.hardware import add_matmul_peak

        return add_matmul_peak(self.peaks, self.device, dtype, self.quick)

    def engine_fields(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        return {**fields, **self.settings.engine_overrides}


def device_for(overrides: Mapping[str, Any]) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    ids = overrides.get("device_ids") or []
    return torch.device("cuda", ids[0] if ids else overrides.get("device_start", 0))


def engine_dtype(device: torch.device, overrides: Mapping[str, Any]) -> torch.dtype:
    """bfloat16 on CUDA, float32 on CPU (the engine's own default for these checkpoints), unless ``dtype`` says."""
    dtype = overrides.get("dtype", "auto")
    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give freed memory back once an engine is gone (outside any ``except`` block)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def skipped(row: dict[str, Any]) -> dict[str, Any]:
    """A configuration not started because its target's budget was spent."""
    return {**row, "error": None, "skipped": "budget (--max-seconds) spent"}


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def device_info(device: torch.device) -> dict[str, Any]:
    import platform

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})"
    return {"name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpu_threads": torch.get_num_threads()}


def plot_axes(ncols: int, title: str) -> tuple[Any, Any, list[Any]]:
    """A figure of `ncols` panels (matplotlib, Agg); raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5), squeeze=False)
    fig.suptitle(title)
    return plt, fig, list(axes[0])


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
