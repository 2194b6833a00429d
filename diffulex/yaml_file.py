"""Reading a YAML file of settings (the CLI's ``--config``, the benchmark harness's config files) safely and with
errors that name the file.

PyYAML's safe loader builds plain data only (no ``!!python`` tags run anything), but on its own it keeps the last
value of a key given twice, raises a bare RecursionError on deeply nested input and reports undecodable bytes
without the file: `read_yaml_file` turns each into a ``ValueError`` naming the file and what is wrong.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from diffulex.validation import shown_value


class _DuplicateKeyError(Exception):
    """A YAML mapping that gives one key twice (PyYAML would keep the last value silently)."""


@functools.cache
def _yaml_loader() -> type:
    """PyYAML's safe loader, except that a mapping that gives a key twice is an error instead of its last value."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, Any] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: keys given here override it
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.setdefault(key, key_node)
                    except TypeError:  # an unhashable key, which the safe loader refuses itself
                        continue
                    if first is not key_node:
                        raise _DuplicateKeyError(
                            f"the key {shown_value(key)} is given twice (lines {first.start_mark.line + 1} and "
                            f"{key_node.start_mark.line + 1}); give each key once"
                        )
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def read_yaml_file(path: str, name: str = "config") -> Any:
    """The parsed YAML file at `path`. Each way it can fail is a ``ValueError`` that names the file (as
    ``config='x.yml'``, `name` being the flag or key that gave it): it cannot be read, is not UTF-8 text, is not
    YAML, is nested too deeply, or gives a key of a mapping twice."""
    import yaml

    where = f"{name}={shown_value(path)}"
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where} is invalid: must be the path of a YAML file")
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{where} could not be read: {err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{where} could not be read: it is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})"
        ) from None
    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506  (a SafeLoader subclass)
    except _DuplicateKeyError as err:
        raise ValueError(f"{where} is invalid: {err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{where} could not be read: {err}") from None
    except RecursionError:
        raise ValueError(
            f"{where} could not be read: its lists or mappings are nested too deeply for the YAML parser"
        ) from None
