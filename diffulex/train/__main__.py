"""``python -m diffulex.train prepare|train ...`` (see docs/training.md)."""

from __future__ import annotations

import argparse
import json
import sys

from diffulex.train.data import DEFAULT_VOCAB_SIZE, TRAIN_SEED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffulex.train", description="train the built-in model")
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write the tokenizer and the token data (needs the 'train' extras)")
    prep.add_argument("--out", required=True)
    prep.add_argument("--n-problems", type=int, default=200_000)
    prep.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    prep.add_argument("--seed", type=int, default=TRAIN_SEED)
    tr = sub.add_parser("train", help="train and export an SDAR checkpoint")
    from diffulex.train.trainer import TrainArgs, add_train_arguments

    add_train_arguments(tr)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        from diffulex.train.data import prepare

        meta = prepare(args.out, n_problems=args.n_problems, vocab_size=args.vocab_size, seed=args.seed)
        print(json.dumps(meta, indent=2))
        return 0
    from diffulex.train.trainer import train

    fields = {k: v for k, v in vars(args).items() if k != "command"}
    train(TrainArgs(**fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
