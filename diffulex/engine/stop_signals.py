"""Stop signals in the engine's own helper processes (data-parallel replicas, tensor-parallel workers).

Ctrl-C in a terminal reaches every process of the foreground process group, and a service manager's stop (systemd's
default ``KillMode=control-group``), ``timeout`` or ``kill -TERM -PGID`` sends SIGTERM to every process of the
service. The process that started the helpers decides when they end: a server draining at its first SIGINT or
SIGTERM still needs its replicas and their workers to finish the requests in flight, and then closes them (a
replica's "close", a worker's stop message; `kill` past their wait). So the helpers ignore both signals, and end
by themselves once that process is gone, so that none outlives it (SIGKILL still ends one at once).
"""

from __future__ import annotations

import os
import signal
import threading
import time

# How often a helper looks whether the process that started it still runs.
PARENT_POLL_S = 0.5
# A helper's exit code when it ended because the process that started it was gone.
EXIT_PARENT_GONE = 3


def leave_stop_signals_to_the_parent() -> None:
    """Ignore SIGINT and SIGTERM in this helper process, and end it once the process that started it is gone.

    Only a process of our own does this (its target runs on the main thread); a Ray actor's process is Ray's, and
    Ray stops it."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:  # a process whose parent exits is given another (init or a subreaper)
            time.sleep(PARENT_POLL_S)
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=watch, name="diffulex-parent-watch", daemon=True).start()
