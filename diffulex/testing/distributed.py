"""Helpers for running several ranks on one host: a free port for them to meet at, and the gloo-rank harness the
tensor- and expert-parallel layer tests share (one spawn of every rank, running a list of checks)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

PORT_SEARCH_ATTEMPTS = 64


def free_port() -> int:
    """A TCP port of the loopback interface that nothing listens on now: each group of ranks its own, since a
    closed group's port may linger."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports: data-parallel replicas of tensor-parallel ranks meet at
    ``master_port + replica``, so every port of the run must be free, not only the first (Ray and the other
    replicas open ports of their own)."""
    for _ in range(PORT_SEARCH_ATTEMPTS):
        first = free_port()
        if first + count - 1 <= 65535 and all(_is_free(first + offset) for offset in range(1, count)):
            return first
    raise RuntimeError(f"found no {count} consecutive free ports in {PORT_SEARCH_ATTEMPTS} attempts")


def run_checks(rank: int, out_dir: str, checks: Mapping[str, Callable[[], None]]) -> None:
    """Every check in order on this rank, each one's name appended to the rank's file once it passed; the first
    failure raises (and `torch.multiprocessing.spawn` ends the other ranks)."""
    with open(Path(out_dir) / f"rank{rank}.passed", "a") as passed:
        for name, check in checks.items():
            check()
            passed.write(name + "\n")
            passed.flush()


@dataclass(frozen=True)
class RankRun:
    passed: set[str]  # the checks that passed on every rank
    failure: str  # the failing rank's traceback, empty when none failed


def spawn_ranks(run_rank: Callable[[int, int, str], None], world: int, out_dir: Path) -> RankRun:
    """Spawn ``world`` processes running ``run_rank(rank, port, out_dir)`` (each calling `run_checks`), and read
    back which checks passed on every rank."""
    import torch.multiprocessing as mp

    failure = ""
    try:
        mp.spawn(run_rank, args=(free_port(), str(out_dir)), nprocs=world, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        failure = str(err)
    per_rank = []
    for rank in range(world):
        path = out_dir / f"rank{rank}.passed"
        per_rank.append(set(path.read_text().split()) if path.exists() else set())
    return RankRun(set.intersection(*per_rank), failure)
