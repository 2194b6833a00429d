"""Name -> component tables: how decoding strategies and model families plug into the engine.

A table is filled by registration: the package's own entries the first time the table is read (its ``builtins``
module is imported then), a user's modules through plugins (`diffulex.plugins`). Whatever is registered is valid
everywhere a name is accepted (Python, CLI, YAML, HTTP), because every front end asks the same table.
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from diffulex.validation import format_choices, invalid_value

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table with a clear error for unknown names.

    ``field`` is the setting the names are values of (``decoding_strategy``, ``model_name``): an unknown name is
    reported as a bad value of that setting, with the names that are allowed. An alias is an old spelling of a
    registered name (`canonical` maps it back).
    """

    def __init__(self, field: str, builtins: str | None = None) -> None:
        self.field = field
        self._builtins = builtins
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self._loaded = False

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name``; registering a different object under a taken name is an error."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.field} must be a non-empty string, got {name!r}")
        existing = self._entries.get(name)
        if existing is not None and existing is not obj:
            raise ValueError(f"{self.field} {name!r} is already registered as {existing!r}")
        if name in self._aliases:
            raise ValueError(f"{self.field} {name!r} is already an alias of {self._aliases[name]!r}")
        self._entries[name] = obj
        return obj

    def add_alias(self, alias: str, name: str) -> None:
        """``alias`` is an old spelling of the registered ``name``."""
        if alias in self._entries:
            raise ValueError(f"{self.field} {alias!r} is registered; it cannot also be an alias")
        self._aliases[alias] = name

    def get(self, name: str) -> T:
        self._load_builtins()
        key = self._aliases.get(name, name) if isinstance(name, str) else name
        try:
            return self._entries[key]
        except (KeyError, TypeError):
            raise invalid_value(self.field, name, f"must be one of {format_choices(self.names())}") from None

    def canonical(self, name: str) -> str:
        """The registered name ``name`` stands for (itself unless it is an alias)."""
        self._load_builtins()
        return self._aliases.get(name, name)

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return isinstance(name, str) and (name in self._entries or name in self._aliases)

    def names(self) -> list[str]:
        """Every registered name (aliases excluded), sorted."""
        self._load_builtins()
        return sorted(self._entries)

    def values(self) -> list[T]:
        """Every registered object once (one registered under several names is listed once)."""
        self._load_builtins()
        unique: dict[int, T] = {}
        for obj in self._entries.values():
            unique.setdefault(id(obj), obj)
        return list(unique.values())

    def _load_builtins(self) -> None:
        """Import the package's own registrations, then the installed plugins, the first time the table is read."""
        if self._loaded or self._builtins is None:
            return
        self._loaded = True  # a registration that reads the table while it loads sees what is there so far
        from diffulex.plugins import load_installed_plugins

        importlib.import_module(self._builtins)
        load_installed_plugins()
