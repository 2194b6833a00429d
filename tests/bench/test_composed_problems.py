"""The composed word-problem generator: seeded, true worked answers, hundreds of sentence structures per kind,
and held-out wordings that never show up in the training problems."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from diffulex.bench.arithmetic import (
    CONTAINERS,
    DAYS,
    DIST_UNITS,
    GAIN_VERBS,
    ITEMS,
    KINDS,
    LOSE_VERBS,
    NAMES,
    THINGS,
    split_templates,
)
from diffulex.bench.composed_problems import (
    ACTIVITIES,
    MORE_CONTAINERS,
    MORE_GAIN_VERBS,
    MORE_ITEMS,
    MORE_LOSE_VERBS,
    MORE_NAMES,
    MORE_THINGS,
    PIECES,
    POOLS,
    SCENARIOS,
    compose_problem,
    compose_problems,
    main,
    split_pieces,
    structure_count,
)
from diffulex.bench.scoring import process_arithmetic
from tests.bench.test_arithmetic import template_pattern

EQUATION = re.compile(r"^(\d+) ([-+*/]) (\d+) = (\d+) [a-z ]+\.$")
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}
# The answer of each kind from its numbers, written out again here (not read from the generator's solution lines).
EXPECTED = {
    "add": lambda v: v["a"] + v["b"],
    "subtract": lambda v: v["a"] - v["b"],
    "multiply": lambda v: v["a"] * v["b"],
    "divide": lambda v: v["total"] // v["k"],
    "difference": lambda v: v["a"] - v["b"],
    "gain-then-lose": lambda v: v["a"] + v["b"] - v["c"],
    "packs-then-lose": lambda v: v["p"] * v["q"] - v["c"],
    "packs-then-share": lambda v: v["p"] * v["q"] // v["k"],
    "change": lambda v: v["paid"] - v["count"] * v["price"],
    "rate": lambda v: v["r"] * v["n"],
    "sum-of-three": lambda v: v["a"] + v["b"] + v["c"],
    "half-then-gain": lambda v: v["total"] // 2 + v["extra"],
    "more-than-together": lambda v: 2 * v["a"] + v["b"],
}
INPUTS = {  # the numbers the question must state
    "add": "ab", "subtract": "ab", "multiply": "ab", "divide": ("total", "k"), "difference": "ab",
    "gain-then-lose": "abc", "packs-then-lose": "pqc", "packs-then-share": "pqk",
    "change": ("price", "count", "paid"), "rate": "rn", "sum-of-three": "abc", "half-then-gain": ("total", "extra"),
    "more-than-together": "ab",
}  # fmt: skip

# What each placeholder of a piece can become, for matching pieces against generated text.
_ACTIVITY_UNITS = {a[3] for a in ACTIVITIES if "{" not in a[3]}
WORDS: dict[str, list[str]] = {
    "name": list(NAMES + MORE_NAMES), "items": list(ITEMS + MORE_ITEMS),
    "container": [c[0] for c in CONTAINERS + MORE_CONTAINERS],
    "containers": [c[1] for c in CONTAINERS + MORE_CONTAINERS],
    "thing": [t[0] for t in THINGS + MORE_THINGS], "things": [t[1] for t in THINGS + MORE_THINGS],
    "gain": [v[0] for v in GAIN_VERBS + MORE_GAIN_VERBS], "gain_past": [v[1] for v in GAIN_VERBS + MORE_GAIN_VERBS],
    "lose": [v[0] for v in LOSE_VERBS + MORE_LOSE_VERBS], "lose_past": [v[1] for v in LOSE_VERBS + MORE_LOSE_VERBS],
    "gain_ing": [v[2] for v in GAIN_VERBS + MORE_GAIN_VERBS], "lose_ing": [v[2] for v in LOSE_VERBS + MORE_LOSE_VERBS],
    "act": [a[0] for a in ACTIVITIES], "act_base": [a[1] for a in ACTIVITIES], "act_past": [a[2] for a in ACTIVITIES],
    "period": [a[4] for a in ACTIVITIES], "periods": [a[5] for a in ACTIVITIES],
    "runit": sorted(_ACTIVITY_UNITS | set(DIST_UNITS) | set(ITEMS + MORE_ITEMS)), "day": list(DAYS),
}  # fmt: skip
WORDS.update(friend=WORDS["name"], friend2=WORDS["name"], things_cap=WORDS["things"], d1=WORDS["day"])
CLAUSE_BREAK = re.compile(r"(?:\. |\? |: |, and then |, then | and then |, | and |^if | if |^after | after )")


def piece_regex(piece: str) -> str:
    """A piece (its tense tag dropped) as a lowercase regex: numbers are digits, every other placeholder one of
    its words, ``[a|b]`` either wording."""
    text = piece[2:] if piece[1:2] == ":" else piece
    out = []
    for part in re.split(r"(\{[a-z_0-9]+\}|\[[^\]]*\])", text.lower()):
        if part in ("{n}", "{m}"):
            out.append(r"\d+")
        elif part.startswith("{"):
            out.append("(?:" + "|".join(re.escape(w.lower()) for w in WORDS[part[1:-1]]) + ")")
        elif part.startswith("["):
            out.append("(?:" + "|".join(piece_regex(alt) for alt in part[1:-1].split("|")) + ")")
        else:
            out.append(re.escape(part))
    return "".join(out)


def clauses_of(question: str) -> list[str]:
    """The clauses of a question (lowercase), cut at the joints the frames use."""
    return [c for c in CLAUSE_BREAK.split(question.lower().rstrip("?.")) if c]


def fact_pieces(part: dict[str, tuple]) -> list[tuple[str, re.Pattern[str]]]:
    return [(p, re.compile(piece_regex(p) + "$")) for pool, ps in part.items() if not pool.startswith("q-")
            for p in ps]  # fmt: skip


def question_pieces(part: dict[str, tuple]) -> list[tuple[str, re.Pattern[str]]]:
    # a question form ends the question, or comes first and is followed by the facts
    return [(p, re.compile(r"(?:^|\. |, )" + piece_regex(p) + r"(?:[?.]$|[?:] | if | after )"))
            for pool, ps in part.items() if pool.startswith("q-") for p in ps]  # fmt: skip


def test_the_same_seed_gives_the_same_distinct_problems() -> None:
    a = compose_problems(300, seed=7)
    assert a == compose_problems(300, seed=7)
    assert a != compose_problems(300, seed=8)
    assert len({p["question"] for p in a}) == 300
    assert all(set(p) == {"question", "answer"} for p in a)
    assert compose_problems(300, seed=7, pieces="held-out") != a


def test_every_answer_is_the_kinds_result_computed_independently() -> None:
    r = random.Random(0)
    for scenario in SCENARIOS:
        for pieces in ("train", "held-out"):
            for _ in range(60):
                p = compose_problem(r, scenario, pieces)
                assert not set("{}[]|") & set(p.question), p.question
                *lines, last = p.answer.splitlines()
                expected = EXPECTED[scenario.kind](p.numbers)
                assert last == f"#### {expected}", (p.question, p.answer)
                assert 0 <= expected <= 200
                for line in lines:  # the worked solution: true equations ending at the answer
                    m = EQUATION.match(line)
                    assert m and APPLY[m[2]](int(m[1]), int(m[3])) == int(m[4]), line
                assert int(EQUATION.match(lines[-1])[4]) == expected
                stated = re.findall(r"\d+", p.question)
                for slot in INPUTS[scenario.kind]:
                    assert str(p.numbers[slot]) in stated, (slot, p.question)
                assert process_arithmetic(p.as_problem(), [p.answer]) == {"exact_match": 1.0}


def test_held_out_wordings_never_appear_in_training_problems() -> None:
    split = split_pieces()
    held_facts, train_facts = fact_pieces(split["held-out"]), fact_pieces(split["train"])
    held_questions = question_pieces(split["held-out"])
    for problem in compose_problems(4000, seed=11, pieces="train"):
        q = problem["question"].lower()
        assert not [p for p, rx in held_questions if rx.search(q)], q
        for clause in clauses_of(q):
            assert not [p for p, rx in held_facts if rx.match(clause)], (clause, q)
    # the same check finds the held-out wordings in the held-out problems: every question form, most facts
    found = Counter()
    for problem in compose_problems(2000, seed=11, pieces="held-out"):
        q = problem["question"].lower()
        found["question"] += any(rx.search(q) for _, rx in held_questions)
        clauses = clauses_of(q)
        found["held-out fact"] += sum(any(rx.match(c) for _, rx in held_facts) for c in clauses)
        found["training fact"] += sum(any(rx.match(c) for _, rx in train_facts) for c in clauses)
    assert found["question"] == 2000
    assert 0.35 < found["held-out fact"] / (found["held-out fact"] + found["training fact"]) < 0.65, found


def test_a_held_out_wording_differs_in_words_from_every_training_wording() -> None:
    for pool, held in PIECES["held-out"].items():
        for piece in held:
            rx = re.compile(piece_regex(piece) + "$")
            for other in PIECES["train"][pool]:
                sample = re.sub(r"\[([^|\]]*)[^\]]*\]", r"\1", other[2:] if other[1:2] == ":" else other).lower()
                sample = re.sub(r"\{[nm]\}", "7", sample)
                sample = re.sub(r"\{([a-z_0-9]+)\}", lambda m: WORDS[m[1]][0].lower(), sample)
                assert not rx.match(sample), (piece, other)


def test_fact_wordings_are_single_clauses_so_the_frames_can_join_them() -> None:
    for pool, pieces in POOLS.items():
        if not pool.startswith("q-"):
            for piece in pieces:
                text = piece[2:] if piece[1:2] == ":" else piece
                assert len(CLAUSE_BREAK.split(text)) == 1, piece


def test_pieces_are_split_per_pool_by_seed_about_a_quarter_held_out() -> None:
    split = split_pieces()
    assert split == split_pieces() and split_pieces(seed=1) != split
    for pool, pieces in POOLS.items():
        held, train = split["held-out"][pool], split["train"][pool]
        assert sorted(held + train) == sorted(pieces) and not set(held) & set(train)
        assert 1 <= len(held) <= len(train) / 2, pool


def test_every_kind_has_hundreds_of_sentence_structures_in_each_piece_set() -> None:
    for pieces, least in (("train", 500), ("held-out", 50)):
        per_kind = Counter()
        for scenario in SCENARIOS:
            per_kind[scenario.kind] += structure_count(scenario, pieces)
        assert set(per_kind) == set(KINDS)
        assert min(per_kind.values()) >= least, (pieces, per_kind)
    problems = compose_problems(3000, seed=3)
    assert sum(len(p["answer"].splitlines()) == 3 for p in problems) > 1000  # two-step problems


def test_training_problems_never_fit_a_held_out_template() -> None:
    patterns = [template_pattern(t) for t in split_templates()["held-out"]]
    for problem in compose_problems(3000, seed=13, pieces="train"):
        assert not [p.pattern for p in patterns if p.match(problem["question"])], problem["question"]


def test_bad_arguments_name_the_field_and_what_is_allowed(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"n=-1 is invalid: must be an integer >= 0"):
        compose_problems(-1)
    with pytest.raises(ValueError, match=r"pieces='test' is invalid: must be one of train, held-out"):
        compose_problems(3, pieces="test")
    out = tmp_path / "p.json"
    assert main(["--n", "5", "--seed", "2", "--pieces", "held-out", "--out", str(out)]) == 0
    assert out.read_text().count('"question"') == 5
