"""The benchmark config: an ``engine:`` section (engine fields) and an ``eval:`` section (what to run, how).

    engine:
      model_path: /models/SDAR-1.7B-Chat
      decoding_strategy: multi_bd
    eval:
      dataset_name: gsm8k_diffulex
      dataset_limit: 10
      max_tokens: 512

Everything is checked before any weight is loaded, and every error names the key: an unknown key (in either
section or at the top level), a value of the wrong type, a missing ``engine.model_path``. A flat mapping
(no sections) is accepted too: engine field names go to the engine, eval field names to eval.

Engine keys are the fields of `diffulex.config.Config` (docs/configuration.md) plus ``model_path`` (the
checkpoint folder; ``model`` is accepted as the same key) and the old names ``diffusion_block_size``
(``block_size``), ``max_num_seqs`` (``max_num_reqs``) and ``num_kvcache_blocks`` (``num_pages``). The old
strategy names ``multi_block_diffusion``, ``block_diffusion`` and ``fast_dllm`` become ``multi_bd``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffulex.config import FIELD_ALIASES, Config, engine_fields, resolve_field_aliases
from diffulex.sampling_params import MIN_REPETITION_RUN
from diffulex.strategy.strategy import STRATEGIES
from diffulex.validation import check_bool, check_int, check_number, invalid_value
from diffulex.yaml_file import read_yaml_file

logger = logging.getLogger(__name__)

MODEL_KEYS = ("model_path", "model")
SECTIONS = ("engine", "eval")


def _efield(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class EvalConfig:
    """The ``eval:`` section. Defaults are what a run gets when the key is absent."""

    dataset_name: str = _efield(
        "gsm8k_diffulex", "lm-eval task name(s): one name, a comma-separated list or a YAML list."
    )
    dataset_split: str = _efield(
        "test", "Split evaluated: a JSON list file is that split; a JSON object file must have this key."
    )
    dataset_limit: int | None = _efield(None, "Evaluate only the first N examples of each task; null = all.")
    include_path: str | None = _efield(
        None, "Extra directory of task YAMLs, searched besides the bundled tasks (diffulex/bench/tasks)."
    )
    data_file: str | None = _efield(
        None, "JSON file read instead of the task's own data file (exactly one task must be selected)."
    )
    temperature: float = _efield(0.0, "Sampling temperature of every request (0 = greedy).")
    max_tokens: int | None = _efield(
        None, "Generated-token cap of every request; null = the task's max_gen_toks."
    )
    max_nfe: int | None = _efield(None, "Forward cap of every request; null = the engine's automatic cap.")
    max_repetition_run: int | None = _efield(
        None, "Stop a request after this many identical tokens in a row; null = off."
    )
    ignore_eos: bool = _efield(False, "Keep generating past the stop token (fixed-length throughput runs).")
    apply_chat_template: bool = _efield(
        False, "Wrap each prompt in the tokenizer's chat template (chat/instruct models)."
    )
    output_dir: str = _efield("benchmark_results", "Where runs are written.")
    use_run_subdirectory: bool = _efield(
        True, "Write into output_dir/run_<YYYYmmdd_HHMMSS>_<tasks>/ (false: straight into output_dir)."
    )
    save_results: bool = _efield(
        True, "Also write lm-eval results, per-sample outputs and per-request step records."
    )
    allow_code_execution: bool = _efield(
        False, "Allow tasks that execute generated code (HumanEval, MBPP), in a subprocess with a timeout."
    )
    use_tqdm: bool = _efield(True, "Show a progress bar while generating.")

    def __post_init__(self) -> None:
        self.dataset_name = _check_task_names(self.dataset_name)
        _check_str("eval.dataset_split", self.dataset_split)
        if self.dataset_limit is not None:
            check_int("eval.dataset_limit", self.dataset_limit, low=1)
        for name in ("include_path", "data_file"):
            value = getattr(self, name)
            if value is not None:
                _check_str(f"eval.{name}", value)
        self.temperature = check_number("eval.temperature", self.temperature, low=0.0)
        for name, low in (("max_tokens", 1), ("max_nfe", 1), ("max_repetition_run", MIN_REPETITION_RUN)):
            value = getattr(self, name)
            if value is not None:
                check_int(f"eval.{name}", value, low=low)
        _check_str("eval.output_dir", self.output_dir)
        for f in dataclasses.fields(self):
            if f.type == "bool":
                check_bool(f"eval.{f.name}", getattr(self, f.name))
        if self.data_file is not None and len(self.task_names) != 1:
            raise invalid_value(
                "eval.data_file", self.data_file, f"needs exactly one task, got dataset_name={self.dataset_name!r}"
            )

    @property
    def task_names(self) -> list[str]:
        return self.dataset_name.split(",")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise invalid_value(name, value, "must be a non-empty string")
    return value


def _check_task_names(value: Any) -> str:
    """A name, a comma-separated string or a list of names -> ``"a,b"`` (order kept, duplicates dropped)."""
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise invalid_value("eval.dataset_name", value, "must be a task name, a comma-separated string or a list")
    names = list(dict.fromkeys(s.strip() for s in items if s.strip()))
    if not names:
        raise invalid_value("eval.dataset_name", value, "must name at least one task")
    return ",".join(names)


def _nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else its nearest ancestor that does."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _check_creatable_under(name: str, value: str, path: Path) -> None:
    """The folder ``path`` (which need not exist) can be made: its nearest existing ancestor is a writable folder."""
    base = _nearest_existing(path)
    if not base.is_dir():
        raise invalid_value(name, value, f"cannot be created: {str(base)!r} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise invalid_value(name, value, f"cannot be created: the directory {str(base)!r} is not writable")


def check_output_dir(name: str, value: str) -> Path:
    """A directory results will be written into: an existing (writable) directory or one that can be created.
    Checked before any work, so a run never ends on a bad path."""
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise invalid_value(name, value, "is an existing file: must be a directory (or a path to create one)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise invalid_value(name, value, "is a directory that is not writable")
        return path
    _check_creatable_under(name, value, path)
    return path


def check_output_file(name: str, value: str) -> Path:
    """A file a result will be written to: not a directory, writable if it exists, else its folder can be made.
    Checked before any work, so results are never lost to a bad path at the end."""
    path = Path(value).expanduser()
    if path.is_dir():
        raise invalid_value(name, value, "is a directory: must be a file path")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise invalid_value(name, value, "is a file that is not writable")
        return path
    _check_creatable_under(name, value, path.parent)
    return path


# ----------------------------------------------------------------------------------------------------------
# Engine section
# ----------------------------------------------------------------------------------------------------------


def engine_field_names() -> tuple[str, ...]:
    return tuple(f.name for f in engine_fields() if f.name != "model")


def _allowed_types(annotation: Any) -> tuple[type, ...] | None:
    """Python types a YAML value may have for a field annotation; None = not checked here (Config checks)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        out: list[type] = []
        for arg in typing.get_args(annotation):
            if arg is type(None):
                out.append(type(None))
                continue
            allowed = _allowed_types(arg)
            if allowed is None:
                return None
            out.extend(allowed)
        return tuple(out)
    base = origin or annotation
    if base is bool:
        return (bool,)
    if base is int:
        return (int,)
    if base is float:
        return (int, float)
    if base is str:
        return (str,)
    if base in (list, dict):
        return (base,)
    if isinstance(base, type) and dataclasses.is_dataclass(base):
        return (dict, base)
    return None


def _type_name(types_: tuple[type, ...]) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "a mapping", type(None): "null"}
    words = list(dict.fromkeys(names.get(t, t.__name__) for t in types_))
    if "a number" in words and "an integer" in words:
        words.remove("an integer")
    return " or ".join(words)


def check_engine_types(engine: Mapping[str, Any], where: str = "engine") -> None:
    """Reject values of the wrong type by the fields' annotations (no checkpoint needed); Config does the rest."""
    hints = typing.get_type_hints(Config)
    for key, value in engine.items():
        allowed = _allowed_types(hints.get(key))
        if allowed is None:
            continue
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok:
            raise invalid_value(f"{where}.{key}", value, f"must be {_type_name(allowed)}")


def normalize_engine_fields(fields: Mapping[str, Any], where: str = "engine") -> tuple[str | None, dict[str, Any]]:
    """Split off the model path, apply the old key and strategy names, reject unknown keys.

    Returns ``(model_path or None, engine fields)``; the fields are ready for ``Diffulex(model, **fields)``.
    """
    for key in fields:
        if not isinstance(key, str):
            raise ValueError(f"{where} has a non-string key {key!r}")
    # the engine's other names of its fields (`config.FIELD_ALIASES`), and ``model`` for the model path
    model_key, *model_aliases = MODEL_KEYS
    aliases = {**FIELD_ALIASES, **dict.fromkeys(model_aliases, model_key)}
    out = resolve_field_aliases(fields, f"{where}.", aliases)
    model = out.pop(model_key, None)
    known = set(engine_field_names())
    unknown = [key for key in out if key not in known]
    if unknown:
        raise ValueError(
            f"{where} has unknown keys {', '.join(map(repr, sorted(unknown)))}; engine keys are model_path and "
            "the engine fields listed in docs/configuration.md"
        )
    if model is not None and (not isinstance(model, str) or not model):
        raise invalid_value(f"{where}.model_path", model, "must be a path to a checkpoint directory")
    strategy = out.get("decoding_strategy")
    if isinstance(strategy, str) and strategy in STRATEGIES and STRATEGIES.canonical(strategy) != strategy:
        canonical = STRATEGIES.canonical(strategy)
        logger.warning("%s.decoding_strategy=%r is an old name of %r", where, strategy, canonical)
        out["decoding_strategy"] = canonical
    check_engine_types(out, where)
    return model, out


# ----------------------------------------------------------------------------------------------------------
# The whole config
# ----------------------------------------------------------------------------------------------------------


@dataclass
class BenchConfig:
    """A validated benchmark config: the checkpoint, the engine fields for it, and the eval settings."""

    model: str
    engine: dict[str, Any]
    eval: EvalConfig
    source: str | None = None  # the YAML file it came from

    def to_dict(self) -> dict[str, Any]:
        """The YAML layout (``engine:`` with ``model_path`` first, then ``eval:``), JSON-able."""
        return {"engine": {"model_path": self.model, **self.engine}, "eval": self.eval.to_dict()}

    def engine_config(self) -> Config:
        """The engine's own validation of the engine fields (reads config.json, loads no weights)."""
        return Config(self.model, **self.engine)


def split_flat(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A flat mapping -> sections: engine field names (and model_path) to engine, eval names to eval."""
    engine_names = set(engine_field_names()) | set(FIELD_ALIASES) | set(MODEL_KEYS)
    eval_names = set(EvalConfig.names())
    sections: dict[str, dict[str, Any]] = {"engine": {}, "eval": {}}
    unknown = []
    for key, value in data.items():
        if key in eval_names:
            sections["eval"][key] = value
        elif key in engine_names:
            sections["engine"][key] = value
        else:
            unknown.append(str(key))
    if unknown:
        raise ValueError(
            f"config has unknown keys {', '.join(map(repr, sorted(unknown)))}: not an engine field "
            f"(docs/configuration.md) nor an eval key ({', '.join(EvalConfig.names())})"
        )
    return sections


def parse_sections(data: Any, source: str = "config") -> dict[str, dict[str, Any]]:
    """The raw ``engine``/``eval`` sections of a loaded YAML document (copied; nothing validated yet)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{source} must be a mapping with 'engine:' and 'eval:' sections, got {type(data).__name__}")
    if not any(k in SECTIONS for k in data):
        return split_flat(data)
    unknown = sorted(str(k) for k in data if k not in SECTIONS)
    if unknown:
        raise ValueError(
            f"{source} has unknown top-level keys {', '.join(map(repr, unknown))}; allowed: engine, eval"
        )
    out: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section = data.get(name)
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise ValueError(f"{source}: '{name}' must be a mapping, got {type(section).__name__}")
        out[name] = dict(section)
    return out


def build_config(
    sections: Mapping[str, Mapping[str, Any]],
    source: str | None = None,
    check_model: bool = True,
) -> BenchConfig:
    """Validate the sections. ``check_model=False`` checks names and types only (no checkpoint needed, nothing
    on disk looked at); otherwise the checkpoint and the engine fields are checked too, and ``eval.output_dir``
    must be a directory (or a path one can be created at)."""
    model, engine = normalize_engine_fields(sections.get("engine", {}))
    eval_values = dict(sections.get("eval", {}))
    unknown = sorted(set(eval_values) - set(EvalConfig.names()))
    if unknown:
        raise ValueError(
            f"eval has unknown keys {', '.join(map(repr, unknown))}; allowed keys: {', '.join(EvalConfig.names())}"
        )
    eval_cfg = EvalConfig(**eval_values)
    if model is None:
        raise ValueError("engine.model_path is required: the checkpoint directory to benchmark")
    cfg = BenchConfig(model=str(model), engine=engine, eval=eval_cfg, source=source)
    if check_model:
        check_output_dir("eval.output_dir", cfg.eval.output_dir)
        if not Path(cfg.model).is_dir():
            raise ValueError(f"engine.model_path={cfg.model!r} is not an existing directory")
        try:
            cfg.engine_config()
        except (ValueError, TypeError) as err:
            raise ValueError(f"engine: {err}") from None
    return cfg


def merge_overrides(
    sections: Mapping[str, Mapping[str, Any]],
    engine: Mapping[str, Any] | None = None,
    eval: Mapping[str, Any] | None = None,  # noqa: A002  (the section's name)
) -> dict[str, dict[str, Any]]:
    """Command-line values over file values (key by key, after the file's old names are mapped)."""
    merged = {name: dict(sections.get(name, {})) for name in SECTIONS}
    if engine:
        for key, value in engine.items():
            name = FIELD_ALIASES.get(key, key)
            for old, new in FIELD_ALIASES.items():
                if new == name:
                    merged["engine"].pop(old, None)
            if name in MODEL_KEYS:
                for k in MODEL_KEYS:
                    merged["engine"].pop(k, None)
                name = "model_path"
            merged["engine"][name] = value
    if eval:
        merged["eval"].update(eval)
    return merged


def load_bench_config(
    path: str | Path | None,
    engine_overrides: Mapping[str, Any] | None = None,
    eval_overrides: Mapping[str, Any] | None = None,
    check_model: bool = True,
    origins: Mapping[str, str] | None = None,
) -> BenchConfig:
    """Read a YAML file (or start empty), apply overrides, validate.

    An error is prefixed with where the value came from: the file, or, when it names a key an override set, that
    override (``origins`` maps ``"section.key"`` to how it was given, e.g. ``"--set eval.dataset_limit=abc"``;
    without an entry: "the command line")."""
    source = str(path) if path is not None else None
    data = read_yaml_file(str(path)) if path is not None else {}
    try:
        sections = parse_sections(data)
    except ValueError as err:
        raise ValueError(f"{source}: {err}" if source else str(err)) from None
    try:
        return build_config(
            merge_overrides(sections, engine_overrides, eval_overrides), source=source, check_model=check_model
        )
    except ValueError as err:
        origin = _override_named_by(str(err), engine_overrides or {}, eval_overrides or {}, origins or {})
        prefix = origin or source
        raise ValueError(f"{prefix}: {err}" if prefix else str(err)) from None


def _override_named_by(
    message: str, engine: Mapping[str, Any], eval: Mapping[str, Any], origins: Mapping[str, str]  # noqa: A002
) -> str | None:
    """How the override an error message names was given (None: it names none; the value came from the file)."""
    candidates: list[tuple[str, list[str]]] = []
    for key in eval:
        candidates.append((f"eval.{key}", [f"eval.{key}"]))
    for key in engine:
        if key in MODEL_KEYS:
            candidates.append((f"engine.{key}", ["engine.model_path", f"engine.{key}"]))
            continue
        name = FIELD_ALIASES.get(key, key)
        candidates.append((f"engine.{key}", [f"engine.{key}", f"engine.{name}", key, name]))
    for origin_key, spellings in candidates:
        for spelling in dict.fromkeys(spellings):
            if re.search(rf"(?<![\w.]){re.escape(spelling)}(?![\w])", message):
                return origins.get(origin_key, "the command line")
    return None
