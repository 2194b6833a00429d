"""Per-request generation settings, validated when built so a bad request fails before it is queued."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffulex.config import check_bool, check_int, check_number, invalid_value


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    ``temperature=0`` is greedy decoding. ``top_k`` 0 (or -1) and ``top_p`` 1 disable those filters.
    ``max_nfe`` caps the forwards of the request; when None the engine derives a cap that never binds for a
    request making normal progress. ``stop`` strings end the answer where they first appear.
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

    def __post_init__(self) -> None:
        self.temperature = check_number("temperature", self.temperature, low=0.0)
        self.top_p = check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.top_k == -1:  # the common "disabled" spelling; keep one representation
            self.top_k = 0
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise invalid_value("top_k", self.top_k, "must be 0 or -1 (disabled) or an integer >= 1")
        check_int("max_tokens", self.max_tokens, low=1)
        if self.max_nfe is not None:
            check_int("max_nfe", self.max_nfe, low=1)
        check_bool("ignore_eos", self.ignore_eos)
        if self.max_repetition_run is not None:
            check_int("max_repetition_run", self.max_repetition_run, low=1)
        if self.seed is not None:
            check_int("seed", self.seed, low=0)
        self.stop = _normalize_stop(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _normalize_stop(stop: Any) -> list[str] | None:
    """A single string means one stop string; an empty string would stop every answer at once."""
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise invalid_value("stop", stop, "must be a non-empty string or a list of non-empty strings")
    return list(items) or None
