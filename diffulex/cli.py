"""Command line: ``diffulex generate [--model DIR] [--config FILE.yml] [--<engine field> VALUE ...] PROMPT...`` and
``diffulex chat`` (same flags, an interactive session: `diffulex.chat`).

Every engine field of `diffulex.config.Config` is a flag (underscores become dashes), generated from the
dataclass so the CLI, YAML files and Python accept the same names, types and validation.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import logging
import sys
import types
import typing
import warnings
from dataclasses import MISSING, Field
from pathlib import Path
from typing import Any

from diffulex.validation import invalid_value, reject_unknown_keys, shown_value, warn
from diffulex.yaml_file import read_yaml_file

# Modules that contribute subcommands: each has ``add_parser(subparsers)`` that registers its own and sets ``func``.
_SUBCOMMAND_MODULES = (("diffulex.server.cli", "serve", "serve"), ("diffulex.bench.cli", "bench", "bench"))

# Fields the CLI sets itself (positional / dedicated flags) or that are not plain values.
_SPECIAL_FIELDS = {"model"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that states every flag's default, unless its text already does or there is none to state (an unset
    flag that leaves the value to the config file, the checkpoint or the engine)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are short, and whose positionals may come between options.

    argparse's own error prints the whole usage block first, which for a command with every engine field as a
    flag is about a hundred lines above the one line that matters. Positionals after an option
    (``bench compare --json A B``) are parsed as if they came first.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._parsing_intermixed = False
        self._after_separator: list[str] | None = None  # the strings after ``--``, while they wait to be parsed

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction:
        kwargs.setdefault("parser_class", CommandParser)
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        if self._subparsers is not None:
            return super().parse_known_args(args, namespace)
        if self._parsing_intermixed:
            if self._after_separator is not None and not self._positionals_switched_off():
                # argparse's second intermixed pass, which reads the positionals: the strings after ``--`` join
                # them here, behind a ``--`` of their own, so that none is taken for an option.
                args, self._after_separator = [*args, "--", *self._after_separator], None
            return super().parse_known_args(args, namespace)
        args = list(sys.argv[1:] if args is None else args)
        # ``--`` ends the options: what follows is positional even if it starts with "-" (``generate -- --hi``).
        # argparse's intermixed parsing would drop the ``--`` in its first pass (the options) and then read
        # "--hi" as an unknown option, so the strings after it are kept out of that pass.
        if "--" in args:
            cut = args.index("--")
            args, self._after_separator = args[:cut], args[cut + 1 :]
        self._parsing_intermixed = True
        try:
            parsed = self.parse_known_intermixed_args(args, namespace)
            tail, self._after_separator = self._after_separator, None
            if tail is not None:  # an argparse whose intermixed parsing did not come back here for the positionals
                parsed = self.parse_known_intermixed_args([*args, "--", *tail], namespace)
            return parsed
        finally:
            self._parsing_intermixed = False
            self._after_separator = None

    def _positionals_switched_off(self) -> bool:
        """In argparse's first intermixed pass (the options), the positionals have ``nargs=SUPPRESS``."""
        return any(action.nargs == argparse.SUPPRESS for action in self._get_positional_actions())

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen_command(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _chosen_command(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The subcommand's parser when one was chosen, so that an error names the command that was run."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None), self)
        return self

    def short_usage(self) -> str:
        formatter = self._get_formatter()
        parts = [self.prog, "[options]"]
        for action in self._get_positional_actions():
            if action.nargs == argparse.SUPPRESS:  # switched off while intermixed options are parsed
                action = copy.copy(action)
                action.nargs = getattr(action, "save_nargs", None)
            parts.append(formatter._format_args(action, formatter._get_default_metavar_for_positional(action)))
        return " ".join(parts)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"usage: {self.short_usage()}\n{self.prog}: error: {message}\nsee '{self.prog} --help'\n")


def field_default(f: Field) -> Any:
    """A dataclass field's default, for help texts (None when it has none)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> int; ``list[int]`` -> list; a union that takes a dict (``DecodingThresholds | dict | None``)
    -> dict, one that takes a list -> list; other annotations unchanged."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        bases = [_base_type(a) for a in typing.get_args(annotation) if a is not type(None)]
        if len(bases) == 1:
            return bases[0]
        return next((kind for kind in (dict, list) if kind in bases), str)
    return origin or annotation


# What a flag's value must look like, by the field's type (argparse shows it after the flag's name).
_EXPECTED = {
    int: "an integer",
    float: "a number",
    dict: 'a JSON object, e.g. \'{"key": 1}\'',
    list: "a JSON list, e.g. '[0, 1]'",
}


class FieldValue:
    """The ``type`` of an engine field's flag: the text as the field's type (``none``/``null`` = unset; JSON for a
    dict or list field). A value that is not one is refused while the arguments are parsed, with a message that
    says what the flag takes: ``argument --max-model-len: expected an integer, got 'abc'``."""

    def __init__(self, kind: Any, *, nullable: bool = True) -> None:
        self.kind = kind
        self.nullable = nullable  # ``none``/``null`` means unset (a flag whose value may not be unset says so)
        self.__name__ = getattr(kind, "__name__", "value")  # what argparse names in any message of its own

    def __call__(self, text: str) -> Any:
        if text.strip().lower() in ("none", "null"):
            if self.nullable:
                return None
            raise argparse.ArgumentTypeError(f"expected {_EXPECTED[self.kind]}, got {shown_value(text)}")
        kind = self.kind
        if kind not in _EXPECTED:
            return text
        detail = ""
        try:
            value = json.loads(text) if kind in (dict, list) else kind(text)
        except RecursionError:
            value, detail = None, " (nested too deeply)"
        except ValueError as err:  # json.JSONDecodeError is one
            value, detail = None, f" ({err})" if kind in (dict, list) else ""
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"expected {_EXPECTED[kind]}, got {shown_value(text)}{detail}")
        return value


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per engine field; booleans get ``--x/--no-x``. Unset flags stay out of the overrides."""
    from diffulex.config import Config, engine_fields, field_choices

    hints = typing.get_type_hints(Config)
    group = parser.add_argument_group("engine fields (see docs/configuration.md)")
    for f in engine_fields():
        if f.name in _SPECIAL_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")
        choices = field_choices(f)
        if choices:
            help_text += f" (one of: {', '.join(map(str, choices))})"
        kind = _base_type(hints.get(f.name, str))
        if kind in (dict, list) and f.name != "plugins":
            help_text += f" On the command line: {_EXPECTED[kind]}."
        default = field_default(f)
        if default is not None and "default" not in help_text.lower():
            help_text += f" (default: {default})".replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name == "plugins":  # one module per flag, as many flags as modules
            group.add_argument(
                "--plugin", dest=f.name, action="append", metavar="MODULE", help=f"{help_text} Repeatable."
            )
        else:
            # Choices are checked by Config, which also accepts deprecated aliases and registered names.
            group.add_argument(
                flag,
                dest=f.name,
                type=FieldValue(kind),
                default=None,
                metavar="JSON" if kind in (dict, list) else f.name.upper(),
                help=help_text,
            )


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from diffulex.config import engine_fields

    names = {f.name for f in engine_fields()} - _SPECIAL_FIELDS
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


# A file may name the checkpoint folder ``model_path`` (the benchmark files' key) as well as ``model``.
YAML_ALIASES = {"model_path": "model"}


def load_yaml_engine_fields(path: str) -> dict[str, Any]:
    """Engine fields from a YAML file: either an ``engine:`` section (benchmark layout) or a flat mapping.

    ``model_path`` is read as ``model`` and the old names of `diffulex.config.FIELD_ALIASES` as their fields; a file
    that gives both names of one field different values, a key twice or a key that is no engine field is refused.
    """
    from diffulex.config import FIELD_ALIASES, engine_fields, resolve_field_aliases

    data = read_yaml_file(path)
    if data is None:  # an empty file
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config={path!r} is invalid: must be a mapping of engine fields")
    fields = data.get("engine", data)
    if not isinstance(fields, dict):
        raise ValueError(f"config={path!r}: 'engine' must be a mapping of engine fields")
    if "engine" in data:  # the benchmark layout; other top-level keys may hold YAML anchors, but not fields
        field_names = {f.name for f in engine_fields()} | set(FIELD_ALIASES) | set(YAML_ALIASES)
        stray = sorted(key for key in data if key in field_names)
        if stray:
            raise ValueError(
                f"config={path!r}: {', '.join(stray)} beside the engine section would have no effect; give engine "
                "fields inside it"
            )
        if data.get("eval"):
            warn(f"config={path!r}: the eval section ({', '.join(map(str, data['eval']))}) is read by `diffulex "
                 "bench`; this command takes only the engine section, so give sampling settings as flags "
                 "(--temperature, --max-tokens, ...)")
    not_names = [key for key in fields if not isinstance(key, str)]
    if not_names:
        raise ValueError(
            f"config={path!r}: the key {shown_value(not_names[0])} is invalid: engine keys are field names (strings)"
        )
    fields = resolve_field_aliases(fields, f"config={path!r}: ", {**FIELD_ALIASES, **YAML_ALIASES})
    model = fields.get("model")
    if "model" in fields and (not isinstance(model, str) or not model):
        raise invalid_value(f"config={path!r}: model", model, "must be the path of a checkpoint folder")
    # A misspelled key in a file is an error, not a setting silently ignored.
    reject_unknown_keys(f"config {path!r} engine", fields, sorted(f.name for f in engine_fields()))
    return fields


def model_and_fields(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """The checkpoint folder and the engine fields a command line gives: ``--config`` (the YAML's fields), then the
    engine flags over them; ``--model`` over the YAML's ``model``. The folder is None when neither names one (the
    caller then takes the built-in model). An empty ``--model`` or ``--config`` (an unset shell variable) is refused,
    not read as "none given"."""
    config = getattr(args, "config", None)
    fields: dict[str, Any] = load_yaml_engine_fields(config) if config is not None else {}
    fields.update(engine_overrides(args))
    from_file = fields.pop("model", None)
    if args.model is None:
        return from_file, fields
    if not args.model:
        raise invalid_value(
            "--model", args.model, "must be the path of a checkpoint folder (leave the flag out for the built-in model)"
        )
    return args.model, fields


def default_model_dir() -> Path:
    """The model used when none is given: the built-in trained model shipped in the package."""
    from diffulex import BUILTIN_MODEL

    return Path(BUILTIN_MODEL)


# What `diffulex generate` asks when given no prompt: a question of the kind the built-in model was trained on.
DEMO_PROMPT = "There are 6 boxes with 7 pencils in each box. How many pencils are there in all?"


def _build_engine(args: argparse.Namespace) -> Any:
    """The engine the command line describes: ``--model`` (else the YAML's, else the built-in model) and fields."""
    from diffulex import Diffulex

    model, fields = model_and_fields(args)
    if model is None:
        model = str(default_model_dir())
        print(f"no --model given: using the built-in model at {model}", file=sys.stderr)
    return Diffulex(model, **fields)


def _sampling_params(args: argparse.Namespace) -> Any:
    from diffulex import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        max_nfe=args.max_nfe,
        ignore_eos=args.ignore_eos,
        max_repetition_run=args.max_repetition_run,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    sp = _sampling_params(args)
    prompts = args.prompts or [DEMO_PROMPT]
    with _build_engine(args) as llm:
        outputs = llm.generate(prompts, sp, use_tqdm=not args.quiet, apply_chat_template=args.apply_chat_template,
                               parse_special_tokens=args.parse_special_tokens)
    if args.json:
        rows = [
            {"prompt": p, "text": t.text, "token_ids": t.token_ids, "completion_reason": t.completion_reason,
             "nfe": t.nfe, "tpf": t.tpf, "error": t.error}
            for p, t in zip(prompts, outputs.trajectories, strict=True)
        ]
        print(json.dumps({"outputs": rows, "tps": outputs.tps, "tpf": outputs.tpf, "nfe": outputs.nfe}, indent=2))
    else:
        for prompt, traj in zip(prompts, outputs.trajectories, strict=True):
            print(f"### prompt: {prompt!r}")
            print(traj.text if traj.error is None else f"[rejected] {traj.error}")
            print(f"--- {traj.completion_reason}, {traj.num_generated_tokens} tokens, NFE {traj.nfe}\n")
        print(outputs.summary(), file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from diffulex.chat import ChatSession, run_chat

    sp = _sampling_params(args)
    with _build_engine(args) as llm:
        if not hasattr(llm, "add_request"):
            raise ValueError("data_parallel_size > 1 is for offline generate; chat runs one engine")
        session = ChatSession(llm, sp, system=args.system, parse_special_tokens=args.parse_special_tokens)
        return run_chat(session, sys.stdin, sys.stdout, sys.stderr)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built-in model)")
    parser.add_argument("--config", default=None, help="YAML file with engine fields (flat or under 'engine:')")


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    # The values are read as the engine flags' are (`FieldValue`): the same message for a value of the wrong kind,
    # and ``none`` for the limits whose default is none, as their help says.
    sampling = parser.add_argument_group("sampling")
    number, integer = FieldValue(float, nullable=False), FieldValue(int, nullable=False)
    sampling.add_argument("--temperature", type=number, default=0.0,
                          help="0 is greedy: each position takes its most likely token (default: %(default)s here; "
                               "the Python API and the server default to 1.0)")
    sampling.add_argument("--top-p", type=number, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    sampling.add_argument("--top-k", type=integer, default=0, help="0 keeps every token (default: %(default)s)")
    sampling.add_argument("--max-tokens", type=integer, default=64, help="answer length limit (default: %(default)s)")
    sampling.add_argument("--max-nfe", type=FieldValue(int), default=None,
                          help="limit on model forwards per request (default: none)")
    sampling.add_argument("--max-repetition-run", type=FieldValue(int), default=None,
                          help="stop after this many repeats of one token (default: none)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")


def _add_prompt_flags(parser: argparse.ArgumentParser, *, chat: bool) -> None:
    prompts = parser.add_argument_group("prompts")
    if not chat:
        prompts.add_argument(
            "--raw", "--no-chat-template", dest="apply_chat_template", action="store_false",
            help="send each prompt as it is; by default a chat model (one whose tokenizer has a chat template) gets "
                 "it as the user message of its chat template",
        )
    prompts.add_argument(
        "--parse-special-tokens", action="store_true",
        help="let special-token text typed in a prompt (<|im_end|>, ...) act as that special token; by default it "
             "is plain text",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="diffulex", description="Diffusion language model serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="*", help=f"prompts (default: {DEMO_PROMPT!r})")
    _add_model_flags(gen)
    _add_sampling_flags(gen)
    _add_prompt_flags(gen, chat=False)
    gen.add_argument("--json", action="store_true", help="print the outputs as JSON")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_flags(gen)
    gen.set_defaults(func=_cmd_generate)
    chat = sub.add_parser(
        "chat", help="talk with a model; each answer is shown while it is denoised",
        description="An interactive conversation: one line is one message, the conversation so far is the context of "
                    "every answer. /exit or Ctrl-D leaves, /reset starts over, Ctrl-C stops an answer. On a terminal "
                    "the blocks being denoised are drawn live; through a pipe each answer is written as plain text.",
    )
    _add_model_flags(chat)
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    _add_sampling_flags(chat)
    _add_prompt_flags(chat, chat=True)
    add_engine_flags(chat)
    chat.set_defaults(func=_cmd_chat)
    for module, command, extra in _SUBCOMMAND_MODULES:
        try:
            add_parser = importlib.import_module(module).add_parser
        except ModuleNotFoundError as err:
            if err.name and (err.name == module or module.startswith(err.name + ".")):
                continue  # that part of the package is not there
            _add_unavailable(sub, command, f"'diffulex {command}' needs {err.name!r}: pip install 'diffulex[{extra}]'")
            continue
        add_parser(sub)
    return parser


def _add_unavailable(sub: argparse._SubParsersAction, command: str, message: str) -> None:
    """A subcommand whose optional dependencies are missing still exists and says what to install."""

    def fail(args: argparse.Namespace) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    sub.add_parser(command, help=f"(unavailable: {message})", add_help=False).set_defaults(func=fail)


def report_warnings_once() -> None:
    """Log each of the engine's warnings once: `diffulex.config.warn` both logs a message and raises it as a Python
    warning (for notebooks and tests), which on a command line would print every message twice."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", module="diffulex")


# What a command reports as one line, ``error: ...``, with exit code 2: a rejected setting or input (ValueError), a
# feature a checkpoint asks for that is not implemented (NotImplementedError), a file that cannot be used (OSError).
# Anything else is a bug, and its traceback is what helps.
USER_ERRORS = (ValueError, NotImplementedError, OSError)


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; its `USER_ERRORS` become one ``error: ...`` line and exit code 2."""
    try:
        return args.func(args)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    report_warnings_once()
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
