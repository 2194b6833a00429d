"""Per-request generation settings, validated whenever a field is set, so a bad request fails before it is queued.

Every assignment goes through the field's check, at construction and after it: ``params.temperature = -1``
raises the same error as ``SamplingParams(temperature=-1)``, so no invalid value can reach the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from diffulex.validation import check_bool, check_int, check_number, invalid_value

# Temperatures below this draw like greedy decoding up to float32 resolution (the tempered distribution puts all
# of its mass on the top-1), so they are normalized to 0 and take the greedy path. Above ``MAX_TEMPERATURE`` every
# vocabulary entry is equally likely to float32 resolution for any logits a model produces; larger values only
# invite overflow and are refused.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
MIN_REPETITION_RUN = 2


def _check_temperature(value: Any) -> float:
    t = check_number("temperature", value, low=0.0, high=MAX_TEMPERATURE)
    return 0.0 if t < GREEDY_BELOW_TEMPERATURE else t


def _check_top_k(value: Any) -> int:
    if value == -1 and not isinstance(value, bool):  # the common "disabled" spelling; keep one representation
        return 0
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise invalid_value("top_k", value, "must be 0 or -1 (disabled) or an integer >= 1")
    return value


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _normalize_stop(stop: Any) -> list[str] | None:
    """A single string means one stop string; an empty string would stop every answer at once."""
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise invalid_value("stop", stop, "must be a non-empty string or a list of non-empty strings")
    return list(items) or None


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "temperature": _check_temperature,
    "top_p": lambda v: check_number("top_p", v, 0.0, 1.0, low_open=True),
    "top_k": _check_top_k,
    "max_tokens": lambda v: check_int("max_tokens", v, low=1),
    "max_nfe": _optional(lambda v: check_int("max_nfe", v, low=1)),
    "ignore_eos": lambda v: check_bool("ignore_eos", v),
    # a run of one token is any answer's first token: 1 would end every request there
    "max_repetition_run": _optional(lambda v: check_int("max_repetition_run", v, low=MIN_REPETITION_RUN)),
    "seed": _optional(lambda v: check_int("seed", v, low=0, high=2**63 - 1)),
    "stop": _normalize_stop,
}


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    ``temperature=0`` is greedy decoding; it is at most ``MAX_TEMPERATURE`` (100), and values below
    ``GREEDY_BELOW_TEMPERATURE`` (1e-5) are greedy too (read back as 0). ``top_k`` 0 (or -1) and ``top_p`` 1
    disable those filters. ``max_nfe`` caps the forwards of the request; when None the engine derives a cap that
    never binds for a request making normal progress. ``stop`` strings end the answer where they first appear.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    max_nfe: int | None = None
    ignore_eos: bool = False
    max_repetition_run: int | None = None
    seed: int | None = None
    stop: list[str] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        check = _CHECKS.get(name)
        if check is None:
            raise AttributeError(
                f"SamplingParams has no field {name!r}; the fields are: {', '.join(f.name for f in fields(self))}"
            )
        object.__setattr__(self, name, check(value))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
