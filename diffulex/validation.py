"""The checks every setting goes through, so that each rejected value reads the same wherever it came from.

`diffulex.config.Config`, `diffulex.sampling_params.SamplingParams`, the strategies' options and the front ends
(YAML, HTTP) all report a bad value as ``name=value is invalid: requirement``, naming the field, the value and what
is allowed. This module depends on nothing else in the package, so any layer may use it.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger("diffulex.config")


# A rejected value longer than this is shown by its start and its length: an error that echoes a megabyte of
# input buries its own message (and floods a log with whatever a client sent).
SHOWN_VALUE_CHARS = 200


def shown_value(value: Any) -> str:
    """``repr(value)``, cut to `SHOWN_VALUE_CHARS` with the full length named."""
    text = repr(value)
    if len(text) <= SHOWN_VALUE_CHARS:
        return text
    return f"{text[:SHOWN_VALUE_CHARS]}... ({len(text)} characters)"


def invalid_value(name: str, value: Any, requirement: str) -> ValueError:
    """The one error format for a rejected setting, e.g. ``block_size=12 is invalid: must be one of 4, 8``."""
    return ValueError(f"{name}={shown_value(value)} is invalid: {requirement}")


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Report a setting we changed: as a Python warning (tests, notebooks) and in the log (servers)."""
    warnings.warn(message, category, stacklevel=3)
    logger.warning(message)


def format_choices(choices: Sequence[Any]) -> str:
    return ", ".join(repr(c) if isinstance(c, str) else str(c) for c in choices)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """Return ``value`` if it is one of ``choices``; bools never match numeric choices."""
    ok = any(value == c and type(value) is type(c) for c in choices)
    if not ok:
        raise invalid_value(name, value, f"must be one of {format_choices(choices)}")
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) within ``[low, high]``."""
    if low is not None and high is not None:
        requirement = f"must be an integer in [{low}, {high}]"
    elif low == 1:
        requirement = "must be an integer > 0"
    elif low is not None:
        requirement = f"must be an integer >= {low}"
    else:
        requirement = "must be an integer"
    if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        raise invalid_value(name, value, requirement)
    return value


def check_number(
    name: str, value: Any, low: float | None = None, high: float | None = None, low_open: bool = False
) -> float:
    """Return ``value`` as a float if it is a real number within the bounds (NaN never is)."""
    if low is not None and high is not None:
        requirement = f"must be a number in {'(' if low_open else '['}{low:g}, {high:g}]"
    elif low is not None:
        requirement = f"must be a number {'>' if low_open else '>='} {low:g}"
    else:
        requirement = "must be a number"
    ok = is_number(value) and value == value  # value == value rules out NaN
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        raise invalid_value(name, value, requirement)
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a real bool: a YAML/HTTP string like "false" must not silently mean True."""
    if not isinstance(value, bool):
        raise invalid_value(name, value, "must be True or False")
    return value


def check_nonempty_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise invalid_value(name, value, "must be a non-empty string")
    return value


def check_dir(name: str, value: Any) -> str:
    try:
        path = os.fspath(value)
    except TypeError:
        raise invalid_value(name, value, "must be a path to a directory") from None
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"{name}={shown_value(path)} is not an existing directory")
    return path


def force_setting(config: Any, name: str, value: Any, reason: str) -> None:
    """Set a field a strategy cannot work without; warn only when that overrides a value the user chose.

    A value equal to the field's declared default counts as "not chosen", because the dataclass cannot tell
    ``page_size=32`` given explicitly from the default 32.
    """
    current = getattr(config, name)
    default = type(config).__dataclass_fields__[name].default
    if current is not None and current != default and current != value:
        warn(f"{name}={current!r} is overridden to {value!r}: {reason}")
    setattr(config, name, value)


def reject_unknown_keys(name: str, values: Mapping[str, Any], allowed: Sequence[str]) -> None:
    """A misspelled key in a YAML/HTTP dict is an error, not a silently ignored setting."""
    unknown = sorted(set(values) - set(allowed), key=repr)  # keys of any type: a YAML mapping may mix them
    if unknown:
        accepted = f"allowed keys: {', '.join(allowed)}" if allowed else "it takes no keys"
        raise ValueError(f"{name} has unknown keys {', '.join(map(repr, unknown))}; {accepted}")
