"""Name -> component tables: how strategies, models and samplers plug into the engine.

A strategy registers its request, scheduler, KV cache manager, model runner and config normalizer under its
name; a model family registers its model class, HF-config reader and acceptance rule under its ``model_name``.
Adding a strategy or a family is a new module with registrations, not an edit of the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of components with a clear error for unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@AutoScheduler.register("multi_bd")``. Registering a different object twice is an error."""

        def decorate(obj: T) -> T:
            existing = self._entries.get(name)
            if existing is not None and existing is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered as {existing!r}")
            self._entries[name] = obj
            return obj

        return decorate

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"{self.kind} {name!r} is not registered; available: {', '.join(sorted(self._entries)) or 'none'}"
            ) from None

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.get(name)(*args, **kwargs)  # type: ignore[operator]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)


# Keyed by decoding_strategy.
AutoReq: Registry[type] = Registry("request class for strategy")
AutoScheduler: Registry[type] = Registry("scheduler for strategy")
AutoKVCacheManager: Registry[type] = Registry("KV cache manager for strategy")
AutoModelRunner: Registry[type] = Registry("model runner for strategy")
StrategyConfigRegistry: Registry[Callable[[Any], None]] = Registry("config normalizer for strategy")

# Keyed by model_name.
AutoModelForDiffusionLM: Registry[type] = Registry("model")
AutoSampler: Registry[type] = Registry("sampler for model")
