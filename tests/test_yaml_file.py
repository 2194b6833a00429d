"""A settings file is read as plain data, and each way it can be unusable is an error naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffulex.yaml_file import read_yaml_file


def write(tmp_path: Path, data: str | bytes) -> str:
    path = tmp_path / "settings.yml"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return str(path)


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "engine:\n  block_size: 4\n  block_size: 8\n")
    with pytest.raises(ValueError, match=r"config='.*settings.yml' is invalid: the key 'block_size' is given twice "
                                         r"\(lines 2 and 3\)"):  # fmt: skip
        read_yaml_file(path)


def test_merge_keys_still_override_what_they_merge(tmp_path: Path) -> None:
    text = "base: &base {block_size: 4, buffer_size: 1}\nengine:\n  <<: *base\n  buffer_size: 2\n"
    assert read_yaml_file(write(tmp_path, text))["engine"] == {"block_size": 4, "buffer_size": 2}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"model: caf\xe9\n", r"it is not UTF-8 text \(byte 0xe9 at offset 10\)"),
        ("[" * 100_000, "nested too deeply for the YAML parser"),
        ("engine: [1, 2\n", "could not be read: "),
    ],
)
def test_unreadable_files_are_named_with_what_is_wrong(tmp_path: Path, data, problem) -> None:
    with pytest.raises(ValueError, match=rf"^config='.*settings.yml' .*{problem}"):
        read_yaml_file(write(tmp_path, data))


def test_python_tags_build_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="could not be read"):
        read_yaml_file(write(tmp_path, "x: !!python/object/apply:os.system ['echo hi']\n"))
