"""A helper process of the engine leaves SIGINT and SIGTERM to the process that started it, and does not outlive
that process."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

from diffulex.engine.stop_signals import EXIT_PARENT_GONE, leave_stop_signals_to_the_parent

WAIT_S = 20.0


def helper(ready) -> None:
    leave_stop_signals_to_the_parent()
    ready.set()
    time.sleep(WAIT_S)


def test_a_helper_outlasts_the_stop_signals_that_reach_its_whole_group() -> None:
    context = mp.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=helper, args=(ready,), daemon=True)
    process.start()
    try:
        assert ready.wait(WAIT_S)
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(process.pid, sig)
        process.join(1.0)
        assert process.is_alive(), "the signals were the parent's to act on"
    finally:
        process.kill()
        process.join(WAIT_S)


# A parent that starts a helper, prints its pid and exits without a word to it (as one killed would).
ORPHANING_PARENT = f"""
import multiprocessing as mp, os
from tests.engine.test_stop_signals import helper
if __name__ == "__main__":
    context = mp.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=helper, args=(ready,), daemon=True)
    process.start()
    ready.wait({WAIT_S})
    print(process.pid, flush=True)
    os._exit(0)
"""


def test_a_helper_ends_by_itself_once_its_parent_is_gone() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", ORPHANING_PARENT], capture_output=True, text=True, cwd=root,
                         timeout=WAIT_S * 2, env={**os.environ, "PYTHONPATH": root}, check=True)  # fmt: skip
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + WAIT_S / 2
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # gone (reaped by init or a subreaper), long before its sleep would have ended
        if _is_zombie(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"the helper {pid} outlived its parent (expected exit code {EXIT_PARENT_GONE})")


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False
