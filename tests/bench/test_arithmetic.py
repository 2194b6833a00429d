"""The arithmetic word-problem generator: correct worked answers, the training / held-out template split, and
problems that can be traced to exactly one template of the set they were drawn from."""

from __future__ import annotations

import json
import random
import re

import pytest

from diffulex.bench import DATA_DIR
from diffulex.bench.arithmetic import (
    KINDS,
    TEMPLATES,
    Template,
    generate_problems,
    main,
    make_problem,
    split_templates,
)
from diffulex.bench.scoring import process_arithmetic

EQUATION = re.compile(r"^(\d+) ([-+*/]) (\d+) = (\d+) [a-z ]+\.$")
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}


def regex_of(text: str) -> str:
    """A template's question as a regex: a slot matches words without punctuation, ``[a|b]`` either wording."""
    out = []
    for piece in re.split(r"(\{[a-z_0-9]+\}|\[[^\]]*\])", text):
        if piece.startswith("{"):
            out.append("([^,.?:]+?)")  # slot values hold no punctuation
        elif piece.startswith("["):
            out.append("(?:" + "|".join(regex_of(alt) for alt in piece[1:-1].split("|")) + ")")
        else:
            out.append(re.escape(piece))
    return "".join(out)


def template_pattern(t: Template) -> re.Pattern[str]:
    return re.compile("^" + regex_of(t.question) + "$")


PATTERNS = [(t, template_pattern(t)) for t in TEMPLATES]


def templates_matching(question: str) -> list[Template]:
    return [t for t, pattern in PATTERNS if pattern.match(question)]


def test_every_template_gives_a_true_worked_solution_with_a_small_answer() -> None:
    r = random.Random(0)
    for template in TEMPLATES:
        for _ in range(40):
            p = make_problem(r, template)
            *lines, last = p["answer"].splitlines()
            assert not set("{}[]|") & set(p["question"]), p["question"]
            assert last.startswith("#### ")
            answer = int(last[5:])
            assert 0 <= answer <= 200, p
            result = None
            for line in lines:
                m = EQUATION.match(line)
                assert m, f"not an equation line: {line!r}"
                a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
                assert APPLY[op](a, b) == c, line
                result = c
            assert result == answer
            # the first equation's operands come from the question (not from nowhere)
            numbers = set(re.findall(r"\d+", p["question"]))
            a, _, b, _ = EQUATION.match(lines[0]).groups()[:4]
            assert {a, b} - {"2"} <= numbers, (p["question"], lines[0])
            assert process_arithmetic(p, [p["answer"]]) == {"exact_match": 1.0}


def test_template_split_is_seeded_per_kind_and_holds_out_about_a_quarter() -> None:
    split = split_templates()
    train, held = split["train"], split["held-out"]
    assert split == split_templates()
    assert not set(train) & set(held) and len(train) + len(held) == len(TEMPLATES)
    for kind in KINDS:
        n_train = sum(t.kind == kind for t in train)
        n_held = sum(t.kind == kind for t in held)
        assert n_held >= 1 and n_train >= 3, kind
        assert n_held <= n_train, kind
    assert split_templates(seed=1) != split  # the rule depends on its seed
    # each template is its own sentence structure: no question text fits two templates
    assert len({t.question for t in TEMPLATES}) == len(TEMPLATES)


@pytest.mark.parametrize("which", ["train", "held-out"])
def test_problems_come_only_from_their_template_set(which: str) -> None:
    allowed = set(split_templates()[which])
    kinds_seen = set()
    for p in generate_problems(400, seed=5, templates=which):
        matches = templates_matching(p["question"])
        assert len(matches) == 1, (p["question"], matches)
        assert matches[0] in allowed
        kinds_seen.add(matches[0].kind)
    assert kinds_seen == set(KINDS)


def test_problems_vary_in_names_objects_and_structures() -> None:
    problems = generate_problems(2000, seed=3, templates="train")
    first_words = {p["question"].split()[0] for p in problems}
    structures = {templates_matching(p["question"])[0] for p in problems}
    assert len(first_words) > 40  # names, "How", "There", "If", numbers, ...
    assert len(structures) == len(split_templates()["train"])
    assert sum(len(p["answer"].splitlines()) == 3 for p in problems) > 600  # two-step problems


def test_generator_is_deterministic_and_the_shipped_test_file_matches(tmp_path) -> None:
    a = generate_problems(300, seed=7)
    assert a == generate_problems(300, seed=7)
    assert a != generate_problems(300, seed=8)
    assert len({p["question"] for p in a}) == 300
    assert all(set(p) == {"question", "answer"} for p in a)
    out = tmp_path / "a.json"
    assert main(["--n", "200", "--seed", "1234", "--out", str(out)]) == 0
    shipped = json.loads((DATA_DIR / "arithmetic_test.json").read_text())
    assert json.loads(out.read_text()) == shipped == generate_problems(200, 1234)


def test_bad_arguments_name_the_field_and_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"n=-1 is invalid"):
        generate_problems(-1, 0)
    with pytest.raises(ValueError, match=r"templates='test' is invalid: must be one of train, held-out, all"):
        generate_problems(3, 0, templates="test")
