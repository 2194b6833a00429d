"""``python -m diffulex.server [flags]``: the same as ``diffulex serve [flags]``."""

from __future__ import annotations

import sys

from diffulex.server.cli import build_parser


def main(argv: list[str] | None = None) -> int:
    from diffulex.cli import report_warnings_once, run_command

    report_warnings_once()
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
