"""What the host lets this process use: cores and memory, and the CPU thread count chosen from them.

A parallel region waits for its slowest thread, so a thread that is not running stalls the whole step: on a
2-core machine with other work running, torch's default thread count made a built-in-model step 1451 ms instead
of 19 ms with one thread. torch's default is the machine's core count, which ignores a container's CPU quota; the
core count here is the smallest of the affinity mask (``os.sched_getaffinity``) and the cgroup CPU quota (v2
``cpu.max``, v1 ``cpu.cfs_quota_us``), and the default thread count never exceeds it. Small models get fewer
threads still: below `PARAMS_PER_THREAD` parameters per thread, a thread's share of a decode step's matrix
products does not pay for its fork and join.

Memory is read the same way (``MemAvailable``, capped by a cgroup memory limit), for the CPU page pool.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
# One thread per this many parameters. The built-in model (7.3M) gains little from a second thread on two quiet
# cores (a batch-1 step 8.8 ms against 9.7 ms) and loses many times that when another process holds one of them,
# so it, and anything up to this size, runs on one thread; billion-parameter models get every usable core.
PARAMS_PER_THREAD = 25_000_000
# Threads an explicit count may ask for per logical CPU (`max_cpu_threads`).
MAX_THREADS_PER_CPU = 4
THREADS_ENV = "OMP_NUM_THREADS"
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value; anything this large is no limit.
_NO_MEMORY_LIMIT = 1 << 60


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroup_v2_dir(root: Path, proc_cgroup: Path) -> Path:
    """This process's cgroup v2 folder (``0::/path`` in ``/proc/self/cgroup``) under ``root``; ``root`` itself in
    a container, where the process's cgroup is mounted there, or when there is nothing to read."""
    for line in (_read(proc_cgroup) or "").splitlines():
        if line.startswith("0::"):
            own = root / line[3:].lstrip("/")
            if (own / "cpu.max").is_file():
                return own
    return root


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The cgroup CPU quota in cores (``2.5`` = 250 ms per 100 ms period), or None when there is none to read."""
    v2 = _read(_own_cgroup_v2_dir(root, proc_cgroup) / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota == "max":
            return None
        try:
            return int(quota) / int(period or 100_000)
        except ValueError:
            return None
    quota, period = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cores(root: Path = CGROUP_ROOT) -> int:
    """Cores this process may run on at once: its affinity mask, rounded-up cgroup quota, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit(root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def threads_from_env(environ: dict[str, str] | None = None) -> int | None:
    """An explicit ``OMP_NUM_THREADS`` (a positive integer), else None; anything else is ignored, as OpenMP does."""
    value = (os.environ if environ is None else environ).get(THREADS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def default_cpu_threads(num_params: int, cores: int) -> int:
    """Threads for a model of ``num_params`` parameters on ``cores`` usable cores: one per `PARAMS_PER_THREAD`
    parameters (at least one), never more than the cores."""
    return max(1, min(cores, math.ceil(num_params / PARAMS_PER_THREAD)))


def max_cpu_threads(logical_cpus: int | None = None) -> int:
    """The most threads an explicit count may ask for: `MAX_THREADS_PER_CPU` per logical CPU of the machine. A
    count above the usable cores is kept with a warning, but thousands of OpenMP threads fail to start (libgomp
    ends the process) or crash it."""
    return MAX_THREADS_PER_CPU * max(1, logical_cpus if logical_cpus is not None else os.cpu_count() or 1)


def choose_cpu_threads(
    requested: int | None, num_params: int | None, environ: dict[str, str] | None = None, root: Path = CGROUP_ROOT
) -> tuple[int, str]:
    """The thread count and why: the engine field ``cpu_threads`` if set, else ``OMP_NUM_THREADS`` if set, else
    `default_cpu_threads` on the `usable_cores` (all of them for a model of unknown size, ``num_params=None``).
    An explicit count above `max_cpu_threads` is refused, naming where it came from."""
    from_env = threads_from_env(environ) if requested is None else None
    if requested is not None or from_env is not None:
        threads = requested if requested is not None else from_env
        why = f"cpu_threads={threads}" if requested is not None else f"{THREADS_ENV}={threads}"
        if threads > max_cpu_threads():
            raise ValueError(
                f"{why} is invalid: must be at most {max_cpu_threads()} ({MAX_THREADS_PER_CPU} per logical CPU of "
                "this machine)"
            )
        return threads, why
    cores = usable_cores(root)
    if num_params is None:
        return cores, f"a model of unknown size on {cores} usable cores"
    return default_cpu_threads(num_params, cores), f"{num_params / 1e6:.1f}M parameters on {cores} usable cores"


def available_memory(meminfo: Path = MEMINFO, root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the process could still allocate: ``MemAvailable``, capped by the cgroup memory limit minus its
    usage; None when neither can be read (not Linux)."""
    candidates = []
    text = _read(meminfo)
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            candidates.append(int(line.split()[1]) * 1024)
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),
    ):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None or usage is None or not limit.isdigit() or not usage.isdigit():
            continue
        if int(limit) < _NO_MEMORY_LIMIT:
            candidates.append(max(0, int(limit) - int(usage)))
        break
    return min(candidates) if candidates else None
