"""A CPU engine with its defaults: no Triton needed, threads set for the model, a page pool sized from the limits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import diffulex.engine.memory_plan as memory_plan
from diffulex import Diffulex, SamplingParams
from diffulex.engine.cpu_resources import usable_cores

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """The engine sets torch's thread count for the whole process: give the next test the count it had."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_default_cpu_engine_generates_where_triton_cannot_be_imported():
    """``pip install -e .`` installs no Triton; the CPU engine must build and generate without it (and without
    torch's compiler stack, whose import alone took longer than the whole build)."""
    script = textwrap.dedent(
        """
        import sys

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, NoTriton())
        import diffulex
        from diffulex import Diffulex, SamplingParams

        llm = Diffulex(diffulex.BUILTIN_MODEL)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = llm.generate(["To be, or not to be"], params, use_tqdm=False)
        assert out.trajectories[0].token_ids, "nothing was generated"
        print("GENERATED", len(out.trajectories[0].token_ids))
        print("IMPORTED", sorted(m for m in ("triton", "torch._dynamo") if m in sys.modules))
        llm.exit()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "GENERATED 8" in result.stdout
    assert "IMPORTED []" in result.stdout


def test_the_page_pool_holds_the_request_limits(sdar_dir):
    llm = Diffulex(str(sdar_dir), block_size=4, page_size=8, max_model_len=40, max_num_reqs=3)
    assert llm.runner.num_pages == 3 * 5  # 3 requests of ceil(40 / 8) pages
    assert llm.generate(["hello"], GREEDY, use_tqdm=False).trajectories[0].token_ids


def test_the_page_pool_is_capped_by_the_hosts_available_memory(sdar_dir, monkeypatch):
    fields = dict(block_size=4, page_size=8, max_model_len=40, max_num_reqs=100)
    page_bytes = Diffulex(str(sdar_dir), **fields).runner.page_bytes()
    share = memory_plan.CPU_KV_MEMORY_FRACTION
    monkeypatch.setattr(memory_plan, "available_memory", lambda: int(12 * page_bytes / share))
    assert Diffulex(str(sdar_dir), **fields).runner.num_pages == 12
    monkeypatch.setattr(memory_plan, "available_memory", lambda: int(2 * page_bytes / share))
    with pytest.raises(ValueError, match="not enough memory for the KV cache.*host memory available"):
        Diffulex(str(sdar_dir), **fields)


def test_the_cpu_page_pool_starts_zeroed(sdar_dir):
    llm = Diffulex(str(sdar_dir), block_size=4, page_size=8, max_model_len=40, max_num_reqs=2)
    for layer in llm.runner.attention_layers:
        assert layer.k_cache.dtype == llm.dtype and layer.k_cache.is_contiguous()
        assert not layer.k_cache.any() and not layer.v_cache.any()


def test_the_engine_sets_the_cpu_threads_it_chose(sdar_dir, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    Diffulex(str(sdar_dir), max_model_len=64)
    assert torch.get_num_threads() == 1  # a tiny model: one thread, whatever the machine
    Diffulex(str(sdar_dir), max_model_len=64, cpu_threads=2)
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Diffulex(str(sdar_dir), max_model_len=64)
    assert torch.get_num_threads() == 3  # the user's choice, kept; a warning only if it exceeds the usable cores
    assert any("cores: steps will wait" in str(w.message) for w in caught) == (3 > usable_cores())


def test_a_thread_count_below_one_is_refused(sdar_dir):
    with pytest.raises(ValueError, match="cpu_threads=0 is invalid: must be an integer > 0"):
        Diffulex(str(sdar_dir), cpu_threads=0)


def test_a_thread_count_the_machine_cannot_start_is_refused_before_the_build(sdar_dir, monkeypatch):
    """A million threads (libgomp fails to start them and ends the process, or it crashes) is refused with the field,
    the value and the bound, from the field or from ``OMP_NUM_THREADS``; the engine builds nothing."""
    from diffulex.engine.cpu_resources import max_cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with pytest.raises(ValueError, match=rf"cpu_threads=1000000 is invalid: must be at most {max_cpu_threads()} "):
        Diffulex(str(sdar_dir), cpu_threads=1_000_000)
    monkeypatch.setenv("OMP_NUM_THREADS", "65536")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS=65536 is invalid: must be at most"):
        Diffulex(str(sdar_dir), max_model_len=64)


def test_a_page_count_the_host_cannot_hold_is_refused_naming_the_field(sdar_dir):
    """An explicit ``num_pages`` of a petabyte-scale pool fails its allocation: the error names the field, the value
    and the size, and suggests the planned default, instead of a bare MemoryError."""
    with pytest.raises(ValueError, match=r"num_pages=1000000000000 is invalid: its KV cache takes [\d.]+ GiB, more "
                                         r"than the device can allocate \(MemoryError\)"):  # fmt: skip
        Diffulex(str(sdar_dir), num_pages=10**12, max_model_len=64)
