"""Name -> component tables: how decoding strategies and model families plug into the engine.

A table is filled by registration: the package's own entries first (its ``builtins`` module is imported the first
time the table is read or anything else is registered in it), then a user's modules through plugins
(`diffulex.plugins`; installed entry points are loaded the first time the table is read). A name or alias that is
taken is refused at the registration that takes it again (`RegistrationError`), leaving the table as it was, so a
plugin can neither replace nor shadow a package entry. Whatever is registered is valid everywhere a name is accepted
(Python, CLI, YAML, HTTP), because every front end asks the same table.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Generic, TypeVar

from diffulex.errors import RegistrationError
from diffulex.plugins import load_installed_plugins
from diffulex.validation import format_choices, invalid_value

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table with a clear error for unknown names.

    ``field`` is the setting the names are values of (``decoding_strategy``, ``model_name``): an unknown name is
    reported as a bad value of that setting, with the names that are allowed. An alias is an old spelling of a
    registered name (`canonical` maps it back). ``kind`` says what an entry is in messages ("decoding strategy").

    The package's own entries are loaded before anything else is registered, so a name taken by one of them is
    refused at the registration that takes it again (a plugin's), never at the import of the package's own.
    """

    def __init__(self, field: str, builtins: str | None = None, kind: str = "entry") -> None:
        self.field = field
        self.kind = kind
        self._builtins = builtins
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self._builtins_imported = False
        self._loaded = False

    def add(self, name: str, obj: T, *, names: Iterable[str] = (), aliases: Iterable[str] = ()) -> T:
        """Register ``obj`` under ``name`` and the other ``names``, with ``aliases`` as old spellings of ``name``.

        All or nothing: a name or alias already taken by something else (an entry, or an alias of another name)
        is a `RegistrationError` and the table is left as it was. Registering the same object under the same
        names again changes nothing.
        """
        for label, given in (("other names", names), ("aliases", aliases)):
            if isinstance(given, str) or not isinstance(given, Iterable):
                raise RegistrationError(f"the {label} of {self.field} {name!r} must be a tuple of names, got {given!r}")
        self._import_builtins()
        keys = [("name", name), *(("name", n) for n in names), *(("alias", a) for a in aliases)]
        seen: set[object] = set()
        for role, key in keys:
            if not isinstance(key, str) or not key:
                label = self.field if role == "name" else f"an alias of {self.field} {name!r}"
                raise RegistrationError(f"{label} must be a non-empty string, got {key!r}")
            what = f"{self.field} {key!r}" if role == "name" else f"{self.field} alias {key!r} (of {name!r})"
            if key in seen:
                raise RegistrationError(f"{what} is given twice in one registration")
            seen.add(key)
            if role == "name" and self._entries.get(key) is obj:
                continue
            if role == "alias" and self._aliases.get(key) == name:
                continue
            taken = self._holder(key)
            if taken is not None:
                raise RegistrationError(f"{what} is already registered ({taken}); choose another name")
        for role, key in keys:
            if role == "name":
                self._entries[key] = obj
            else:
                self._aliases[key] = name
        return obj

    def _holder(self, key: str) -> str | None:
        """What holds ``key`` (for an error message); None: it is free."""
        if key in self._aliases:
            return f"an alias of {self._aliases[key]!r}"
        if key not in self._entries:
            return None
        owner = getattr(self._entries[key], "name", key)
        if owner == key:
            return f"the {self.kind} {key!r}"
        return f"another name of the {self.kind} {owner!r}"

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

    def _import_builtins(self) -> None:
        """Import the package's own registrations once (a registration made while they import sees what is there
        so far; they are all there once the import finishes)."""
        if self._builtins_imported or self._builtins is None:
            return
        self._builtins_imported = True
        try:
            importlib.import_module(self._builtins)
        except BaseException:
            self._builtins_imported = False
            raise

    def _load_builtins(self) -> None:
        """Import the package's own registrations, then the installed plugins, the first time the table is read."""
        if self._loaded or self._builtins is None:
            return
        self._loaded = True  # a registration that reads the table while it loads sees what is there so far
        self._import_builtins()
        load_installed_plugins()
