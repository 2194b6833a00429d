"""Grade-school arithmetic word problems with worked solutions: the test set of the built-in model.

Each problem is ``{"question": ..., "answer": ...}`` where ``answer`` is a short solution whose last line is
``#### <integer>`` (the GSM8K convention). The same seed always gives the same problems, so a training set and
a test set made with different seeds can be checked for overlap by their questions. The task
``arithmetic_diffulex`` prompts with ``"Question: <question>\\nAnswer:"`` and scores the number after ``####``
(or the last number of the response); a model trained on ``"Question: {question}\\nAnswer: {answer}"`` texts
answers in the expected form.

    python -m diffulex.bench.arithmetic --n 500 --seed 1234 --out arithmetic.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

NAMES = ("Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena", "Mateo",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Viktor", "Wen", "Yara", "Zoe")
ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "cards", "stamps", "eggs",
         "balloons", "beads")
THINGS = ("notebook", "sandwich", "toy car", "ticket", "plant", "kite", "cup of juice", "puzzle")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")

Problem = tuple[str, list[str], int]  # question, solution lines, answer


def _add(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 60), r.randint(2, 60)
    q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
    return q, [f"{name} has {a} + {b} = {a + b} {item}."], a + b


def _sub(r: random.Random) -> Problem:
    name, friend = r.sample(NAMES, 2)
    item = r.choice(ITEMS)
    b = r.randint(2, 40)
    a = b + r.randint(1, 60)
    q = f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?"
    return q, [f"{name} has {a} - {b} = {a - b} {item} left."], a - b


def _mul(r: random.Random) -> Problem:
    item = r.choice(ITEMS)
    a, b = r.randint(2, 12), r.randint(2, 12)
    q = f"There are {a} boxes with {b} {item} in each box. How many {item} are there in all?"
    return q, [f"There are {a} * {b} = {a * b} {item}."], a * b


def _div(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    each, k = r.randint(2, 12), r.randint(2, 9)
    total = each * k
    q = f"{name} shares {total} {item} equally among {k} friends. How many {item} does each friend get?"
    return q, [f"Each friend gets {total} / {k} = {each} {item}."], each


def _packs(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    packs, per = r.randint(2, 9), r.randint(3, 12)
    total = packs * per
    used = r.randint(1, total - 1)
    q = (f"{name} buys {packs} packs of {item} with {per} in each pack and then gives away {used}. "
         f"How many {item} are left?")
    lines = [f"{name} buys {packs} * {per} = {total} {item}.", f"{total} - {used} = {total - used} are left."]
    return q, lines, total - used


def _change(r: random.Random) -> Problem:
    name, thing = r.choice(NAMES), r.choice(THINGS)
    price, count = r.randint(2, 15), r.randint(2, 6)
    cost = price * count
    paid = (cost // 10 + 1 + r.randint(0, 3)) * 10
    q = f"A {thing} costs ${price}. {name} buys {count} of them and pays with ${paid}. How much change does {name} get?"
    lines = [f"The {thing}s cost {count} * {price} = ${cost}.", f"The change is {paid} - {cost} = ${paid - cost}."]
    return q, lines, paid - cost


def _distance(r: random.Random) -> Problem:
    speed, hours = r.randint(3, 90), r.randint(2, 8)
    vehicle = r.choice(("A train", "A car", "A cyclist", "A boat"))
    q = f"{vehicle} travels {speed} kilometers every hour. How many kilometers does it travel in {hours} hours?"
    return q, [f"It travels {speed} * {hours} = {speed * hours} kilometers."], speed * hours


def _days(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    d1, d2, d3 = sorted(r.sample(DAYS, 3), key=DAYS.index)
    a, b, c = r.randint(3, 40), r.randint(3, 40), r.randint(3, 40)
    q = f"{name} reads {a} pages on {d1}, {b} pages on {d2} and {c} pages on {d3}. How many pages is that in total?"
    lines = [f"{a} + {b} = {a + b} pages.", f"{a + b} + {c} = {a + b + c} pages in total."]
    return q, lines, a + b + c


def _half(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    half = r.randint(3, 40)
    extra = r.randint(1, 20)
    total = 2 * half
    q = f"{name} has {total} {item}, gives half of them away and then finds {extra} more. How many {item} now?"
    lines = [f"Half of {total} is {total} / 2 = {half}.", f"{half} + {extra} = {half + extra} {item}."]
    return q, lines, half + extra


TEMPLATES: tuple[Callable[[random.Random], Problem], ...] = (
    _add, _sub, _mul, _div, _packs, _change, _distance, _days, _half,
)


def generate_problems(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` distinct problems ``{"question", "answer"}``; the answer's last line is ``#### <integer>``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} is invalid: must be an integer >= 0")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"n={n} is too large: could not make that many distinct problems")
        question, lines, answer = rng.choice(TEMPLATES)(rng)
        if question in seen:
            continue
        seen.add(question)
        out.append({"question": question, "answer": "\n".join([*lines, f"#### {answer}"])})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffulex.bench.arithmetic", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="number of problems (default 200)")
    parser.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    parser.add_argument("--out", default="-", help="JSON file to write ('-' = stdout)")
    args = parser.parse_args(argv)
    try:
        problems = generate_problems(args.n, args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(problems, indent=1, ensure_ascii=False) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {len(problems)} problems to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
