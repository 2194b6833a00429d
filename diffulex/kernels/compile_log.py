"""Every Triton compile of a process appended to a JSON-lines file, where ``DIFFULEX_TRITON_COMPILE_LOG`` names one.

Why: on a fresh GPU machine a test suite (or a fleet of engine starts) spends most of its CPU compiling kernel
variants, both in its own processes and in the engines' compile helpers (`diffulex.kernels.parallel_compile`), which
are processes of their own. Each process that calls `log_compiles_from_env` appends one line per compile: the
kernel, the variant's hash, the microseconds, whether the cache had it, which kind of process compiled it and what
``DIFFULEX_TRITON_COMPILE_LOG_TEST`` said there (the test session sets it to the running test; a helper inherits
it from the engine that started it). ``tools/compile_time_report.py`` sums a log.

Lines are appended with one ``write`` each, well under the size Linux appends atomically, so processes can share a
file.
"""

from __future__ import annotations

import json
import os

LOG_ENV = "DIFFULEX_TRITON_COMPILE_LOG"
TEST_ENV = "DIFFULEX_TRITON_COMPILE_LOG_TEST"


def log_compiles_from_env(process: str) -> bool:
    """Have Triton report every compile of this process to the file ``DIFFULEX_TRITON_COMPILE_LOG`` names, marked
    with `process` (what kind of process this is); False where the variable is unset or triton is missing."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return False
    try:
        import triton
    except ImportError:
        return False

    def log_compile(*, src, metadata, metadata_group, times, cache_hit) -> None:  # noqa: ANN001 (Triton's hook)
        micros = times.ir_initialization + sum(us for _, us in times.lowering_stages) + times.store_results
        line = {
            "kernel": metadata.get("name", "?"), "hash": metadata.get("hash"), "us": micros, "hit": cache_hit,
            "test": os.environ.get(TEST_ENV, ""), "process": process,
        }  # fmt: skip
        with open(path, "a") as log:
            log.write(json.dumps(line) + "\n")

    triton.knobs.compilation.listener = log_compile
    return True
