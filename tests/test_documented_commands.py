"""The shell commands of README.md and docs/*.md run as written, the way a user would type them.

The rules (docs/architecture.md, "Documented commands", states them for doc writers):

* Every ```` ```bash ```` block runs, command by command (a trailing backslash continues a line, ``&&`` separates
  commands, ``#`` starts a comment), from the repository root, and each command must exit with 0.
* A block right after a ``<!-- ci: skip, REASON -->`` line is not run; it is reported as skipped with that reason
  (a GPU, a server that runs until interrupted, a long training run). A marker without a reason is an error.
* ``pip install ...`` is not run (the tests run in the environment already installed), nor ``python -m pytest``
  (this suite).
* ``/path/to/NAME`` placeholders stand for a checkpoint folder: they become a tiny random SDAR checkpoint.
* ``$NAME`` and ``${NAME}`` expand as a shell would expand them (unset: empty); ``$OUT``, the output folder a device
  machine hands a command, is a fresh temporary folder, so that no command writes into the checkout.
* ``diffulex`` runs as ``python -m diffulex.cli`` and ``python`` as this interpreter, with one CPU thread per
  process, so that the commands of this checkout run and do not fight over the cores.

A command that runs in the background (``&``) is not supported here: such a block needs the skip marker.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from diffulex.testing.checkpoints import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SKIP_MARKER = re.compile(r"^<!--\s*ci:\s*skip\b\s*,?\s*(?P<reason>.*?)\s*-->$")
PLACEHOLDER = re.compile(r"/path/to/[\w.\-]+")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
VARIABLE = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
COMMAND_TIMEOUT_S = 180


@dataclass(frozen=True)
class ShellBlock:
    source: str  # "docs/serving.md:7"
    text: str
    skip_reason: str | None


def shell_blocks(path: Path) -> list[ShellBlock]:
    """The ```bash blocks of one Markdown file, each with the reason of its skip marker, if it has one."""
    blocks: list[ShellBlock] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        start = i
        previous = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP_MARKER.match(previous)
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        source = f"{path.relative_to(REPO)}:{start + 1}"
        blocks.append(ShellBlock(source, "\n".join(body), marker.group("reason") if marker else None))
        i += 1
    return blocks


def commands(block: str) -> list[list[str]]:
    """The commands of a block as argument lists: continuation lines joined, comments dropped, ``&&`` split."""
    joined = re.sub(r"\\\n\s*", " ", block)
    result: list[list[str]] = []
    for line in joined.splitlines():
        current: list[str] = []
        for token in shlex.split(line, comments=True):
            if token == "&&":
                result.append(current)
                current = []
            else:
                current.append(token)
        if current:
            result.append(current)
    return result


def not_run_by_rule(argv: list[str]) -> bool:
    """Installing packages and running this suite are the two commands the rules leave out."""
    words = [w for w in argv if not ENV_ASSIGNMENT.match(w)]
    return words[:2] == ["pip", "install"] or words[:3] == ["python", "-m", "pytest"]


def as_run_here(argv: list[str], checkpoint: Path, out_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The argument list and environment that run `argv` from this checkout, ``$OUT`` being `out_dir`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "OUT": str(out_dir)}
    # a shell expands the words before the command's own assignments take effect
    argv = [expand_variables(word, env) for word in argv]
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        name, _, value = argv[0].partition("=")
        env[name] = value
        argv = argv[1:]
    if argv and argv[-1] == "&":
        raise AssertionError("a command in the background needs the block's '<!-- ci: skip, REASON -->' marker")
    argv = [PLACEHOLDER.sub(str(checkpoint), word) for word in argv]
    if argv[0] == "diffulex":
        argv = [sys.executable, "-m", "diffulex.cli", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    return argv, env


def expand_variables(word: str, env: dict[str, str]) -> str:
    """``word`` with its ``$NAME`` / ``${NAME}`` replaced by their values in `env` (a name not set: nothing)."""
    return VARIABLE.sub(lambda m: env.get(m.group("braced") or m.group("plain"), ""), word)


BLOCKS = [block for path in DOCUMENTS for block in shell_blocks(path)]


@pytest.fixture(scope="module")
def placeholder_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("docs") / "tiny-sdar", family="sdar", seed=0)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.source for b in BLOCKS])
def test_a_documented_shell_block_runs_as_written(
    block: ShellBlock, placeholder_checkpoint: Path, tmp_path: Path
) -> None:
    if block.skip_reason is not None:
        assert block.skip_reason, f"{block.source}: a skip marker must say why the block cannot run in CI"
        pytest.skip(f"{block.source}: {block.skip_reason}")
    to_run = [argv for argv in commands(block.text) if not not_run_by_rule(argv)]
    if not to_run:
        pytest.skip(f"{block.source}: only package installs or the test suite itself")
    for argv in to_run:
        full, env = as_run_here(argv, placeholder_checkpoint, tmp_path)
        done = subprocess.run(full, cwd=REPO, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, f"{block.source}: {shlex.join(argv)} exited {done.returncode}:\n{done.stderr}"


def test_the_rules_read_commands_as_a_shell_would() -> None:
    block = 'pip install -e ".[x]" && diffulex generate "a b"   # demo\nX=1 python t.py --n 2 \\\n    --out o'
    assert commands(block) == [["pip", "install", "-e", ".[x]"], ["diffulex", "generate", "a b"],
                               ["X=1", "python", "t.py", "--n", "2", "--out", "o"]]
    assert not_run_by_rule(["pip", "install", "-e", "."]) and not_run_by_rule(["python", "-m", "pytest"])
    assert not not_run_by_rule(["python", "-m", "diffulex.cli"])
    argv, env = as_run_here(["X=1", "diffulex", "generate", "--model", "/path/to/ckpt"], Path("/tiny"), Path("/o"))
    assert argv == [sys.executable, "-m", "diffulex.cli", "generate", "--model", "/tiny"] and env["X"] == "1"
    with pytest.raises(AssertionError, match="skip"):
        as_run_here(["diffulex", "serve", "&"], Path("/tiny"), Path("/o"))


def test_documented_output_folders_are_temporary_and_variables_expand_as_in_a_shell() -> None:
    words = ["DOC_N=2", "python", "b.py", "$OUT/after", "--tag", "${OUT}x", "--n", "$DOC_N/a"]
    argv, env = as_run_here(words, Path("/t"), Path("/o"))
    assert argv[1:] == ["b.py", "/o/after", "--tag", "/ox", "--n", "/a"]  # DOC_N is set for the command, not its words
    assert env["OUT"] == "/o" and env["DOC_N"] == "2"


def test_every_document_with_shell_blocks_is_covered() -> None:
    """The README's demo block is among those run, so the first thing a user types is tested."""
    readme = [b for b in BLOCKS if b.source.startswith("README.md")]
    assert readme and readme[0].skip_reason is None
    assert any("diffulex generate" in b.text for b in readme)
