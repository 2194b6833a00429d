"""The README's Python snippet and demo command, run as a user would run them, answer their questions correctly."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def python_snippet() -> str:
    section = README.split("## Use it from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def demo_prompt() -> str:
    """The prompt of the first command of the README (install, then ``diffulex generate "..."``)."""
    first_command = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    generate = first_command.split("diffulex generate", 1)[1]
    (prompt,) = shlex.split(generate)
    return prompt


def final_answer(text: str) -> int | None:
    match = re.search(r"####\s*(-?\d+)", text)
    return int(match.group(1)) if match else None


def test_the_python_snippet_answers_its_question() -> None:
    snippet = python_snippet()
    assert "There are 6 boxes with 7 pencils in each box." in snippet
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert final_answer(done.stdout) == 6 * 7
    assert "#### 42" in snippet  # what the snippet's comment promises is what it prints


def test_the_demo_command_answers_its_question(capsys) -> None:
    from diffulex.cli import main

    prompt = demo_prompt()
    assert prompt == "There are 6 bags with 8 marbles in each bag. How many marbles are there in all?"
    assert main(["generate", "--quiet", "--num-pages", "64", prompt]) == 0
    assert final_answer(capsys.readouterr().out) == 6 * 8
