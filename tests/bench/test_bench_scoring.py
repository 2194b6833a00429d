"""Answer extraction and scoring of the bundled tasks, sandboxed code execution."""

from __future__ import annotations

import json

import pytest

from diffulex.bench import DATA_DIR, TASKS_DIR
from diffulex.bench.scoring import (
    CODE_EXECUTION_ENV,
    answers_match,
    build_program,
    extract_answer,
    extract_code,
    gold_answer,
    process_arithmetic,
    process_code,
    process_math,
    read_split,
    run_program,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the total is \\boxed{36}.", "36"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("3 + 5 = 8 marbles.\n#### 8", "8"),
        ("The answer is 42.", "42"),
        ("we get 12 then 15 apples", "15"),
        ("nothing numeric", ""),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("pred", "gold", "same"),
    [
        ("36", "36", True),
        ("36.0", "36", True),
        ("1,000", "1000", True),
        ("$18", "18", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac12", "\\frac{1}{2}", True),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
        ("90^\\circ", "90", True),
        ("\\text{(C)}", "(C)", True),
        ("35", "36", False),
        ("", "0", False),
    ],
)
def test_answers_match(pred, gold, same):
    assert answers_match(pred, gold) is same


def test_process_math_and_arithmetic():
    assert process_math({"ground_truth_answer": "36"}, ["... so \\boxed{36}"]) == {"exact_match": 1.0}
    assert process_math({"ground_truth_answer": "36"}, ["\\boxed{35}"]) == {"exact_match": 0.0}
    doc = {"question": "q", "answer": "3 + 5 = 8 marbles.\n#### 8"}
    assert gold_answer(doc["answer"]) == "8"
    assert process_arithmetic(doc, [" She has 3 + 5 = 8.\n#### 8"]) == {"exact_match": 1.0}
    assert process_arithmetic(doc, [" 3 + 5 = 9"]) == {"exact_match": 0.0}


def test_extract_code():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nmore") == "def f():\n    return 1"
    assert extract_code("```\nx = 1\n```") == "x = 1"
    assert extract_code("```python\ndef f():\n    return 2") == "def f():\n    return 2"  # unclosed fence
    assert extract_code("def g(): pass") == "def g(): pass"


def test_code_execution_needs_the_switch(monkeypatch):
    monkeypatch.delenv(CODE_EXECUTION_ENV, raising=False)
    with pytest.raises(RuntimeError, match="allow_code_execution"):
        run_program("print(1)", 5)


def test_code_tasks_score_real_solutions(monkeypatch):
    monkeypatch.setenv(CODE_EXECUTION_ENV, "1")
    mbpp = json.loads((DATA_DIR / "MBPP.json").read_text())[0]  # remove first and last occurrence of a char
    good = "\ndef remove_Occ(s, ch):\n    i = s.find(ch)\n    if i >= 0:\n        s = s[:i] + s[i + 1:]\n" \
           "    j = s.rfind(ch)\n    if j >= 0:\n        s = s[:j] + s[j + 1:]\n    return s\n```"
    assert process_code(mbpp, [good]) == {"pass@1": 1.0}
    assert process_code(mbpp, ["\ndef remove_Occ(s, ch):\n    return s\n```"]) == {"pass@1": 0.0}
    humaneval = json.loads((DATA_DIR / "HumanEval.json").read_text())[0]  # has_close_elements; prefix = signature
    body = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n```"
    assert process_code(humaneval, [body]) == {"pass@1": 1.0}
    assert "check(has_close_elements)" in build_program(humaneval, body)


def test_code_execution_times_out_and_is_isolated(monkeypatch, tmp_path):
    monkeypatch.setenv(CODE_EXECUTION_ENV, "1")
    assert run_program("while True:\n    pass\n", 1.0) == (False, "timeout after 1 s")
    ok, reason = run_program("import os\nassert os.environ.get('CUDA_VISIBLE_DEVICES') == ''\nraise SystemExit(3)", 5)
    assert not ok and reason == "exit code 3"
    ok, reason = run_program("assert 1 == 2, 'nope'", 5)
    assert not ok and "AssertionError: nope" in reason


def test_read_split(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps([{"q": 1}]))
    (tmp_path / "splits.json").write_text(json.dumps({"dev": [{"q": 2}], "test": [{"q": 3}]}))
    assert read_split(tmp_path / "list.json", "anything") == [{"q": 1}]
    assert read_split(tmp_path / "splits.json", "dev") == [{"q": 2}]
    with pytest.raises(ValueError, match="no split 'train'"):
        read_split(tmp_path / "splits.json", "train")
    with pytest.raises(ValueError, match="does not exist"):
        read_split(tmp_path / "missing.json")
    assert len(read_split("GSM8K.json")) == 1319  # bare names resolve to the bundled data folder


def test_every_task_yaml_has_its_data_file():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    names = set()
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        cfg = yaml.load(path.read_text(), Loader=Loader)  # noqa: S506  (our own loader, safe base)
        names.add(cfg["task"])
        assert (DATA_DIR / cfg["dataset_kwargs"]["data_file"]).is_file(), path.name
        assert cfg["output_type"] == "generate_until"
        assert cfg.get("unsafe_code", False) == (cfg["task"] in ("humaneval_diffulex", "mbpp_diffulex"))
    assert names == {"gsm8k_diffulex", "math500_diffulex", "humaneval_diffulex", "mbpp_diffulex",
                     "arithmetic_diffulex"}
    assert (DATA_DIR / "README.md").read_text().count("CC-BY-4.0") >= 1
