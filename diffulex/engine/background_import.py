"""Importing a module in a background thread while the build does other work.

The tokenizer's module imports transformers (1-2 s of pure Python on a first use); the device's initialisation and
the weights' load spend most of their time outside the interpreter's lock (driver calls, file reads, copies), so
the import runs beside them. The thread only imports: the tokenizer itself is loaded afterwards on the build's own
thread, where its warnings filters cannot hide another thread's warnings. A failed import is raised where the
build waits for the module, as if it had been imported there.
"""

from __future__ import annotations

import importlib
import threading
import time
from types import ModuleType


class BackgroundImport:
    """`importlib.import_module(name)` started now on a daemon thread; `wait` returns the module or raises."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seconds = 0.0  # how long the import took on its thread
        self._module: ModuleType | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"diffulex-import-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self._module = importlib.import_module(self.name)
        except BaseException as err:  # noqa: BLE001  (handed to the waiting thread, which raises it)
            self._error = err
        self.seconds = time.perf_counter() - start

    def wait(self) -> ModuleType:
        """The imported module, once its thread is done; the import's own exception if it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._module  # type: ignore[return-value]  (set whenever no error was)
