"""Run a bench script with module attributes overridden, for A/B runs of a tuning constant inside one process.

    PYTHONPATH=. python bench/run_with.py diffulex.kernels.paged_attention._STAGES_SPLIT=2 -- bench/what_if.py --tag x

Each ``module.attr=value`` (the value a Python literal) is set before the script runs as ``__main__``.
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys
from pathlib import Path


def main() -> None:
    split = sys.argv.index("--")
    for item in sys.argv[1:split]:
        target, value = item.split("=", 1)
        module, attr = target.rsplit(".", 1)
        setattr(importlib.import_module(module), attr, ast.literal_eval(value))
    script = sys.argv[split + 1]
    sys.argv = sys.argv[split + 1 :]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
