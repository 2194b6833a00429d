"""Arithmetic word problems composed from interchangeable pieces: the many-phrasings training data of the
built-in model, and a test set of phrasings it never saw.

`diffulex.bench.arithmetic` tells each kind of problem by a few whole templates, so a small model learns those
sentences rather than the arithmetic. Here a problem is assembled instead:

* a *scenario* (a kind of `diffulex.bench.arithmetic.KINDS`, whose worked solution it reuses unchanged) lists
  its facts in story order, each fact drawn from one or more *pools* of clause wordings, and its question
  pools;
* every fact and the question are drawn independently (in one tense per problem where the pieces have one),
  facts that state independent quantities may come in any order, and a *frame* joins them: separate
  sentences, one joined sentence, the question first, ``If <facts>, <question>?``, ``<question> if
  <facts>?``, the last fact turned into the condition of the question, or the facts as gerunds
  (``<question> after starting with 5 and getting 3 more?``);
* names, objects, containers, bought things, activities and verbs are drawn per problem, and ``[a|b]`` inside
  a piece picks one of its wordings.

A kind is told by thousands of sentence structures (`structure_count`). Each pool is split into TRAINING and
HELD-OUT pieces by `split_pieces` (shuffled by ``random.Random(f"{SPLIT_SEED}/{pool}")``, the first
``ceil(len / 4)`` held out), so held-out clause wordings and question forms never appear in the training
output. ``compose_problems(n, seed, "held-out")`` asks every problem with a held-out question form, and each
fact is told by a held-out wording with probability one half: problems of sentences never trained on. A
training problem that happens to fit one of the held-out templates of `diffulex.bench.arithmetic` is dropped,
so those stay unseen too.

    python -m diffulex.bench.composed_problems --n 20 --pieces held-out
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass

from diffulex.bench.arithmetic import (
    ALTERNATIVES,
    CONTAINERS,
    DAYS,
    DIST_UNITS,
    GAIN_VERBS,
    ITEMS,
    KINDS,
    LOSE_VERBS,
    NAMES,
    SPLIT_SEED,
    THINGS,
    Problem,
    question_pattern,
    templates_of,
    write_problems,
)

PIECE_SETS = ("train", "held-out")
HELD_OUT_FRACTION = 0.25
HELD_OUT_FACT_PROBABILITY = 0.5  # a held-out problem tells each fact by a held-out wording this often
QUESTION_FIRST_PROBABILITY = 0.5  # the "after" frame puts the question before its gerund clauses this often
PRESENT, PAST = "P", "D"  # the tense tag that starts a piece ("P:..." / "D:..."); untagged pieces fit both
IMPERATIVES = ("Find", "Work", "Count", "Tell", "Calculate", "Give")  # question forms that end with "."

MORE_NAMES = ("Abel", "Bea", "Cyrus", "Dmitri", "Esme", "Felix", "Gia", "Hiro", "Isla", "Jamal", "Kira", "Leo",
              "Mira", "Nils", "Oscar", "Pia", "Rex", "Selma", "Tomas", "Ulla", "Vivek", "Wanda", "Xavier",
              "Yoko", "Zain", "Amir", "Bianca", "Cleo", "Dev", "Elena")  # fmt: skip
MORE_ITEMS = ("acorns", "marshmallows", "grapes", "walnuts", "tomatoes", "potatoes", "carrots", "pears",
              "cherries", "magnets", "dice", "puzzles", "candies", "napkins", "tickets", "bricks", "leaves",
              "stones", "toy boats", "glass beads")  # fmt: skip
MORE_CONTAINERS = (("bowl", "bowls"), ("sack", "sacks"), ("drawer", "drawers"), ("shelf", "shelves"),
                   ("envelope", "envelopes"), ("pot", "pots"))  # fmt: skip
MORE_THINGS = (("book", "books"), ("lamp", "lamps"), ("cake", "cakes"), ("toy", "toys"), ("shirt", "shirts"),
               ("bottle of water", "bottles of water"), ("cap", "caps"), ("game", "games"))  # fmt: skip
MORE_GAIN_VERBS = (("earns", "earned", "earning"), ("gathers", "gathered", "gathering"),
                   ("is given", "was given", "being given"))  # fmt: skip
MORE_LOSE_VERBS = (("throws away", "threw away", "throwing away"), ("eats", "ate", "eating"),
                   ("drops", "dropped", "dropping"), ("hands out", "handed out", "handing out"))  # fmt: skip
# (3rd person, base, past, unit, period, periods): what someone does at a steady rate.
ACTIVITIES = (
    ("reads", "read", "read", "pages", "day", "days"),
    ("writes", "write", "wrote", "pages", "day", "days"),
    ("walks", "walk", "walked", "{dist_unit}", "day", "days"),
    ("runs", "run", "ran", "{dist_unit}", "day", "days"),
    ("cycles", "cycle", "cycled", "{dist_unit}", "hour", "hours"),
    ("drives", "drive", "drove", "{dist_unit}", "hour", "hours"),
    ("earns", "earn", "earned", "dollars", "hour", "hours"),
    ("saves", "save", "saved", "dollars", "week", "weeks"),
    ("swims", "swim", "swam", "laps", "week", "weeks"),
    ("collects", "collect", "collected", "{items}", "day", "days"),
    ("makes", "make", "made", "{items}", "minute", "minutes"),
    ("paints", "paint", "painted", "pictures", "week", "weeks"),
    ("plants", "plant", "planted", "trees", "day", "days"),
    ("bakes", "bake", "baked", "muffins", "hour", "hours"),
)

# Clause wordings. ``{n}`` and ``{m}`` are the numbers a scenario binds; ``{name}``, ``{friend}`` and ``{day}``
# may be rebound too (three people, three days). A piece starting with "P:" or "D:" is in the present or the
# past tense; a problem keeps one tense where the pool allows it.
POOLS: dict[str, tuple[str, ...]] = {
    # someone holds a quantity
    "have": (
        "P:{name} has {n} {items}", "D:{name} had {n} {items}", "D:{name} started with {n} {items}",
        "P:{name} owns {n} {items}", "D:at first {name} had {n} {items}",
        "P:{name} keeps {n} {items} in a {container}", "D:{name} had a {container} with {n} {items} in it",
        "P:there are {n} {items} in {name}'s {container}", "D:in the morning {name} had {n} {items}",
        "P:{name} has a collection of {n} {items}", "P:{name} is holding {n} {items}",
        "D:{name} came home with {n} {items}", "P:{name} starts [out|off] with {n} {items}",
        "D:{name} was given {n} {items} [on {d1}|as a present]", "P:{name}'s {container} contains {n} {items}",
        "D:{name} owned {n} {items}",
    ),
    # a quantity nobody in particular holds
    "stock": (
        "P:there are {n} {items} [on the table|in a pile]", "D:there were {n} {items} in a {container}",
        "P:a {container} holds {n} {items}", "D:{n} {items} were [delivered|bought] for the class",
        "P:a shop has {n} {items}", "P:the class has {n} {items}", "D:a teacher brought {n} {items}",
        "P:a pile of {n} {items} sits on the table",
    ),
    "gain": (
        "P:{name} {gain} {n} more", "P:{name} {gain} {n} more {items}", "D:{name} {gain_past} {n} more {items}",
        "D:then {name} {gain_past} another {n}", "P:{friend} gives {name} {n} more {items}",
        "D:{friend} gave {name} {n} more", "D:later {name} {gain_past} {n} {items}",
        "P:{name} adds {n} more {items} to them", "D:{name} added {n} {items} [to the pile|to the {container}]",
        "P:next {name} {gain} {n} more", "D:{n} more {items} were [added|put in]",
        "D:the next day {name} {gain_past} {n} extra {items}", "P:{name} gets {n} more from {friend}",
        "D:{name} was handed {n} more {items} by {friend}", "P:then {n} more {items} arrive",
        "D:{name} {gain_past} {n} [new|extra] ones",
    ),
    "lose": (
        "P:{name} {lose} {n}", "P:{name} {lose} {n} of them", "D:{name} {lose_past} {n} of them",
        "D:then {name} {lose_past} {n} {items}", "P:{name} gives {n} of them to {friend}",
        "D:{name} gave {n} to {friend}", "D:{n} of the {items} got lost", "P:{name} takes {n} away",
        "D:later {name} {lose_past} {n}", "P:{friend} takes {n} of them",
        "D:{n} of them were [given away|used up]", "P:{name} hands {n} [over|out] to friends",
        "D:next {name} {lose_past} {n} {items}", "P:{name} uses up {n} of the {items}",
        "D:{name} removed {n} [of them|from the {container}]",
    ),
    "half": (
        "P:{name} gives half of them away", "D:{name} lost half of them", "D:{name} sold half",
        "P:half of them go to {friend}", "D:{name} kept only half of them",
        "D:then half of the {items} were used", "P:{name} shares half with {friend}",
        "D:{name} gave away half of the {items}", "P:{name} keeps one of two equal halves",
        "D:half of the {items} were taken away",
    ),
    "more-than": (
        "P:{friend} has {n} more {items} than {name}", "D:{friend} had {n} more than {name}",
        "P:{friend} owns {n} more {items} than {name} does", "D:{friend} collected {n} more than that",
        "P:{friend} has {n} {items} more than {name}", "D:{friend} got {n} more {items} than {name} did",
        "P:{friend}'s pile is {n} {items} bigger than {name}'s", "P:{friend} has as many as {name} plus {n}",
    ),
    # containers and what is in each
    "groups": (
        "P:there are {n} {containers}", "P:{name} has {n} {containers}", "D:{name} bought {n} {containers}",
        "P:{name} fills {n} {containers}", "D:{name} packed {n} {containers}", "P:a shelf holds {n} {containers}",
        "D:{n} {containers} were delivered", "P:{name} carries {n} {containers}",
        "D:{name} lined up {n} {containers}",
    ),
    "each": (
        "P:each {container} holds {n} {items}", "P:every {container} has {n} {items} in it",
        "P:there are {n} {items} in each {container}", "D:each {container} had {n} {items}",
        "P:one {container} contains {n} {items}", "P:a {container} fits {n} {items}",
        "D:{name} put {n} {items} in each {container}", "P:the {containers} hold {n} {items} apiece",
        "P:each {container} is filled with {n} {items}",
    ),
    "groups-each": (
        "P:{name} has {n} {containers} of {m} {items}", "P:there are {n} {containers} with {m} {items} in each",
        "D:{name} bought {n} {containers} of {items} with {m} in each", "P:{n} {containers} each hold {m} {items}",
        "P:{name} carries {n} {containers} holding {m} {items} each",
        "D:{name} packed {m} {items} into each of {n} {containers}", "D:{name} got {n} {containers} of {m} {items}",
        "P:{name} opens {n} {containers} of {m} {items} each", "D:a shop received {n} {containers} of {m} {items}",
    ),
    "share-people": (
        "P:{name} shares them equally among {n} friends", "P:{name} divides them [equally|evenly] between {n} children",
        "P:they are shared [equally|fairly] by {n} friends", "D:{name} handed them out so that {n} students each got "
        "the same number", "D:{name} made {n} equal shares", "P:{n} friends share them equally",
        "P:{name} gives the same number to each of {n} cousins", "D:{name} split them evenly among {n} people",
    ),
    "share-containers": (
        "D:{name} split them evenly into {n} {containers}", "D:{name} put the same number in each of {n} {containers}",
        "D:{name} packed them equally into {n} {containers}", "P:they are sorted equally into {n} {containers}",
        "P:{name} fills {n} {containers} with the same number of them",
        "D:they were divided evenly among {n} {containers}",
        "P:{name} places them in {n} {containers} so that each has the same number",
    ),
    # money
    "price": (
        "P:a {thing} costs ${n}", "P:{things_cap} are ${n} each", "P:one {thing} [costs|is] ${n}",
        "P:each {thing} sells for ${n}", "D:the {things} cost ${n} each", "P:the price of a {thing} is ${n}",
        "P:{things} cost ${n} apiece", "D:a {thing} was priced at ${n}",
    ),
    "buy": (
        "P:{name} buys {n} {things}", "D:{name} bought {n} {things}", "D:{name} picked {n} {things}",
        "P:{name} wants {n} {things}", "D:{name} got {n} {things} at the shop", "P:{name} orders {n} {things}",
        "D:{name} chose {n} {things}", "P:{name} takes {n} {things} to the till",
    ),
    "pay": (
        "P:{name} pays with ${n}", "D:{name} handed over ${n}", "P:{name} gives the cashier ${n}",
        "D:{name} paid with ${n}", "P:{name} pays ${n} at the till", "D:{name} gave ${n} to the shopkeeper",
    ),
    "wallet": (
        "P:{name} has ${n}", "D:{name} went shopping with ${n}", "P:{name} brings ${n} to the shop",
        "D:{name} had ${n} in a [wallet|pocket]", "P:{name} has ${n} to spend", "D:{name} saved up ${n}",
    ),
    # steady rates
    "rate": (
        "P:{name} {act} {n} {runit} [every|each] {period}", "P:{name} {act} {n} {runit} a {period}",
        "D:{name} {act_past} {n} {runit} per {period}", "P:every {period} {name} {act} {n} {runit}",
        "P:{name}'s rate is {n} {runit} per {period}", "P:{name} can {act_base} {n} {runit} in one {period}",
        "P:in one {period} {name} {act} {n} {runit}", "D:each {period} {name} {act_past} {n} {runit}",
    ),
    "periods": (
        "P:{name} keeps this up for {n} {periods}", "D:{name} did this for {n} {periods}",
        "P:this goes on for {n} {periods}", "D:{name} kept at it for {n} {periods}",
        "P:{name} does the same for {n} {periods}", "D:that went on for {n} {periods} in a row",
        "P:{name} [works|goes on] like this for {n} {periods}",
    ),
    # one of three days
    "day-amount": (
        "D:on {day} {name} {gain_past} {n} {items}", "D:{name} {gain_past} {n} {items} on {day}",
        "D:{n} {items} [came in|arrived] on {day}", "D:{day} brought {n} {items}",
        "D:on {day} there were {n} new {items}", "D:{name} added {n} {items} on {day}",
        "D:{name}'s count for {day} was {n} {items}",
    ),
    # the same facts as gerund clauses, for "after <clauses>" (no tense)
    "have-ing": (
        "starting with {n} {items}", "having {n} {items} at first", "beginning [the day|the week] with {n} {items}",
        "owning {n} {items} to begin with", "keeping {n} {items} in a {container}", "first collecting {n} {items}",
    ),
    "gain-ing": (
        "{gain_ing} {n} more", "getting {n} more {items}", "adding {n} {items}", "{gain_ing} another {n}",
        "being handed {n} more by {friend}", "then {gain_ing} {n} {items}", "picking up {n} extra {items}",
    ),
    "lose-ing": (
        "{lose_ing} {n}", "{lose_ing} {n} of them", "giving {n} to {friend}", "using up {n} of the {items}",
        "then {lose_ing} {n} {items}", "handing {n} [out|over]", "parting with {n} of the {items}",
    ),
    "half-ing": (
        "giving half of them away", "losing half of them", "keeping only half", "selling half of the {items}",
        "sharing half with {friend}", "passing half of them to {friend}",
    ),
    # question forms
    "q-now": (
        "How many {items} does {name} have now", "How many {items} does {name} end up with",
        "How many {items} has {name} got now", "How many {items} does {name} own now",
        "What number of {items} does {name} have at the end", "How many {items} does {name} have at the end",
        "How many {items} does {name} have after that", "Find how many {items} {name} has now",
        "What is the number of {items} {name} has now",
    ),
    "q-total": (
        "How many {items} does {name} have in total", "What is the total", "How many {items} is that in all",
        "Work out the total number of {items}", "How many {items} does {name} have [altogether|in all]",
        "Count the {items} {name} has now", "What is the total number of {items} {name} has",
        "What is the new total of {items}",
    ),
    "q-left": (
        "How many {items} does {name} have left", "How many {items} are left", "How many {items} remain",
        "How many {items} [does {name} still have|are still there]", "What number of {items} is left",
        "Find how many {items} are left", "How many {items} are still with {name}", "How many {items} does {name} keep",
        "How many {items} are left over",
    ),
    "q-all": (
        "How many {items} are there in all", "How many {items} [are there|is that] in total",
        "What is the total number of {items}", "How many {items} are in the {containers} [altogether|in all]",
        "Find the total number of {items}", "How many {items} are there [altogether|together]",
        "Count all the {items}", "What is the number of {items} in all the {containers}",
        "How many {items} is that",
    ),
    "q-each-person": (
        "How many {items} does each [friend|child|person] get", "How many {items} does each one get",
        "What is the size of each share", "How many {items} are in each share",
        "Find how many {items} each one receives",
        "How many {items} will each of them get", "What number of {items} does each one receive",
        "How many does each get",
    ),
    "q-each-container": (
        "How many {items} go in each {container}", "How many {items} are in each {container}",
        "How many {items} does one {container} hold", "What is the number of {items} in each {container}",
        "Find how many {items} end up in each {container}", "How many {items} [are|end up] in one {container}",
        "How many {items} does each {container} get",
    ),
    "q-more": (
        "How many more {items} does {name} have than {friend}", "How many fewer {items} does {friend} have",
        "By how many {items} does {name} beat {friend}", "What is the difference between their numbers of {items}",
        "How many more does {name} have", "How many {items} [more|extra] does {name} have than {friend}",
        "Find the difference between the two amounts", "How much bigger is {name}'s pile than {friend}'s",
        "How many {items} would {friend} need to have as many as {name}",
    ),
    "q-together": (
        "How many {items} do they have together", "How many {items} do they have [in all|altogether]",
        "What is the total number of {items} they have", "How many {items} are theirs in total",
        "Find how many {items} they have together", "How many {items} do they own [between them|all together]",
        "Together, how many {items} do they have", "What is their total",
    ),
    "q-days": (
        "How many {items} is that [in all|altogether]", "What is the total number of {items} over the three days",
        "Find the total number of {items} for the three days", "How many {items} [are there|were there] in total",
        "What is the sum for the three days", "How many {items} came in over the three days",
        "How many {items} were counted in all",
    ),
    "q-change": (
        "How much change does {name} get", "How much change [should|will] {name} get back",
        "How many dollars [come back|does {name} get back] as change", "What is {name}'s change",
        "How much money [comes back|is returned]", "Find the change {name} receives",
    ),
    "q-money-left": (
        "How much money does {name} have left", "How many dollars does {name} still have", "How much money is left",
        "How many dollars are left [over|after shopping]", "What amount of money does {name} have now",
        "Find how much money {name} has left",
    ),
    "q-rate-total": (
        "How many {runit} does {name} {act_base} [in all|altogether]", "What total of {runit} is that",
        "How many {runit} does that come to", "Find the number of {runit} in all", "How many {runit} does that make",
        "What does that come to in {runit}",
    ),
    "q-rate-in": (
        "How many {runit} does {name} {act_base} in {n} {periods}",
        "How many {runit} [will|can] {name} {act_base} in {n} {periods}",
        "In {n} {periods}, how many {runit} does {name} {act_base}",
        "What is the total number of {runit} after {n} {periods}",
        "Find how many {runit} {name} [will|can] {act_base} in {n} {periods}",
        "How many {runit} are there after {n} {periods}",
        "What does it add up to after {n} {periods}",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Fact:
    """One fact of a story: the pools its wording comes from, and what the pieces' placeholders stand for
    (``{"n": "a"}``: the piece's ``{n}`` is the kind's number ``a``; ``{"name": "friend"}``: another person)."""

    pools: tuple[str, ...]
    binding: tuple[tuple[str, str], ...] = ()
    gerunds: tuple[str, ...] = ()  # pools of the fact as a gerund clause ("after getting 3 more")


@dataclass(frozen=True)
class Scenario:
    """One way to tell a kind: its facts in story order, its question pools, the unit of the worked solution,
    and whether the facts are independent statements that may come in any order."""

    kind: str
    facts: tuple[Fact, ...]
    questions: tuple[str, ...]
    question_binding: tuple[tuple[str, str], ...] = ()
    unit: str = "{items}"
    any_order: bool = False
    sequence: bool = False  # the facts happen one after the other ("..., and then ...")


def _f(pools: str, gerunds: str = "", **binding: str) -> Fact:
    return Fact(tuple(pools.split("|")), tuple(binding.items()), tuple(gerunds.split("|")) if gerunds else ())


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("add", (_f("have", "have-ing", n="a"), _f("gain", "gain-ing", n="b")), ("q-now", "q-total"),
             sequence=True),
    Scenario("add", (_f("stock", n="a"), _f("gain", n="b")), ("q-all",), sequence=True),
    Scenario("subtract", (_f("have", "have-ing", n="a"), _f("lose", "lose-ing", n="b")), ("q-now", "q-left"),
             sequence=True),
    Scenario("subtract", (_f("stock", n="a"), _f("lose", n="b")), ("q-left",), sequence=True),
    Scenario("multiply", (_f("groups", n="a"), _f("each", n="b")), ("q-all",), any_order=True),
    Scenario("multiply", (_f("groups-each", n="a", m="b"),), ("q-all",)),
    Scenario("divide", (_f("have|stock", n="total"), _f("share-people", n="k")), ("q-each-person",), sequence=True),
    Scenario("divide", (_f("have|stock", n="total"), _f("share-containers", n="k")), ("q-each-container",),
             sequence=True),
    Scenario("difference", (_f("have", n="a"), _f("have", n="b", name="friend")), ("q-more",), any_order=True),
    Scenario("gain-then-lose", (_f("have|stock", "have-ing", n="a"), _f("gain", "gain-ing", n="b"),
                                _f("lose", "lose-ing", n="c")),
             ("q-now", "q-left"), sequence=True),
    Scenario("packs-then-lose", (_f("groups-each", n="p", m="q"), _f("lose", n="c")), ("q-left", "q-now"),
             sequence=True),
    Scenario("packs-then-lose", (_f("groups", n="p"), _f("each", n="q"), _f("lose", n="c")), ("q-left",),
             sequence=True),
    Scenario("packs-then-share", (_f("groups-each", n="p", m="q"), _f("share-people", n="k")),
             ("q-each-person",), sequence=True),
    Scenario("packs-then-share", (_f("groups", n="p"), _f("each", n="q"), _f("share-containers", n="k")),
             ("q-each-container",), sequence=True),
    Scenario("change", (_f("price", n="price"), _f("buy", n="count"), _f("pay", n="paid")), ("q-change",),
             unit="dollars", sequence=True),
    Scenario("change", (_f("wallet", n="paid"), _f("buy", n="count"), _f("price", n="price")),
             ("q-money-left",), unit="dollars", sequence=True),
    Scenario("rate", (_f("rate", n="r"), _f("periods", n="n")), ("q-rate-total",), unit="{runit}", sequence=True),
    Scenario("rate", (_f("rate", n="r"),), ("q-rate-in",), question_binding=(("n", "n"),), unit="{runit}"),
    Scenario("sum-of-three", (_f("have", n="a"), _f("have", n="b", name="friend"), _f("have", n="c", name="friend2")),
             ("q-together",)),
    Scenario("sum-of-three", (_f("day-amount", n="a", day="d1"), _f("day-amount", n="b", day="d2"),
                              _f("day-amount", n="c", day="d3")), ("q-days",), sequence=True),
    Scenario("half-then-gain", (_f("have", "have-ing", n="total"), _f("half", "half-ing"),
                                _f("gain", "gain-ing", n="extra")), ("q-now",),
             sequence=True),
    Scenario("more-than-together", (_f("have", n="a"), _f("more-than", n="b")), ("q-together",), sequence=True),
)  # fmt: skip

FRAMES = ("sentences", "joined", "if-first", "if-last", "condition-last", "question-first", "after")


def split_pieces(pools: dict[str, tuple[str, ...]] = POOLS, seed: int = SPLIT_SEED) -> dict[str, dict[str, tuple]]:
    """``{"train": {pool: pieces}, "held-out": {pool: pieces}}``: each pool shuffled by
    ``Random(f"{seed}/{pool}")``, its first ``ceil(HELD_OUT_FRACTION * len)`` pieces held out. A pool is
    split once for every scenario that uses it, so a held-out wording is held out everywhere."""
    out: dict[str, dict[str, tuple]] = {"train": {}, "held-out": {}}
    for name, pieces in pools.items():
        order = list(pieces)
        random.Random(f"{seed}/{name}").shuffle(order)
        n_held = max(1, math.ceil(HELD_OUT_FRACTION * len(order)))
        out["held-out"][name] = tuple(order[:n_held])
        out["train"][name] = tuple(order[n_held:])
    return out


PIECES = split_pieces()  # the split of `POOLS`, read-only


def _tense_of(piece: str) -> str:
    return piece[0] if piece[:2] in (f"{PRESENT}:", f"{PAST}:") else ""


def _text_of(piece: str) -> str:
    return piece[2:] if _tense_of(piece) else piece


def _bind(text: str, binding: tuple[tuple[str, str], ...]) -> str:
    for placeholder, slot in binding:
        text = text.replace("{" + placeholder + "}", "{" + slot + "}")
    return text


def _slots(r: random.Random, scenario: Scenario) -> dict[str, object]:
    name, friend, friend2 = r.sample(NAMES + MORE_NAMES, 3)
    container, containers = r.choice(CONTAINERS + MORE_CONTAINERS)
    thing, things = r.choice(THINGS + MORE_THINGS)
    gain, gain_past, gain_ing = r.choice(GAIN_VERBS + MORE_GAIN_VERBS)
    lose, lose_past, lose_ing = r.choice(LOSE_VERBS + MORE_LOSE_VERBS)
    act, act_base, act_past, runit, period, periods = r.choice(ACTIVITIES)
    d1, d2, d3 = sorted(r.sample(DAYS, 3), key=DAYS.index)
    slots: dict[str, object] = {
        "name": name, "friend": friend, "friend2": friend2, "items": r.choice(ITEMS + MORE_ITEMS),
        "container": container, "containers": containers, "thing": thing, "things": things,
        "things_cap": things[0].upper() + things[1:], "gain": gain, "gain_past": gain_past, "gain_ing": gain_ing,
        "lose": lose, "lose_past": lose_past, "lose_ing": lose_ing, "act": act, "act_base": act_base,
        "act_past": act_past, "period": period, "periods": periods, "dist_unit": r.choice(DIST_UNITS),
        "d1": d1, "d2": d2, "d3": d3,
    }  # fmt: skip
    slots["runit"] = runit.format(**slots)
    slots.update(KINDS[scenario.kind].numbers(r))
    slots["unit"] = scenario.unit.format(**slots)
    return slots


def _capitalize(text: str) -> str:
    return text[:1].upper() + text[1:]


def _lower_first(text: str) -> str:
    """The first word lowercased unless it is a name (a question after ``If ...,``)."""
    word = text.split(" ", 1)[0]
    if word in NAMES or word in MORE_NAMES or word.endswith("'s"):
        return text
    return text[:1].lower() + text[1:]


def _join(clauses: list[str], sequence: bool, r: random.Random) -> str:
    if len(clauses) == 1:
        return clauses[0]
    last = r.choice((" and then ", ", then ")) if sequence else " and "
    if sequence and clauses[-1].startswith("then "):
        last = last.removesuffix("then ")
    return ", ".join(clauses[:-1]) + last + clauses[-1]


@dataclass(frozen=True)
class ComposedProblem:
    """A problem with its provenance: the scenario, the pieces chosen (raw pool text), the frame, and the
    numbers (the kind's slots)."""

    scenario: Scenario
    pieces: tuple[tuple[str, str], ...]  # (pool, piece) for every fact and the question
    frame: str
    numbers: dict[str, int]
    question: str
    answer: str

    def as_problem(self) -> Problem:
        return {"question": self.question, "answer": self.answer}


def _choose(r: random.Random, pools: tuple[str, ...], part: dict[str, tuple], tense: str) -> tuple[str, str]:
    options = [(pool, piece) for pool in pools for piece in part[pool]]
    fitting = [o for o in options if _tense_of(o[1]) in ("", tense)]
    return r.choice(fitting or options)


def compose_problem(r: random.Random, scenario: Scenario, pieces: str = "train") -> ComposedProblem:
    """One problem of `scenario` from the `pieces` set (``"train"`` or ``"held-out"``: see the module
    docstring) with numbers and words drawn from `r`."""
    if pieces not in PIECE_SETS:
        raise ValueError(f"pieces={pieces!r} is invalid: must be one of {', '.join(PIECE_SETS)}")
    train, held = PIECES["train"], PIECES["held-out"]
    tense = r.choice((PRESENT, PAST))
    held_out = pieces == "held-out"
    facts = list(scenario.facts)
    if scenario.any_order:
        r.shuffle(facts)
    q_pool, q_piece = _choose(r, scenario.questions, held if held_out else train, tense)
    question = ALTERNATIVES.sub(lambda m: r.choice(m.group(1).split("|")),
                                _bind(_text_of(q_piece), scenario.question_binding))  # fmt: skip
    imperative = question.split(" ", 1)[0] in IMPERATIVES
    frames = ["sentences", "joined", "question-first"]
    if not imperative and "," not in question:
        frames += ["if-first", "condition-last"] + (["if-last"] if len(facts) <= 2 else [])
        frames += ["after"] if all(f.gerunds for f in facts) and " after " not in question else []
    frame = r.choice(frames)
    chosen: list[tuple[str, str]] = []
    clauses: list[str] = []
    for fact in facts:
        part = held if held_out and r.random() < HELD_OUT_FACT_PROBABILITY else train
        pool, piece = _choose(r, fact.gerunds if frame == "after" else fact.pools, part, tense)
        chosen.append((pool, piece))
        clauses.append(
            ALTERNATIVES.sub(lambda m: r.choice(m.group(1).split("|")), _bind(_text_of(piece), fact.binding))
        )
    chosen.append((q_pool, q_piece))
    end = "." if imperative else "?"
    if frame == "sentences":
        text = " ".join(_capitalize(c) + "." for c in clauses) + " " + _capitalize(question) + end
    elif frame == "joined":
        text = _capitalize(_join(clauses, scenario.sequence, r)) + ". " + _capitalize(question) + end
    elif frame == "question-first":  # "How many ...? <the story>." or "Find ...: <the story>."
        story = _join(clauses, scenario.sequence, r)
        text = _capitalize(question) + (": " + story if imperative else "? " + _capitalize(story)) + "."
    elif frame == "if-first":
        text = "If " + _join(clauses, scenario.sequence, r) + ", " + _lower_first(question) + end
    elif frame == "if-last":
        text = _capitalize(question) + " if " + _join(clauses, scenario.sequence, r) + end
    elif frame == "after":
        joined = _join(clauses, scenario.sequence, r)
        if r.random() < QUESTION_FIRST_PROBABILITY:
            text = _capitalize(question) + " after " + joined + end
        else:
            text = "After " + joined + ", " + _lower_first(question) + end
    else:  # condition-last: the story told, its last fact the condition of the question
        told = "".join(_capitalize(c) + ". " for c in clauses[:-1])
        text = told + "If " + clauses[-1].removeprefix("then ") + ", " + _lower_first(question) + end
    slots = _slots(r, scenario)
    question_text = _capitalize(text.format(**slots))
    kind = KINDS[scenario.kind]
    lines = [line.format(**slots) for line in kind.lines]
    numbers = {k: v for k, v in slots.items() if isinstance(v, int)}
    return ComposedProblem(scenario, tuple(chosen), frame, numbers, question_text,
                           "\n".join([*lines, f"#### {slots[kind.answer]}"]))  # fmt: skip


def compose_problems(n: int, seed: int = 0, pieces: str = "train") -> list[Problem]:
    """``n`` distinct problems ``{"question", "answer"}`` composed from the `pieces` set; the kind is drawn
    uniformly, then one of its scenarios. The same seed always gives the same problems."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r} is invalid: must be an integer >= 0")
    if pieces not in PIECE_SETS:
        raise ValueError(f"pieces={pieces!r} is invalid: must be one of {', '.join(PIECE_SETS)}")
    by_kind: dict[str, list[Scenario]] = {}
    for s in SCENARIOS:
        by_kind.setdefault(s.kind, []).append(s)
    kinds = list(by_kind)
    rng = random.Random(seed)
    # a composed sentence that happens to fit a held-out template would leak it into training
    held_out_templates = [question_pattern(t) for t in templates_of("held-out")] if pieces == "train" else []
    seen: set[str] = set()
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"n={n} is too large: could not make that many distinct problems")
        problem = compose_problem(rng, rng.choice(by_kind[rng.choice(kinds)]), pieces)
        if problem.question in seen:
            continue
        seen.add(problem.question)
        if any(p.match(problem.question) for p in held_out_templates):
            continue
        out.append(problem.as_problem())
    return out


def structure_count(scenario: Scenario, pieces: str = "train") -> int:
    """How many sentence structures `scenario` has in one piece set: each choice of question form, frame and
    fact pieces counted once (fact orders, wordings inside pieces and the words of the slots not counted)."""
    part = PIECES[pieces]
    told = math.prod(sum(len(part[p]) for p in fact.pools) for fact in scenario.facts)
    as_gerunds = math.prod(sum(len(part[p]) for p in fact.gerunds) for fact in scenario.facts)
    count = 0
    for q in (_text_of(q) for pool in scenario.questions for q in part[pool]):
        if q.split(" ", 1)[0] in IMPERATIVES or "," in q:
            count += 3 * told  # sentences, joined, question-first
        else:
            count += (5 + (len(scenario.facts) <= 2)) * told
            count += 2 * as_gerunds if all(f.gerunds for f in scenario.facts) else 0
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffulex.bench.composed_problems",
                                     description=__doc__.split("\n")[0])  # fmt: skip
    parser.add_argument("--n", type=int, default=200, help="number of problems (default 200)")
    parser.add_argument("--seed", type=int, default=1234, help="random seed (default 1234)")
    parser.add_argument("--pieces", choices=PIECE_SETS, default="train",
                        help="piece set: train or held-out (never trained on) (default train)")  # fmt: skip
    parser.add_argument("--out", default="-", help="JSON file to write ('-' = stdout)")
    args = parser.parse_args(argv)
    try:
        problems = compose_problems(args.n, args.seed, args.pieces)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_problems(problems, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
