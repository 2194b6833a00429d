"""Grade-school arithmetic word problems with worked solutions: the training data and the test sets of the
built-in model.

Each problem is ``{"question": ..., "answer": ...}`` where ``answer`` is a short worked solution, one equation a
line, whose last line is ``#### <integer>`` (the GSM8K convention that `diffulex.bench.scoring` reads).

A problem is a *kind* (what is computed: add, buy then give away, packs then share, ...) told by one of the
kind's *templates* (a sentence structure). The numbers, names, objects, containers, units and verbs are drawn
per problem; the worked solution depends on the kind only, never on the template, so a model that learned the
kinds can answer a sentence structure it never saw. The templates of every kind are split into a TRAINING set
and a HELD-OUT set by `split_templates`: shuffle the kind's templates with ``random.Random(f"{SPLIT_SEED}/{kind}")``
and hold out the first ``ceil(len / 4)`` (at least one per kind). Every template of a kind has its own
sentence structure, so a held-out template is a structure the model was never trained on (the vocabulary is
shared). The training data uses ``templates="train"`` only; the built-in model's report measures
``templates="train"`` (unseen problems, seen structures) and ``templates="held-out"`` (unseen structures)
separately. The same seed always gives the same problems.

The task ``arithmetic_diffulex`` prompts with ``"Question: <question>\\nAnswer:"``; the model is trained on both
that format and the chat format.

    python -m diffulex.bench.arithmetic --n 500 --seed 1234 --templates held-out --out arithmetic.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SPLIT_SEED = 30  # the seed of the training / held-out template split (see the module docstring)
HELD_OUT_FRACTION = 0.25
TEMPLATE_SETS = ("train", "held-out", "all")
ALTERNATIVES = re.compile(r"\[([^\[\]]*)\]")  # "[now|in all]" in a template: one of the wordings

NAMES = ("Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena", "Mateo",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Viktor", "Wen", "Yara", "Zoe", "Aisha",
         "Bruno", "Carmen", "Diego", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Keiko", "Liam", "Maya",
         "Nikhil", "Olga", "Pablo", "Rahul", "Sofia", "Theo", "Ugo", "Vera", "Will", "Ximena", "Yusuf", "Zara")
ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "cards", "stamps", "eggs",
         "balloons", "beads", "cars", "crayons", "buttons", "coins", "rocks", "flowers", "candles", "cupcakes",
         "oranges", "lemons", "bottles", "ribbons", "erasers", "comics", "seeds", "muffins", "socks", "keys",
         "feathers", "blocks", "badges", "postcards", "plums", "peaches", "toy cars", "paper cranes", "bananas",
         "pebbles")
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"), ("crate", "crates"),
              ("tray", "trays"), ("pack", "packs"), ("carton", "cartons"), ("bucket", "buckets"), ("tin", "tins"))
THINGS = (("notebook", "notebooks"), ("sandwich", "sandwiches"), ("ticket", "tickets"), ("kite", "kites"),
          ("puzzle", "puzzles"), ("cup of juice", "cups of juice"), ("toy car", "toy cars"), ("plant", "plants"),
          ("pen", "pens"), ("hat", "hats"), ("ball", "balls"), ("mug", "mugs"), ("scarf", "scarves"),
          ("comic book", "comic books"))
# (present, past, -ing) of verbs that add to what someone has, and of verbs that take away from it.
GAIN_VERBS = (("gets", "got", "getting"), ("buys", "bought", "buying"), ("finds", "found", "finding"),
              ("receives", "received", "receiving"), ("wins", "won", "winning"),
              ("collects", "collected", "collecting"), ("picks up", "picked up", "picking up"))
LOSE_VERBS = (("gives away", "gave away", "giving away"), ("loses", "lost", "losing"), ("sells", "sold", "selling"),
              ("uses", "used", "using"), ("donates", "donated", "donating"),
              ("trades away", "traded away", "trading away"))
VEHICLES = ("A train", "A car", "A cyclist", "A boat", "A bus", "A runner")
DIST_UNITS = ("kilometers", "miles", "meters")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")

Problem = dict[str, str]


@dataclass(frozen=True)
class Template:
    """One sentence structure of one kind: the question (a format string over the kind's slots, where
    ``[a|b]`` picks one wording per problem) and the unit the solution counts in (a format string too:
    ``"{items}"``, ``"pages"``, ...)."""

    kind: str
    question: str
    unit: str = "{items}"


@dataclass(frozen=True)
class Kind:
    """What a problem computes: ``numbers(rng)`` draws the slot numbers, ``lines`` are the worked solution
    (format strings over the slots and ``{unit}``), ``answer`` names the slot holding the final answer."""

    name: str
    numbers: Callable[[random.Random], dict[str, int]]
    lines: tuple[str, ...]
    answer: str


def _add(r: random.Random) -> dict[str, int]:
    a, b = r.randint(2, 60), r.randint(2, 60)
    return {"a": a, "b": b, "s": a + b}


def _sub(r: random.Random) -> dict[str, int]:
    b = r.randint(2, 40)
    a = b + r.randint(1, 50)
    return {"a": a, "b": b, "d": a - b}


def _mul(r: random.Random) -> dict[str, int]:
    a, b = r.randint(2, 12), r.randint(2, 12)
    return {"a": a, "b": b, "p": a * b}


def _div(r: random.Random) -> dict[str, int]:
    each, k = r.randint(2, 12), r.randint(2, 9)
    return {"total": each * k, "k": k, "each": each}


def _diff(r: random.Random) -> dict[str, int]:
    b = r.randint(2, 50)
    a = b + r.randint(1, 40)
    return {"a": a, "b": b, "d": a - b}


def _gain_lose(r: random.Random) -> dict[str, int]:
    a, b = r.randint(2, 50), r.randint(2, 40)
    c = r.randint(1, a + b - 1)
    return {"a": a, "b": b, "c": c, "s": a + b, "d": a + b - c}


def _packs_lose(r: random.Random) -> dict[str, int]:
    p, q = r.randint(2, 9), r.randint(3, 12)
    c = r.randint(1, p * q - 1)
    return {"p": p, "q": q, "c": c, "t": p * q, "d": p * q - c}


def _packs_share(r: random.Random) -> dict[str, int]:
    while True:
        k, e = r.randint(2, 6), r.randint(2, 10)
        t = k * e
        packs = [p for p in range(2, 10) if t % p == 0 and 2 <= t // p <= 12]
        if packs:
            p = r.choice(packs)
            return {"p": p, "q": t // p, "k": k, "t": t, "e": e}


def _change(r: random.Random) -> dict[str, int]:
    price, count = r.randint(2, 15), r.randint(2, 6)
    cost = price * count
    paid = (cost // 10 + 1 + r.randint(0, 3)) * 10
    return {"price": price, "count": count, "cost": cost, "paid": paid, "change": paid - cost}


def _rate(r: random.Random) -> dict[str, int]:
    rate, n = r.randint(2, 20), r.randint(2, 9)
    return {"r": rate, "n": n, "p": rate * n}


def _sum3(r: random.Random) -> dict[str, int]:
    a, b, c = r.randint(2, 40), r.randint(2, 40), r.randint(2, 40)
    return {"a": a, "b": b, "c": c, "s": a + b, "t": a + b + c}


def _half(r: random.Random) -> dict[str, int]:
    half, extra = r.randint(2, 40), r.randint(1, 20)
    return {"total": 2 * half, "half": half, "extra": extra, "ans": half + extra}


def _more_than(r: random.Random) -> dict[str, int]:
    a, b = r.randint(2, 40), r.randint(2, 30)
    return {"a": a, "b": b, "y": a + b, "t": 2 * a + b}


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("add", _add, ("{a} + {b} = {s} {unit}.",), "s"),
    Kind("subtract", _sub, ("{a} - {b} = {d} {unit}.",), "d"),
    Kind("multiply", _mul, ("{a} * {b} = {p} {unit}.",), "p"),
    Kind("divide", _div, ("{total} / {k} = {each} {unit}.",), "each"),
    Kind("difference", _diff, ("{a} - {b} = {d} {unit}.",), "d"),
    Kind("gain-then-lose", _gain_lose, ("{a} + {b} = {s} {unit}.", "{s} - {c} = {d} {unit}."), "d"),
    Kind("packs-then-lose", _packs_lose, ("{p} * {q} = {t} {unit}.", "{t} - {c} = {d} {unit}."), "d"),
    Kind("packs-then-share", _packs_share, ("{p} * {q} = {t} {unit}.", "{t} / {k} = {e} {unit}."), "e"),
    Kind("change", _change, ("{count} * {price} = {cost} {unit}.", "{paid} - {cost} = {change} {unit}."), "change"),
    Kind("rate", _rate, ("{r} * {n} = {p} {unit}.",), "p"),
    Kind("sum-of-three", _sum3, ("{a} + {b} = {s} {unit}.", "{s} + {c} = {t} {unit}."), "t"),
    Kind("half-then-gain", _half, ("{total} / 2 = {half} {unit}.", "{half} + {extra} = {ans} {unit}."), "ans"),
    Kind("more-than-together", _more_than, ("{a} + {b} = {y} {unit}.", "{a} + {y} = {t} {unit}."), "t"),
)}  # fmt: skip

_T = Template
TEMPLATES: tuple[Template, ...] = (
    _T("add", "{name} has {a} {items} and {gain} {b} more. How many {items} does {name} have [now|in all]?"),
    _T("add", "{name} had {a} {items}. Then {name} {gain_past} {b} more {items}. "
              "How many {items} does {name} have [now|altogether]?"),
    _T("add", "How many {items} does {name} have after starting with {a} and {gain_ing} {b} more?"),
    _T("add", "If {name} has {a} {items} and {gain} {b} more, how many {items} [is that in total|does {name} have]?"),
    _T("add", "There are {a} {items} in a {container}. {name} puts {b} more {items} in it. "
              "How many {items} are in the {container} now?"),
    _T("add", "{name} {gain_past} {b} {items}, adding them to the {a} {items} {name} already had. "
              "How many {items} does {name} have altogether?"),
    _T("add", "Find the number of {items} {name} has now: {name} had {a} and then {gain_past} {b} more."),
    _T("add", "{name} starts the day with {a} {items}. During the day {name} {gain_past} another {b}. "
              "What is the total number of {items} {name} has at the end of the day?"),
    _T("add", "{name}'s collection has {a} {items}. After {name} {gain} {b} more, how big is the collection?"),
    _T("add", "{a} {items} were in the shop this morning and {b} more arrived in the afternoon. "
              "How many {items} [are in the shop now|does the shop have now]?"),
    _T("subtract", "{name} had {a} {items} and {lose_past} {b} of them. How many {items} does {name} have left?"),
    _T("subtract", "{name} has {a} {items}. {name} gives {b} of them to {friend}. "
                   "How many {items} does {name} have [left|now]?"),
    _T("subtract", "How many {items} are left if {name} starts with {a} {items} and {lose} {b}?"),
    _T("subtract", "After {lose_ing} {b} of the {a} {items} {name} had, how many {items} does {name} still have?"),
    _T("subtract", "A {container} holds {a} {items}. {name} takes {b} {items} out of the {container}. "
                   "How many {items} are still in the {container}?"),
    _T("subtract", "There were {a} {items} on the table. {b} of them were taken away. "
                   "How many {items} are on the table now?"),
    _T("subtract", "Work out how many {items} {name} keeps when {name} has {a} {items} and {lose} {b}."),
    _T("subtract", "Out of {a} {items}, {name} {lose_past} {b}. [What number of|How many] {items} remain?"),
    _T("subtract", "{name} needs to get rid of {b} {items} from a pile of {a}. How many {items} stay in the pile?"),
    _T("multiply", "There are {a} {containers} with {b} {items} in each {container}. "
                   "How many {items} are there in all?"),
    _T("multiply", "{name} has {a} {containers}. Each {container} holds {b} {items}. "
                   "How many {items} does {name} have [in total|altogether]?"),
    _T("multiply", "How many {items} are in {a} {containers} if every {container} has {b} {items}?"),
    _T("multiply", "Each {container} contains {b} {items}. {name} fills {a} {containers}. "
                   "How many {items} is that?"),
    _T("multiply", "{name} puts {b} {items} into each of {a} {containers}. What is the total number of {items}?"),
    _T("multiply", "A shop sells {items} in {containers} of {b}. {name} buys {a} {containers}. "
                   "How many {items} does {name} buy?"),
    _T("multiply", "Find the total number of {items} in {a} {containers} holding {b} {items} each."),
    _T("multiply", "{a} children each bring {b} {items} to school. How many {items} do they bring [in all|together]?"),
    _T("divide", "{name} shares {total} {items} equally among {k} friends. How many {items} does each friend get?"),
    _T("divide", "{total} {items} are split evenly into {k} {containers}. How many {items} go in each {container}?"),
    _T("divide", "How many {items} does each of {k} children get if {name} divides {total} {items} "
                 "equally between them?"),
    _T("divide", "{name} has {total} {items} and puts the same number in each of {k} {containers}. "
                 "How many {items} are in each {container}?"),
    _T("divide", "There are {total} {items} and {k} friends. If the friends share the {items} equally, "
                 "how many does each one get?"),
    _T("divide", "Divide {total} {items} equally among {k} {containers}. How many {items} end up in each one?"),
    _T("divide", "A teacher hands out {total} {items} so that each of {k} students gets the same number. "
                 "How many {items} does each student get?"),
    _T("difference", "{name} has {a} {items} and {friend} has {b}. How many more {items} does {name} have "
                     "than {friend}?"),
    _T("difference", "{friend} has {b} {items}. {name} has {a} {items}. How many fewer {items} does {friend} have?"),
    _T("difference", "How many more {items} than {friend} does {name} have if {name} has {a} and {friend} has {b}?"),
    _T("difference", "A {container} holds {a} {items} and a smaller {container} holds {b}. "
                     "How many more {items} are in the bigger one?"),
    _T("difference", "{name} collected {a} {items} while {friend} collected only {b}. "
                     "By how many {items} did {name} beat {friend}?"),
    _T("difference", "What is the difference between {name}'s {a} {items} and {friend}'s {b} {items}?"),
    _T("gain-then-lose", "{name} has {a} {items}, {gain} {b} more and then {lose} {c}. "
                         "How many {items} does {name} have [now|left]?"),
    _T("gain-then-lose", "{name} had {a} {items}. {name} {gain_past} {b} more {items} and later gave {c} to "
                         "{friend}. How many {items} does {name} have left?"),
    _T("gain-then-lose", "How many {items} does {name} have left after starting with {a}, {gain_ing} {b} "
                         "and {lose_ing} {c}?"),
    _T("gain-then-lose", "First {name} {gain_past} {b} {items}, adding to the {a} {items} {name} already had. "
                         "Then {name} {lose_past} {c} of them. How many {items} are left?"),
    _T("gain-then-lose", "A {container} had {a} {items}. {name} added {b} {items} and then took out {c}. "
                         "How many {items} are in the {container} now?"),
    _T("gain-then-lose", "If {name} starts with {a} {items}, {gain} {b} more and {lose} {c}, "
                         "how many {items} does {name} end up with?"),
    _T("gain-then-lose", "On Monday {name} had {a} {items}. On Tuesday {name} {gain_past} {b}, and on Wednesday "
                         "{name} {lose_past} {c}. How many {items} [does {name} have now|are left]?"),
    _T("packs-then-lose", "{name} buys {p} {containers} of {items} with {q} in each {container} and then "
                          "gives away {c}. How many {items} are left?"),
    _T("packs-then-lose", "{name} has {p} {containers} of {items}. Each {container} has {q} {items}. "
                          "{name} {lose_past} {c} of the {items}. How many {items} does {name} have now?"),
    _T("packs-then-lose", "How many {items} are left if {name} opens {p} {containers} of {q} {items} each "
                          "and {lose} {c} of them?"),
    _T("packs-then-lose", "There are {q} {items} in each of {p} {containers}. After {c} {items} are used, "
                          "how many {items} remain?"),
    _T("packs-then-lose", "{name} packed {q} {items} into each of {p} {containers}, then took {c} {items} back "
                          "out. How many {items} are still packed?"),
    _T("packs-then-lose", "A shop gets {p} {containers} of {items}, {q} {items} per {container}, and sells {c} "
                          "of them. How many {items} [does the shop have left|are not sold]?"),
    _T("packs-then-share", "{name} buys {p} {containers} of {items} with {q} in each {container} and shares "
                           "them equally among {k} friends. How many {items} does each friend get?"),
    _T("packs-then-share", "There are {p} {containers} with {q} {items} in each. The {items} are split evenly "
                           "among {k} children. How many {items} does each child get?"),
    _T("packs-then-share", "How many {items} does each of {k} friends get when {name} shares {p} {containers} "
                           "of {q} {items} equally?"),
    _T("packs-then-share", "{name} has {p} {containers}. Each {container} holds {q} {items}. If {name} divides "
                           "all the {items} equally into {k} piles, how many {items} are in each pile?"),
    _T("packs-then-share", "{k} friends share {p} {containers} of {items} equally. Each {container} has {q} "
                           "{items}. How many {items} does each friend get?"),
    _T("packs-then-share", "{name} fills {p} {containers} with {q} {items} each, then empties them and makes "
                           "{k} equal groups. How many {items} are in one group?"),
    _T("change", "A {thing} costs ${price}. {name} buys {count} of them and pays with ${paid}. "
                 "How much change does {name} get?", "dollars"),
    _T("change", "{name} pays for {count} {things} with ${paid}. Each {thing} costs ${price}. "
                 "How much change should {name} get back?", "dollars"),
    _T("change", "How much change does {name} get from ${paid} after buying {count} {things} at ${price} each?",
       "dollars"),
    _T("change", "{name} has ${paid} and buys {count} {things} that cost ${price} each. "
                 "How much money does {name} have left?", "dollars"),
    _T("change", "{things_cap} are ${price} each. If {name} buys {count} {things} and hands over ${paid}, "
                 "how many dollars come back as change?", "dollars"),
    _T("change", "{name} had ${paid} and spent some of it on {count} {things} priced at ${price} each. "
                 "How much money is left?", "dollars"),
    _T("change", "With ${paid} in [a wallet|a pocket], {name} goes shopping and gets {count} {things} for "
                 "${price} apiece. How many dollars does {name} still have?", "dollars"),
    _T("rate", "{vehicle} travels {r} {dist_unit} every hour. How many {dist_unit} does it travel in {n} hours?",
       "{dist_unit}"),
    _T("rate", "{name} reads {r} pages a day. How many pages does {name} read in {n} days?", "pages"),
    _T("rate", "{name} earns {r} dollars for every hour of work. How many dollars does {name} earn in {n} hours?",
       "dollars"),
    _T("rate", "How many {dist_unit} does {name} walk in {n} days if {name} walks {r} {dist_unit} each day?",
       "{dist_unit}"),
    _T("rate", "{name} saves {r} dollars each week. How much money has {name} saved after {n} weeks?", "dollars"),
    _T("rate", "A machine makes {r} {items} per minute. How many {items} does it make in {n} minutes?"),
    _T("rate", "In {n} days, how many {items} does {name} collect when collecting {r} {items} a day?"),
    _T("rate", "For {n} weeks {name} swims {r} laps every week. What is the total number of laps?", "laps"),
    _T("sum-of-three", "{name} reads {a} pages on {d1}, {b} pages on {d2} and {c} pages on {d3}. "
                       "How many pages is that in total?", "pages"),
    _T("sum-of-three", "{name} picked {a} {items} on {d1}, {b} on {d2} and {c} on {d3}. "
                       "How many {items} did {name} pick in all?"),
    _T("sum-of-three", "How many {items} are there altogether in three {containers} holding {a}, {b} and {c} "
                       "{items}?"),
    _T("sum-of-three", "{name} has {a} {items}, {friend} has {b} and {friend2} has {c}. "
                       "How many {items} do they have together?"),
    _T("sum-of-three", "Add up the {items}: {a} in the morning, {b} at noon and {c} in the evening. "
                       "What is the total?"),
    _T("sum-of-three", "On three days {name} ran {a}, {b} and {c} {dist_unit}. "
                       "What is the total distance in {dist_unit}?", "{dist_unit}"),
    _T("sum-of-three", "A class made {a} {items}, then {b} more, then another {c}. "
                       "How many {items} did the class make [in all|altogether]?"),
    _T("half-then-gain", "{name} has {total} {items}, gives half of them away and then finds {extra} more. "
                         "How many {items} [now|does {name} have now]?"),
    _T("half-then-gain", "{name} had {total} {items} and lost half of them. Later {name} {gain_past} {extra} "
                         "more. How many {items} does {name} have?"),
    _T("half-then-gain", "How many {items} does {name} have after giving away half of {total} {items} and then "
                         "getting {extra} more?"),
    _T("half-then-gain", "Half of the {total} {items} in a {container} are taken out. Then {extra} new {items} "
                         "are put in. How many {items} are in the {container}?"),
    _T("half-then-gain", "{name} splits {total} {items} into two equal halves, keeps one half and then {gain} "
                         "{extra} more. How many {items} does {name} have now?"),
    _T("half-then-gain", "Of {total} {items}, {name} sold half. Then {name} {gain_past} {extra} more. "
                         "What number of {items} does {name} own now?"),
    _T("more-than-together", "{name} has {a} {items}. {friend} has {b} more {items} than {name}. "
                             "How many {items} do they have together?"),
    _T("more-than-together", "{friend} has {b} more {items} than {name}, who has {a}. "
                             "How many {items} do the two of them have in all?"),
    _T("more-than-together", "How many {items} do {name} and {friend} have together if {name} has {a} and "
                             "{friend} has {b} more than {name}?"),
    _T("more-than-together", "{name} collected {a} {items}. {friend} collected {b} more than that. "
                             "What is the total number of {items} they collected?"),
    _T("more-than-together", "A red {container} holds {a} {items}. A blue {container} holds {b} {items} more "
                             "than the red one. How many {items} are in both {containers}?"),
    _T("more-than-together", "On {d1} {name} made {a} {items}, and on {d2} {name} made {b} more than on {d1}. "
                             "How many {items} did {name} make on the two days?"),
)  # fmt: skip


def split_templates(templates: tuple[Template, ...] = TEMPLATES, seed: int = SPLIT_SEED) -> dict[str, list[Template]]:
    """``{"train": [...], "held-out": [...]}``: per kind, the templates shuffled by ``Random(f"{seed}/{kind}")``;
    the first ``ceil(HELD_OUT_FRACTION * len)`` (at least one) are held out. Adding a template to one kind
    leaves the split of every other kind unchanged."""
    out: dict[str, list[Template]] = {"train": [], "held-out": []}
    for kind in KINDS:
        own = [t for t in templates if t.kind == kind]
        random.Random(f"{seed}/{kind}").shuffle(own)
        n_held = max(1, math.ceil(HELD_OUT_FRACTION * len(own)))
        out["held-out"] += own[:n_held]
        out["train"] += own[n_held:]
    return out


def question_pattern(template: Template) -> re.Pattern[str]:
    """Every question `template` can tell, as a regex: a slot is any run of words without punctuation (looser
    than the slot's real values, so it also catches near copies of the template), ``[a|b]`` either wording."""

    def regex(text: str) -> str:
        out = []
        for piece in re.split(r"(\{[a-z_0-9]+\}|\[[^\]]*\])", text):
            if piece.startswith("{"):
                out.append("[^,.?:]+?")
            elif piece.startswith("["):
                out.append("(?:" + "|".join(regex(alt) for alt in piece[1:-1].split("|")) + ")")
            else:
                out.append(re.escape(piece))
        return "".join(out)

    return re.compile("^" + regex(template.question) + "$")


def _slots(r: random.Random, template: Template) -> dict[str, object]:
    name, friend, friend2 = r.sample(NAMES, 3)
    container, containers = r.choice(CONTAINERS)
    thing, things = r.choice(THINGS)
    gain, gain_past, gain_ing = r.choice(GAIN_VERBS)
    lose, lose_past, lose_ing = r.choice(LOSE_VERBS)
    d1, d2, d3 = sorted(r.sample(DAYS, 3), key=DAYS.index)
    slots: dict[str, object] = {
        "name": name, "friend": friend, "friend2": friend2, "items": r.choice(ITEMS),
        "container": container, "containers": containers, "thing": thing, "things": things,
        "things_cap": things[0].upper() + things[1:], "gain": gain, "gain_past": gain_past, "gain_ing": gain_ing,
        "lose": lose, "lose_past": lose_past, "lose_ing": lose_ing, "vehicle": r.choice(VEHICLES),
        "dist_unit": r.choice(DIST_UNITS), "d1": d1, "d2": d2, "d3": d3,
    }  # fmt: skip
    slots.update(KINDS[template.kind].numbers(r))
    slots["unit"] = template.unit.format(**slots)
    return slots


def _choose_wording(r: random.Random, text: str) -> str:
    """Each ``[a|b|...]`` of a template replaced by one of its alternatives (same structure, other words)."""
    return ALTERNATIVES.sub(lambda m: r.choice(m.group(1).split("|")), text)


def make_problem(r: random.Random, template: Template) -> Problem:
    """One problem of `template` with fresh numbers and words drawn from `r`."""
    kind = KINDS[template.kind]
    slots = _slots(r, template)
    lines = [line.format(**slots) for line in kind.lines]
    question = _choose_wording(r, template.question).format(**slots)
    return {"question": question, "answer": "\n".join([*lines, f"#### {slots[kind.answer]}"])}


def templates_of(which: str) -> list[Template]:
    """The templates of one set: ``"train"``, ``"held-out"`` or ``"all"``."""
    if which not in TEMPLATE_SETS:
        raise ValueError(f"templates={which!r} is invalid: must be one of {', '.join(TEMPLATE_SETS)}")
    if which == "all":
        return list(TEMPLATES)
    return split_templates()[which]


def generate_problems(n: int, seed: int = 0, templates: str = "all") -> list[Problem]:
    """``n`` distinct problems ``{"question", "answer"}`` from the template set `templates`; the kind is drawn
    uniformly, then one of its templates in the set. The answer's last line is ``#### <integer>``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} is invalid: must be an integer >= 0")
    by_kind: dict[str, list[Template]] = {}
    for t in templates_of(templates):
        by_kind.setdefault(t.kind, []).append(t)
    kinds = list(by_kind)
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"n={n} is too large: could not make that many distinct problems")
        problem = make_problem(rng, rng.choice(by_kind[rng.choice(kinds)]))
        if problem["question"] in seen:
            continue
        seen.add(problem["question"])
        out.append(problem)
    return out


def write_problems(problems: list[Problem], out: str) -> None:
    """The problems as indented JSON to the file ``out`` (its folder made), or to stdout for ``"-"``."""
    text = json.dumps(problems, indent=1, ensure_ascii=False) + "\n"
    if out == "-":
        sys.stdout.write(text)
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text, encoding="utf-8")
    print(f"wrote {len(problems)} problems to {out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffulex.bench.arithmetic", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="number of problems (default 200)")
    parser.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    parser.add_argument("--templates", choices=TEMPLATE_SETS, default="all",
                        help="template set: train, held-out (never trained on) or all (default all)")
    parser.add_argument("--out", default="-", help="JSON file to write ('-' = stdout)")
    args = parser.parse_args(argv)
    try:
        problems = generate_problems(args.n, args.seed, args.templates)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_problems(problems, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
