"""Helper processes compile the Triton kernel variants a dry warm-up records into the on-disk cache, where the
kernels' own launches then find them.

No GPU is needed: the kernels are compiled for a Hopper target (triton ships its assembler), and the launches go
through a stand-in for triton's CUDA driver that names device 0 and that target (a dry launch reaches no device).
The kernels' other tests run under triton's interpreter, set for the whole session before triton is imported, so
each case here runs in a fresh interpreter without it (`run_case`), and reports what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not hasattr(getattr(getattr(triton, "knobs", None), "runtime", None), "jit_cache_hook"):
    pytest.skip(f"triton {triton.__version__} has no jit_cache_hook: the build compiles without helpers",
                allow_module_level=True)

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNEL_SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)
'''
PRELUDE = '''
import json, os
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
import diffulex.kernels.parallel_compile as pc
from kernel_for_parallel_compile_test import scale

HOPPER = GPUTarget("cuda", 90, 32)


class HopperWithoutGPU:
    """What a launch asks triton's active driver: the device, its stream, its target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return HOPPER


driver.set_active(HopperWithoutGPU())


def cache_entries():
    folder = os.environ["TRITON_CACHE_DIR"]
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []
'''


def run_case(tmp_path: Path, body: str) -> dict:
    """Run `body` after `PRELUDE` in a fresh interpreter (no triton interpreter, an empty Triton cache in
    `tmp_path`); it prints one JSON object, returned here."""
    (tmp_path / "kernel_for_parallel_compile_test.py").write_text(KERNEL_SOURCE)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tmp_path), str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_dry_run_records_each_variant_and_launches_nothing(tmp_path):
    seen = run_case(tmp_path, '''
        import triton
        x, y = torch.ones(1024), torch.zeros(1024)
        variants = pc.record_launches(lambda: [scale[(4,)](x, y, n, BLOCK=256) for n in (1024, 1024, 1000)])
        print(json.dumps({"kernels": [[v.module, v.name] for v in variants], "y_untouched": bool((y == 0).all()),
                          "cache": cache_entries(), "hook_after": triton.knobs.runtime.jit_cache_hook is None}))
    ''')
    # n = 1024 twice is one variant; n = 1000 (not a multiple of 16) is another
    assert seen["kernels"] == [["kernel_for_parallel_compile_test", "scale"]] * 2
    assert seen["y_untouched"] and seen["cache"] == []  # nothing compiled, nothing ran
    assert seen["hook_after"]  # the hook was the dry run's only


def test_the_launches_find_what_the_helpers_compiled(tmp_path):
    seen = run_case(tmp_path, '''
        x, y = torch.ones(1024), torch.zeros(1024)

        def warm_up():
            for n in (1024, 1000):
                scale.warmup(x, y, n, BLOCK=256, grid=(4,))

        variants = pc.record_launches(warm_up)
        cached_before = [pc.is_cached(v, HOPPER) for v in variants]
        helpers = pc.CompileHelpers(2)
        try:
            compiled, errors = helpers.compile_variants(variants, HOPPER)
        finally:
            helpers.close()
        cached_after = [pc.is_cached(v, HOPPER) for v in variants]
        by_helpers = cache_entries()
        warm_up()  # the kernel's own compile path
        after_warm_up = cache_entries()
        scale.warmup(x, y, 1024, BLOCK=128, grid=(4,))  # a variant no helper compiled
        print(json.dumps({"before": cached_before, "compiled": compiled, "errors": list(errors),
                          "after": cached_after, "by_helpers": by_helpers, "after_warm_up": after_warm_up,
                          "after_new_variant": cache_entries()}))
    ''')
    assert seen["before"] == [False, False] and seen["after"] == [True, True]
    assert (seen["compiled"], seen["errors"]) == (2, [])
    assert seen["after_warm_up"] == seen["by_helpers"]  # every variant found in the cache, none compiled again
    assert len(seen["after_new_variant"]) == len(seen["by_helpers"]) + 1  # what no helper compiled is compiled here


def test_a_variant_a_helper_cannot_compile_is_reported_not_raised(tmp_path):
    seen = run_case(tmp_path, '''
        import dataclasses
        x, y = torch.ones(64), torch.zeros(64)
        (recorded,) = pc.record_launches(lambda: scale[(1,)](x, y, 64, BLOCK=64))
        helpers = pc.CompileHelpers(1)
        try:
            compiled, errors = helpers.compile_variants([dataclasses.replace(recorded, name="no_such_kernel")], HOPPER)
        finally:
            helpers.close()
        print(json.dumps({"compiled": compiled, "errors": list(errors)}))
    ''')
    assert seen["compiled"] == 0 and len(seen["errors"]) == 1 and "no_such_kernel" in seen["errors"][0]


def test_helpers_are_ended_when_the_warm_up_compiles_nothing(tmp_path):
    seen = run_case(tmp_path, '''
        helpers = pc.CompileHelpers(2)
        report = helpers.compile_for(lambda: None, HOPPER)
        print(json.dumps({"report": [report.recorded, report.missing, report.compiled],
                          "ended": helpers.ended()}))
    ''')
    assert seen["report"] == [0, 0, 0] and seen["ended"]


def test_a_warm_up_that_fails_in_the_dry_run_is_left_to_the_real_one(tmp_path):
    seen = run_case(tmp_path, '''
        def broken():
            raise ValueError("head_dim=24 must be a power of two >= 16")

        helpers = pc.CompileHelpers(1)
        report = helpers.compile_for(broken, HOPPER)
        print(json.dumps({"errors": list(report.errors), "ended": helpers.ended()}))
    ''')
    assert seen["errors"] == ["ValueError: head_dim=24 must be a power of two >= 16"] and seen["ended"]
