"""The engine's own exception types, importable from every layer (a sampler raises what the engine catches)."""

from __future__ import annotations

from collections.abc import Sequence


class RequestFailure(RuntimeError):
    """A failure inside a step that is traced to particular requests: only they finish with the error."""

    def __init__(self, req_ids: Sequence[int], message: str) -> None:
        super().__init__(message)
        self.req_ids = list(req_ids)


class EngineDeadError(RuntimeError):
    """The device failed: no step can run on it any more. A server exits on it so that a supervisor restarts it."""


class EngineClosedError(RuntimeError):
    """The engine was shut down with `exit()`."""


class UnsupportedError(ValueError, NotImplementedError):
    """The input asks for something this version does not implement (a checkpoint's scaled RoPE, ...). It is a
    ``ValueError`` like every rejected setting, so that the front ends report it in one line naming the field, and a
    ``NotImplementedError`` for callers that catch that."""


class RegistrationError(ValueError):
    """A registration refused by a name table (`diffulex.registry.Registry`): a name or alias already taken, or
    not a name at all. Raised while a plugin is loaded, it is reported with the plugin's module."""
