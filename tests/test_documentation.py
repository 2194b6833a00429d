"""The tree holds what the documentation uses: every measurement file and image is cited by a document, and every
measurement script is listed in docs/benchmarks.md with a docstring saying what it measures."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = sorted([*(REPO / "bench").glob("*.py"), *(REPO / "tools").glob("*.py")])
CITED_FILE = re.compile(r"[\w.{},*-]+\.(?:json|png)")


def expand_braces(name: str) -> list[str]:
    """``a_{x,y}_{1,2}.json`` -> the four names it stands for (the shell's brace expansion)."""
    parts = re.split(r"\{([^{}]*)\}", name)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*options)]


def cited_file_names() -> set[str]:
    text = "\n".join(path.read_text(encoding="utf-8") for path in DOCUMENTS)
    return {Path(name).name for token in CITED_FILE.findall(text) for name in expand_braces(token)}


def test_brace_expansion_reads_like_the_shell():
    assert expand_braces("m_{h100,h200}_mb{1,2}.json") == [
        "m_h100_mb1.json", "m_h100_mb2.json", "m_h200_mb1.json", "m_h200_mb2.json"]
    assert expand_braces("plain.json") == ["plain.json"]


@pytest.mark.parametrize("folder", ["docs/data", "docs/images"])
def test_every_measurement_file_and_image_is_cited_by_a_document(folder):
    cited = cited_file_names()
    uncited = sorted(p.name for p in (REPO / folder).iterdir() if p.is_file() and p.name not in cited)
    assert uncited == [], f"{folder}: no document cites {', '.join(uncited)} (cite it or remove it)"


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_measurement_script_says_what_it_measures_and_is_listed(script):
    docstring = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8")))
    assert docstring, f"{script.relative_to(REPO)} has no docstring saying what it measures"
    listing = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert f"`{script.relative_to(REPO)}`" in listing, f"docs/benchmarks.md does not list {script.relative_to(REPO)}"
