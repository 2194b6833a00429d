"""The engine's start, accounted for: consecutive phases that add up to the wall time of ``Diffulex(...)``."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import diffulex.engine.assembly as assembly
from diffulex import Diffulex, SamplingParams
from diffulex.engine.build_phases import BuildPhases

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """The engine sets torch's thread count for the whole process: give the next test the count it had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_consecutive_phases_add_up_to_the_total():
    build = BuildPhases()
    time.sleep(0.02)
    build.done("first")
    time.sleep(0.01)
    build.done("second")
    build.done("first")  # a phase named again adds up
    assert list(build.seconds) == ["first", "second"]
    assert build.seconds["first"] >= 0.02 and build.seconds["second"] >= 0.01
    assert sum(build.seconds.values()) == pytest.approx(build.total)
    assert build.summary().startswith(f"engine ready in {build.total:.2f} s: first ")


def test_the_logged_phases_cover_the_whole_call(sdar_dir, caplog):
    with caplog.at_level(logging.INFO, logger="diffulex"):
        start = time.perf_counter()
        llm = Diffulex(str(sdar_dir), block_size=4, page_size=8, max_model_len=40, max_num_reqs=2)
        wall = time.perf_counter() - start
    phases = llm.build_seconds
    # from the imports Diffulex(...) makes to the engine's last bookkeeping, nothing is left outside a phase
    assert list(phases)[:3] == ["engine imports", "config", "device init"]
    assert {"weights", "tokenizer import", "tokenizer", "memory plan and KV cache"} <= set(phases)
    assert list(phases)[-1] == "freezing the build's objects"
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) == pytest.approx(wall, abs=0.02)
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready in")]
    assert len(ready) == 1 and all(name in ready[0] for name in phases)


def test_a_failed_tokenizer_import_fails_the_build_with_its_own_error(sdar_dir, monkeypatch):
    monkeypatch.setattr(assembly, "TOKENIZER_MODULE", "diffulex.no_such_tokenizer_module")
    with pytest.raises(ModuleNotFoundError, match="diffulex.no_such_tokenizer_module"):
        Diffulex(str(sdar_dir), block_size=4, page_size=8, max_model_len=40, max_num_reqs=2)
