"""What the host lets the process use (cores, memory) and the CPU thread count chosen from it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from diffulex.engine.cpu_resources import (
    PARAMS_PER_THREAD,
    THREADS_ENV,
    available_memory,
    cgroup_cpu_limit,
    choose_cpu_threads,
    default_cpu_threads,
    threads_from_env,
    usable_cores,
)


def cgroup_v2(root: Path, cpu_max: str | None = None, memory: tuple[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (root / "cpu.max").write_text(cpu_max + "\n")
    if memory is not None:
        (root / "memory.max").write_text(memory[0] + "\n")
        (root / "memory.current").write_text(memory[1] + "\n")
    return root


def cgroup_v1(root: Path, quota: int, period: int = 100_000) -> Path:
    (root / "cpu").mkdir(parents=True, exist_ok=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


def test_the_cgroup_quota_is_read_in_cores_from_either_version(tmp_path):
    assert cgroup_cpu_limit(cgroup_v2(tmp_path / "a", "250000 100000")) == 2.5
    assert cgroup_cpu_limit(cgroup_v2(tmp_path / "b", "max 100000")) is None
    assert cgroup_cpu_limit(cgroup_v1(tmp_path / "c", 150_000)) == 1.5
    assert cgroup_cpu_limit(cgroup_v1(tmp_path / "d", -1)) is None
    assert cgroup_cpu_limit(tmp_path / "nothing-here") is None
    assert cgroup_cpu_limit(cgroup_v2(tmp_path / "e", "garbage")) is None


def test_the_quota_of_the_processs_own_cgroup_is_found_below_the_root(tmp_path):
    cgroup_v2(tmp_path / "root" / "user.slice" / "job.scope", "300000 100000")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/job.scope\n")
    assert cgroup_cpu_limit(tmp_path / "root", proc) == 3.0
    assert cgroup_cpu_limit(tmp_path / "root", tmp_path / "unreadable") is None


def test_usable_cores_are_the_affinity_mask_cut_to_the_rounded_up_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path / "no-cgroup") == affinity
    assert usable_cores(cgroup_v2(tmp_path / "half", "50000 100000")) == 1  # half a core still runs one thread
    assert usable_cores(cgroup_v2(tmp_path / "big", f"{100_000 * (affinity + 8)} 100000")) == affinity


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("num_params", [1, 300_000, 7_300_000, 25_000_001, 1_700_000_000, 30_000_000_000])
def test_the_default_thread_choice_never_oversubscribes_the_cores_it_may_use(tmp_path, cores, num_params):
    """Whatever the model size and quota, the default is between 1 and the usable cores (affinity and quota)."""
    root = cgroup_v2(tmp_path, f"{100_000 * cores} 100000")
    threads, why = choose_cpu_threads(None, num_params, environ={}, root=root)
    assert 1 <= threads <= usable_cores(root) <= cores
    assert threads <= len(os.sched_getaffinity(0))
    assert "usable cores" in why
    unknown, _ = choose_cpu_threads(None, None, environ={}, root=root)
    assert 1 <= unknown <= usable_cores(root)


def test_small_models_get_one_thread_and_large_ones_every_core():
    assert default_cpu_threads(7_300_000, 2) == 1  # the built-in model
    assert default_cpu_threads(PARAMS_PER_THREAD + 1, 16) == 2
    assert default_cpu_threads(1_700_000_000, 16) == 16


def test_an_explicit_choice_wins_over_the_environment_and_the_default(tmp_path):
    root = cgroup_v2(tmp_path, "100000 100000")
    assert choose_cpu_threads(3, 1_000_000_000, environ={THREADS_ENV: "5"}, root=root) == (3, "cpu_threads=3")
    assert choose_cpu_threads(None, 1_000_000_000, environ={THREADS_ENV: "5"}, root=root) == (5, f"{THREADS_ENV}=5")
    assert choose_cpu_threads(None, 1_000_000_000, environ={THREADS_ENV: "x"}, root=root)[0] == 1


@pytest.mark.parametrize(
    ("value", "expected"), [("4", 4), (" 2 ", 2), ("0", None), ("-1", None), ("", None), ("a", None)]
)
def test_only_a_positive_integer_in_the_environment_counts(value, expected):
    assert threads_from_env({THREADS_ENV: value}) == expected
    assert threads_from_env({}) is None


def test_available_memory_is_meminfo_capped_by_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemFree:        1000 kB\nMemAvailable:   4000000 kB\n")
    assert available_memory(meminfo, tmp_path / "no-cgroup") == 4_000_000 * 1024
    limited = cgroup_v2(tmp_path / "v2", memory=(str(3 << 30), str(1 << 30)))
    assert available_memory(meminfo, limited) == 2 << 30
    unlimited = cgroup_v2(tmp_path / "v2max", memory=("max", str(1 << 30)))
    assert available_memory(meminfo, unlimited) == 4_000_000 * 1024
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory" / "memory.usage_in_bytes").write_text("123\n")
    assert available_memory(meminfo, v1) == 4_000_000 * 1024
    assert available_memory(tmp_path / "missing", tmp_path / "no-cgroup") is None


def test_an_explicit_thread_count_is_bounded_by_the_machine():
    from diffulex.engine.cpu_resources import MAX_THREADS_PER_CPU, max_cpu_threads

    assert max_cpu_threads(2) == 2 * MAX_THREADS_PER_CPU and max_cpu_threads(0) == MAX_THREADS_PER_CPU
    most = max_cpu_threads()
    assert choose_cpu_threads(most, None, environ={}) == (most, f"cpu_threads={most}")
    with pytest.raises(ValueError, match="cpu_threads="):
        choose_cpu_threads(max_cpu_threads() + 1, None, environ={})
    with pytest.raises(ValueError, match="OMP_NUM_THREADS="):
        choose_cpu_threads(None, None, environ={"OMP_NUM_THREADS": str(max_cpu_threads() + 1)})
