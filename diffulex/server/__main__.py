"""``python -m diffulex.server [flags]``: the same as ``diffulex serve [flags]``."""

from __future__ import annotations

import sys

from diffulex.server.cli import build_parser


def main(argv: list[str] | None = None) -> int:
    from diffulex.cli import report_warnings_once

    report_warnings_once()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
