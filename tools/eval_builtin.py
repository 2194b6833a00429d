"""Accuracy and tokens per forward of the built-in model (or any checkpoint given by ``--model``) on unseen
arithmetic problems of the training templates and on problems of the held-out templates, over ``buffer_size``
and ``accept_threshold``; writes a JSON file and a plot. The same as ``python -m diffulex.train eval``
(`diffulex.train.evaluate`); CPU or GPU.

    python tools/eval_builtin.py --n 200 --out docs/data/builtin_sweep.json --plot docs/images/builtin_sweep.png
    python tools/eval_builtin.py --model runs/builtin/checkpoint --n 200 --out eval.json --plot eval.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from diffulex.train.evaluate import add_eval_arguments, run_eval  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_eval_arguments(parser)
    return run_eval(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
