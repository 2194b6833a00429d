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

    def add_subparsers(self, **kwargs: Any) -> argparse._SubParsersAction:
        kwargs.setdefault("parser_class", CommandParser)
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        if self._subparsers is not None or self._parsing_intermixed:
            return super().parse_known_args(args, namespace)
        self._parsing_intermixed = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._parsing_intermixed = False

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
    """``int | None`` -> int; ``list[int]`` -> list; other annotations unchanged."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    return origin or annotation


def _parse_value(kind: Any, text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    if kind in (dict, list):
        return json.loads(text)
    return text


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
        default = field_default(f)
        if default is not None and "default" not in help_text.lower():
            help_text += f" (default: {default})".replace("%", "%%")
        kind = _base_type(hints.get(f.name, str))
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
                type=lambda s, k=kind: _parse_value(k, s),
                default=None,
                metavar=f.name.upper(),
                help=help_text,
            )


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from diffulex.config import engine_fields

    names = {f.name for f in engine_fields()} - _SPECIAL_FIELDS
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def load_yaml_engine_fields(path: str) -> dict[str, Any]:
    """Engine fields from a YAML file: either an ``engine:`` section (benchmark layout) or a flat mapping."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"config={path!r} could not be read: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config={path!r} is invalid: must be a mapping of engine fields")
    fields = data.get("engine", data)
    if not isinstance(fields, dict):
        raise ValueError(f"config={path!r}: 'engine' must be a mapping of engine fields")
    fields = dict(fields)
    if "model_path" in fields:
        fields["model"] = fields.pop("model_path")
    if "num_kvcache_blocks" in fields:
        fields["num_pages"] = fields.pop("num_kvcache_blocks")
    from diffulex.config import engine_fields
    from diffulex.validation import reject_unknown_keys

    # A misspelled key in a file is an error, not a setting silently ignored.
    reject_unknown_keys(f"config {path!r} engine", fields, sorted(f.name for f in engine_fields()))
    return fields


def default_model_dir() -> Path:
    """The model used when none is given: the built-in trained model shipped in the package."""
    from diffulex import BUILTIN_MODEL

    return Path(BUILTIN_MODEL)


# What `diffulex generate` asks when given no prompt: a question of the kind the built-in model was trained on.
DEMO_PROMPT = "There are 6 boxes with 7 pencils in each box. How many pencils are there in all?"


def _build_engine(args: argparse.Namespace) -> Any:
    """The engine the command line describes: ``--model`` (else the YAML's, else the built-in model) and fields."""
    from diffulex import Diffulex

    fields: dict[str, Any] = load_yaml_engine_fields(args.config) if args.config else {}
    fields.update(engine_overrides(args))
    model = args.model or fields.pop("model", None)
    fields.pop("model", None)
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
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="0 is greedy: each position takes its most likely token (default: %(default)s here; "
                               "the Python API and the server default to 1.0)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    sampling.add_argument("--top-k", type=int, default=0, help="0 keeps every token (default: %(default)s)")
    sampling.add_argument("--max-tokens", type=int, default=64, help="answer length limit (default: %(default)s)")
    sampling.add_argument("--max-nfe", type=int, default=None,
                          help="limit on model forwards per request (default: none)")
    sampling.add_argument("--max-repetition-run", type=int, default=None,
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
                    "the blocks being denoised are drawn live; through a pipe each answer is one plain-text line.",
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


def main(argv: list[str] | None = None) -> int:
    report_warnings_once()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
