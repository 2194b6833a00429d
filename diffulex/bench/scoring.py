"""What the bundled lm-eval tasks call: the local JSON loader, answer extraction and scoring, code execution.

Task YAMLs refer to these as ``!function diffulex.bench.scoring.<name>``. Nothing here imports lm-eval, so the
scoring rules are unit-tested on their own.

Math answers (GSM8K, MATH500, arithmetic): the prediction is the content of the last ``\\boxed{...}``; else
the text after the last ``####``; else after the last "answer is"; else the last number in the response. Gold
answers are cut after ``####`` when they have one. Prediction and gold are equal when their normalized strings
are equal (LaTeX spacing, ``\\left``/``\\right``, ``\\dfrac``, ``\\text{}``, units of degrees, ``$``, thousands
separators and a trailing period removed) or when both read as the same number (integers, decimals,
``a/b``, ``\\frac{a}{b}``, a trailing ``%`` ignored).

Code answers (HumanEval, MBPP): the program is the first fenced code block of (the task's answer prefix +
the response), or the whole text when there is no fence; it passes when it runs with all of the example's
tests and exits 0 within the time limit, in a separate Python process (``python -I``, an empty temporary
working directory, no GPU visible, memory capped). Code runs only when the benchmark allowed it
(``eval.allow_code_execution``, which sets ``DIFFULEX_ALLOW_CODE_EXECUTION=1`` for the run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

from diffulex.bench import DATA_DIR

CODE_EXECUTION_ENV = "DIFFULEX_ALLOW_CODE_EXECUTION"
CODE_TIMEOUT_MARGIN_S = 5.0  # added to each example's test_time_limit: interpreter start-up
CODE_MEMORY_LIMIT_BYTES = 4 << 30

# ----------------------------------------------------------------------------------------------------------
# Local data
# ----------------------------------------------------------------------------------------------------------


def resolve_data_file(name: str | os.PathLike) -> Path:
    """A bare or relative name is looked up in the bundled data folder first, then from the working directory."""
    path = Path(name).expanduser()
    if not path.is_absolute() and (DATA_DIR / path).is_file():
        return DATA_DIR / path
    return path


def read_split(path: str | os.PathLike, split: str = "test") -> list[dict[str, Any]]:
    """The rows of a JSON data file: a list of objects is the split itself; an object maps split -> list."""
    file = resolve_data_file(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"data file {str(file)!r} does not exist") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"data file {str(file)!r} could not be read: {err}") from None
    if isinstance(data, dict):
        if split not in data:
            raise ValueError(f"data file {str(file)!r} has no split {split!r}; splits: {', '.join(map(str, data))}")
        data = data[split]
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise ValueError(f"data file {str(file)!r} must hold a list of objects (or a mapping split -> list)")
    if not data:
        raise ValueError(f"data file {str(file)!r} has no examples in split {split!r}")
    return data


def load_local_dataset(data_file: str | None = None, **metadata: Any) -> dict[str, Any]:
    """lm-eval ``custom_dataset``: the task's JSON file as a one-split dataset named ``test``.

    ``data_file`` comes from the task YAML's ``dataset_kwargs``; the run's metadata may override it
    (``diffulex_data_file``, from ``eval.data_file``) and choose the split (``diffulex_dataset_split``).
    """
    import datasets

    path = metadata.get("diffulex_data_file") or data_file
    if not path:
        raise ValueError("the task names no data file: set dataset_kwargs.data_file in its YAML or eval.data_file")
    rows = read_split(path, metadata.get("diffulex_dataset_split") or "test")
    return {"test": datasets.Dataset.from_list(rows)}


# ----------------------------------------------------------------------------------------------------------
# Math answers
# ----------------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str:
    """The final answer of a math response (rules in the module docstring); "" when there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    lowered = text.lower()
    k = lowered.rfind("answer is")
    if k >= 0:
        tail = text[k + len("answer is") :].strip().lstrip(":").strip()
        line = tail.split("\n", 1)[0].strip()
        if line:
            return line.rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else ""


def gold_answer(answer: str) -> str:
    """A gold answer: the part after ``####`` when there is one (GSM8K-style solutions)."""
    answer = str(answer)
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


_STRIP_COMMANDS = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\displaystyle")


def normalize_answer(text: str) -> str:
    """Canonical string form of an answer for comparison."""
    s = str(text).strip()
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{\s*([^{}]*)\}", r"\1", s)
    for cmd in _STRIP_COMMANDS:
        s = s.replace(cmd, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "%").replace("\\$", "")
    s = s.replace("$", "")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _as_number(text: str) -> Fraction | None:
    s = normalize_answer(text).rstrip("%")
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+/-?\d+", s):
            num, den = s.split("/")
            return Fraction(int(num), int(den))
        if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def answers_match(prediction: str, gold: str) -> bool:
    """Same normalized string, or the same number."""
    if not prediction.strip():
        return False
    a, b = normalize_answer(prediction), normalize_answer(gold)
    if a == b:
        return True
    x, y = _as_number(prediction), _as_number(gold)
    return x is not None and y is not None and x == y


def _response(results: list[Any]) -> str:
    return results[0] if results and isinstance(results[0], str) else str(results[0] if results else "")


def process_math(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    """lm-eval ``process_results`` of GSM8K / MATH500 (gold in ``ground_truth_answer``)."""
    gold = gold_answer(doc["ground_truth_answer"])
    return {"exact_match": float(answers_match(extract_answer(_response(results)), gold))}


def process_arithmetic(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    """lm-eval ``process_results`` of the arithmetic test set (solution ending in ``#### <answer>``)."""
    gold = gold_answer(doc["answer"])
    return {"exact_match": float(answers_match(extract_answer(_response(results)), gold))}


# ----------------------------------------------------------------------------------------------------------
# Code
# ----------------------------------------------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S)


def extract_code(text: str) -> str:
    """The first fenced code block (a ``python``-tagged one preferred), else the text itself."""
    blocks = _FENCE.findall(text)
    if not blocks:
        return text.strip("\n")
    for lang, body in blocks:
        if lang.lower() in ("python", "py", "python3"):
            return body
    return blocks[0][1]


def code_execution_allowed() -> bool:
    return os.environ.get(CODE_EXECUTION_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _limit_memory() -> None:  # runs in the child before exec
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (CODE_MEMORY_LIMIT_BYTES, CODE_MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):
        pass


def run_program(program: str, timeout_s: float) -> tuple[bool, str]:
    """Run ``program`` in a fresh Python process; (passed, reason). Never raises for the program's faults."""
    if not code_execution_allowed():
        raise RuntimeError(
            "code execution is disabled: set eval.allow_code_execution: true (or --allow-code-execution) to run "
            "tasks that execute generated code"
        )
    with tempfile.TemporaryDirectory(prefix="diffulex_code_") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(program, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", ""), "CUDA_VISIBLE_DEVICES": "", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONHASHSEED": "0"}
        try:
            proc = subprocess.run(
                [sys.executable, "-I", str(script)],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout_s,
                preexec_fn=_limit_memory if os.name == "posix" else None,
            )
        except subprocess.TimeoutExpired:
            return False, f"timeout after {timeout_s:g} s"
    if proc.returncode == 0:
        return True, "passed"
    err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    return False, err[-1] if err else f"exit code {proc.returncode}"


def build_program(doc: dict[str, Any], response: str) -> str:
    """Code extracted from prefix + response, followed by the example's tests."""
    code = extract_code(str(doc.get("prefix") or "") + response)
    tests = doc.get("test_list") or []
    return code + "\n\n" + "\n".join(str(t) for t in tests) + "\n"


def process_code(doc: dict[str, Any], results: list[Any]) -> dict[str, float]:
    """lm-eval ``process_results`` of HumanEval / MBPP: pass@1 of the greedy answer."""
    timeout = float(doc.get("test_time_limit") or 1) + CODE_TIMEOUT_MARGIN_S
    passed, _ = run_program(build_program(doc, _response(results)), timeout)
    return {"pass@1": float(passed)}
