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


# ----- docs/configuration.md against the dataclasses it documents ---------------------------------------------

CONFIGURATION = REPO / "docs" / "configuration.md"
TABLE_NAMES = re.compile(r"^(?:`\w+`(?:, )?)+$")  # a first cell that is only field names: `a`, `b`


def documented_defaults() -> dict[str, dict[str, str]]:
    """Per section of docs/configuration.md, each name of a ``| field | default | ...`` table (or ``threshold`` /
    ``key``) -> the default column as written, without its backticks."""
    tables: dict[str, dict[str, str]] = {}
    section, header = "", None
    for line in CONFIGURATION.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section, header = line[3:].strip(), None
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if header[:2] not in (["field", "default"], ["threshold", "default"], ["key", "default"]):
            continue
        if set(cells[0]) <= {"-"} or not TABLE_NAMES.match(cells[0]):
            continue
        for name in re.findall(r"`(\w+)`", cells[0]):
            tables.setdefault(section, {})[name] = cells[1].strip("`")
    return tables


def shown_default(value: object) -> str:
    """A default as the tables write it: strings in double quotes, everything else as Python prints it."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def dataclass_defaults(cls: type) -> dict[str, str]:
    import dataclasses

    shown = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            shown[f.name] = shown_default(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            shown[f.name] = shown_default(f.default_factory())
        else:
            shown[f.name] = "required"
    return shown


def test_every_engine_field_is_in_a_table_of_configuration_md_with_its_default():
    from diffulex.config import Config, DecodingThresholds, engine_fields

    tables = documented_defaults()
    per_request = {"Decoding thresholds", "Profiler", "Sampling parameters (per request)"}
    documented = {name: default for section, rows in tables.items() if section not in per_request
                  for name, default in rows.items()}
    code = dataclass_defaults(Config)
    # the two fields that take an object have sections of their own, whose tables document the object's keys;
    # the six flat threshold fields are those keys again, "default `None`" in that section's text
    in_own_section = {"decoding_thresholds": "Decoding thresholds", "profiler_config": "Profiler"}
    flat_thresholds = set(dataclass_defaults(DecodingThresholds))
    assert "the six flat fields\nof the same names (default `None`)" in CONFIGURATION.read_text(encoding="utf-8")
    wrong = []
    for f in engine_fields():
        if f.name in in_own_section:
            assert in_own_section[f.name] in tables, f"docs/configuration.md has no section for {f.name}"
        elif f.name in flat_thresholds:
            assert code[f.name] == "None", f"{f.name}: a flat threshold field defaults to None"
        elif documented.get(f.name) != code[f.name]:
            wrong.append(f"{f.name}: documented {documented.get(f.name)!r}, the code's default is {code[f.name]}")
    assert wrong == [], "docs/configuration.md: " + "; ".join(wrong)


@pytest.mark.parametrize("section", ["Decoding thresholds", "Profiler", "Sampling parameters (per request)"])
def test_the_object_tables_of_configuration_md_give_every_key_its_default(section):
    from diffulex import SamplingParams
    from diffulex.config import DecodingThresholds, ProfilerConfig

    cls = {"Decoding thresholds": DecodingThresholds, "Profiler": ProfilerConfig,
           "Sampling parameters (per request)": SamplingParams}[section]
    assert documented_defaults()[section] == dataclass_defaults(cls)


PACKAGE_REGISTRATIONS = """
import json
from diffulex.models.family import FAMILIES
from diffulex.strategy.strategy import STRATEGIES
print(json.dumps({"families": {n: FAMILIES.get(n).default_strategy for n in FAMILIES.names()},
                  "strategies": STRATEGIES.names()}))
"""


@pytest.fixture(scope="module")
def package_registrations() -> dict:
    """The package's own families (with their default strategies) and strategies, read in a fresh interpreter: this
    one's tables also hold what other tests' plugins registered."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PACKAGE_REGISTRATIONS], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_configuration_md_lists_the_registered_families_strategies_and_default_strategies(package_registrations):
    families, strategies = package_registrations["families"], package_registrations["strategies"]
    text = CONFIGURATION.read_text(encoding="utf-8")
    row = {name: line for line in text.splitlines() for name in ("model_name", "decoding_strategy")
           if line.startswith(f"| `{name}` |")}
    allowed = {name: set(re.findall(r"`(\w+)`", line.split("|")[3])) for name, line in row.items()}
    assert allowed["model_name"] == set(families)
    assert allowed["decoding_strategy"] == set(strategies)
    table = text.split("Family default strategies:")[1].split("\n\n")[1]
    documented = {name: strategy for line in table.splitlines()[2:]
                  for strategy in re.findall(r"^\| `(\w+)` \|", line) for name in re.findall(r"`(\w+)`",
                                                                                             line.split("|")[2])}
    assert documented == families


def test_the_strategies_table_of_strategies_md_has_a_row_per_registered_strategy(package_registrations):
    text = (REPO / "docs" / "strategies.md").read_text(encoding="utf-8")
    table = text.split("## Strategies\n")[1].strip().split("\n\n")[0]
    assert set(re.findall(r"^\| `(\w+)` \|", table, re.M)) == set(package_registrations["strategies"])


def test_the_server_flags_table_of_serving_md_lists_every_flag_with_its_default():
    import argparse

    pytest.importorskip("fastapi")
    from diffulex.server.cli import add_serve_flags

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    text = (REPO / "docs" / "serving.md").read_text(encoding="utf-8")
    table = text.split("| flag | default | meaning |")[1].split("\n\n")[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(--[\w-]+)[^`]*` \| ([^|]*) \|", table, re.M)}
    flags = {a.option_strings[0]: a.default for a in parser._actions if a.option_strings[0] not in ("-h", "--config")}
    assert set(rows) == set(flags)
    for flag, default in flags.items():
        documented = re.match(r"`([^`]*)`", rows[flag])
        if default is None:  # described in words: the built-in model, the folder name
            assert documented is None, f"{flag}: documented {rows[flag]}, its default is unset"
            continue
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert documented is not None and documented.group(1) == shown, f"{flag}: documented {rows[flag]}, is {shown}"


# ----- docs/architecture.md against the package's modules -------------------------------------------------------

ARCHITECTURE = REPO / "docs" / "architecture.md"
PYTHON_FILES = sorted(p.relative_to(REPO).as_posix() for folder in ("diffulex", "tests", "examples", "tools", "bench")
                      for p in (REPO / folder).rglob("*.py"))


def architecture_modules_section() -> str:
    return ARCHITECTURE.read_text(encoding="utf-8").split("\n## Modules\n")[1].split("\n## ")[0]


def test_every_python_file_architecture_md_cites_exists():
    """A cited ``*.py`` path names a file of the repository: in full (``tests/test_plugins.py``), relative to the
    package (``engine/scheduler.py``) or to a folder of it (``edit/acceptance.py``), or, without a folder, by a
    file name the package holds (``sse.py`` in the server's row)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    cited = set(re.findall(r"`([\w./-]+\.py)`", text))
    cited |= set(re.findall(r"(?<![\w./-])((?:diffulex|tests|examples|tools|bench)/[\w./-]+\.py)", text))
    names = {Path(p).name for p in PYTHON_FILES if p.startswith("diffulex/")}
    missing = sorted(
        c for c in cited
        if not (any(p == c or p.endswith("/" + c) for p in PYTHON_FILES) if "/" in c else c in names)
    )
    assert missing == [], f"docs/architecture.md cites files that do not exist: {', '.join(missing)}"


def test_every_module_of_the_package_is_in_the_modules_table_of_architecture_md():
    """Each module (package ``__init__``s aside) is named in the "Modules" section: by its path in the package, or
    by its file name or its name in backticks in a row whose first cell is its folder or a file of that folder."""
    section = architecture_modules_section()
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    unmentioned = []
    for path in sorted((REPO / "diffulex").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(REPO / "diffulex").as_posix()
        folder = path.parent.relative_to(REPO / "diffulex").as_posix()
        if f"`{rel}`" in section or f"`diffulex/{rel}`" in section:
            continue
        folder_rows = [row for row in rows if folder != "." and f"`{folder}/" in row.split("|")[1]]
        if any(re.search(rf"(?<!\w){re.escape(path.name)}\b", row) or f"`{path.stem}`" in row for row in folder_rows):
            continue
        unmentioned.append(rel)
    assert unmentioned == [], "docs/architecture.md, Modules: no row names " + ", ".join(unmentioned)
