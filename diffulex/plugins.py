"""Plugins: a user's modules that register decoding strategies or model families from outside the package.

Two ways in, and both reach every front end (Python, CLI, YAML, the bench and the server):

* an installed distribution declares an entry point in the ``diffulex.plugins`` group, e.g. in its
  ``pyproject.toml``: ``[project.entry-points."diffulex.plugins"] top2 = "my_package.top2"``. Every such entry
  point is loaded the first time a strategy or family table is read: a module is imported, a function is called;
* the engine field ``plugins`` (``--plugin my_module`` on the command line, ``plugins: [my_module]`` in YAML) names
  modules to import before the configuration is resolved.

A plugin registers with `diffulex.strategy.strategy.register_strategy` and
`diffulex.models.family.register_family`; docs/architecture.md walks through both with the examples under
``examples/plugins/``. Plugins are code the user chose to run; nothing inside a checkpoint folder ever is.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from importlib.metadata import entry_points

from diffulex.errors import RegistrationError

logger = logging.getLogger("diffulex")

ENTRY_POINT_GROUP = "diffulex.plugins"

_installed_loaded = False  # entry points are loaded once per process


def import_plugins(modules: Iterable[str]) -> None:
    """Import each named module (its registrations run on import); a module that fails names itself.

    The package's own strategies and families are registered before a plugin's, so a plugin that takes one of
    their names or aliases is refused here, naming it, and the tables keep the package's entries."""
    for name in modules:
        try:
            importlib.import_module(name)
        except RegistrationError as err:
            raise ValueError(f"plugins: {name!r} could not register: {err}") from err
        except ModuleNotFoundError as err:
            if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
                raise ValueError(f"plugins: {name!r} could not be imported: {type(err).__name__}: {err}") from err
            # The plugin itself is not on the path: the usual first stumble, since the `diffulex` command (a
            # console script) does not put the current folder on sys.path as `python script.py` puts the script's.
            raise ValueError(
                f"plugins: {name!r} could not be imported: no module named {err.name!r} on sys.path; put the folder "
                f"that holds it on PYTHONPATH (e.g. PYTHONPATH=. diffulex ... --plugin {name}) or install it"
            ) from err
        except Exception as err:  # any failure of a user's module is reported as that plugin's
            raise ValueError(f"plugins: {name!r} could not be imported: {type(err).__name__}: {err}") from err


def load_installed_plugins() -> None:
    """Load every entry point of the ``diffulex.plugins`` group, once per process."""
    global _installed_loaded
    if _installed_loaded:
        return
    _installed_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = point.load()
            if callable(loaded):
                loaded()
        except RegistrationError as err:
            raise ValueError(
                f"the installed plugin {point.name!r} ({point.value}) of entry-point group {ENTRY_POINT_GROUP!r} "
                f"could not register: {err}"
            ) from err
        except Exception as err:  # a broken installed plugin must say which one it is
            raise ValueError(
                f"the installed plugin {point.name!r} ({point.value}) of entry-point group {ENTRY_POINT_GROUP!r} "
                f"failed to load: {type(err).__name__}: {err}"
            ) from err
        logger.info("loaded plugin %s (%s)", point.name, point.value)
