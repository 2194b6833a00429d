"""A module imported on a background thread: the module, or the import's own error, where the build waits."""

from __future__ import annotations

import sys

import pytest

from diffulex.engine.background_import import BackgroundImport


def test_waiting_returns_the_imported_module():
    job = BackgroundImport("json")
    assert job.wait() is sys.modules["json"]
    assert job.seconds >= 0


def test_a_failed_import_is_raised_by_the_waiting_thread(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin_for_import_test.py").write_text("raise RuntimeError('the module refuses to load')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    job = BackgroundImport("broken_plugin_for_import_test")
    with pytest.raises(RuntimeError, match="the module refuses to load"):
        job.wait()
    with pytest.raises(RuntimeError, match="the module refuses to load"):  # every wait says it, not only the first
        job.wait()
