"""Helper processes compile the Triton kernel variants a dry warm-up records into the on-disk cache, where the
kernels' own launches then find them; a dry pass leaves no trace but the recorded variants, and refuses to read
device data.

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
import torch

triton = pytest.importorskip("triton")
if not hasattr(getattr(getattr(triton, "knobs", None), "runtime", None), "jit_cache_hook"):
    pytest.skip(f"triton {triton.__version__} has no jit_cache_hook: the build compiles without helpers",
                allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402

import diffulex.kernels.parallel_compile as pc  # noqa: E402  (only once triton's hook is known to be there)

HOPPER_IN_PROCESS = GPUTarget("cuda", 90, 32)

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a launch needs a GPU")
def test_a_first_launch_finds_the_launcher_a_helper_built_gpu(tmp_path):
    """A helper builds the variant's host-side launcher too (a C module per argument signature), so that the
    build's first launch of it compiles nothing at all."""
    (tmp_path / "kernel_for_parallel_compile_test.py").write_text(KERNEL_SOURCE)
    body = textwrap.dedent('''
        import json, os
        import torch
        from triton.runtime import driver
        import diffulex.kernels.parallel_compile as pc
        from kernel_for_parallel_compile_test import scale

        x, y = torch.ones(1000, device="cuda"), torch.zeros(1000, device="cuda")
        (variant,) = pc.record_launches(lambda: scale[(4,)](x, y, 1000, BLOCK=256))
        target = driver.active.get_current_target()
        pc.build_launcher(pc.compile_variant(variant, target), target)  # as a helper does
        folder = os.environ["TRITON_CACHE_DIR"]
        by_helper = sorted(os.listdir(folder))
        scale[(4,)](x, y, 1000, BLOCK=256)
        print(json.dumps({"by_helper": by_helper, "after_launch": sorted(os.listdir(folder)),
                          "doubled": bool((y == 2).all())}))
    ''')
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tmp_path), str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    done = subprocess.run([sys.executable, "-c", body], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["doubled"]
    assert len(seen["by_helper"]) >= 2, "the kernel and its launcher"
    assert seen["after_launch"] == seen["by_helper"]


@pytest.mark.parametrize("one_died", [False, True], ids=["both-working", "one-died-first"])
def test_helpers_are_handed_variants_one_at_a_time_until_none_is_left(tmp_path, one_died):
    """Fewer helpers than variants: each is handed the next as it answers, and every variant gets compiled, those
    handed to a helper that had died by another."""
    seen = run_case(tmp_path, f'''
        x, y = torch.ones(1024), torch.zeros(1024)
        launches = [(n, block) for n in (1024, 1000) for block in (128, 256)]
        variants = pc.record_launches(lambda: [scale[(4,)](x, y, n, BLOCK=block) for n, block in launches])
        helpers = pc.CompileHelpers(2)
        try:
            if {one_died}:
                helpers._helpers[0].kill()
                helpers._helpers[0].wait()
            compiled, errors = helpers.compile_variants(variants, HOPPER)
        finally:
            helpers.close()
        print(json.dumps({{"recorded": len(variants), "compiled": compiled, "errors": list(errors),
                          "cached": [pc.is_cached(v, HOPPER) for v in variants]}}))
    ''')
    assert seen["recorded"] == 4 and seen["compiled"] == 4 and seen["errors"] == []
    assert all(seen["cached"])


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


def test_helpers_not_started_with_the_build_start_only_for_enough_missing_variants(tmp_path):
    seen = run_case(tmp_path, '''
        pc.MIN_MISSING_FOR_HELPERS = 3  # the rule at a threshold this machine's cores start quickly
        x, y = torch.ones(1024), torch.zeros(1024)

        def launches(count):
            return lambda: [scale[(4,)](x, y, 1024, BLOCK=2 ** (4 + i)) for i in range(count)]

        seen = {}
        for name, count in (("few", 2), ("many", 3)):
            helpers = pc.CompileHelpers(8, start_now=False)
            at_build = helpers.started
            report = helpers.compile_for(launches(count), HOPPER)
            seen[name] = [at_build, report.missing, helpers.started, report.compiled, helpers.ended()]
        print(json.dumps(seen))
    ''')
    assert seen["few"] == [0, 2, 0, 0, True]  # left to the build's own warm-ups: no helper's imports for them
    assert seen["many"] == [0, 3, 3, 3, True]  # one helper a variant, up to the cap


def test_a_variant_being_compiled_is_locked_for_every_other_process(tmp_path):
    seen = run_case(tmp_path, '''
        import fcntl, subprocess, sys
        (variant,) = pc.record_launches(lambda: scale[(1,)](torch.ones(64), torch.zeros(64), 64, BLOCK=64))
        (other,) = pc.record_launches(lambda: scale[(1,)](torch.ones(64), torch.zeros(64), 64, BLOCK=32))
        probe = """
        import fcntl, os, sys
        fd = os.open(sys.argv[1], os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(sys.argv[2]))
            print("free")
        except OSError:
            print("held")
        """

        def seen_by_another_process(v):
            path, slot = pc.variant_lock_slot(v, HOPPER)
            probed = subprocess.run([sys.executable, "-c", probe, path, str(slot)], capture_output=True, text=True,
                                    check=True)
            return probed.stdout.strip()

        with pc._variant_lock(variant, HOPPER):
            during = [seen_by_another_process(variant), seen_by_another_process(other)]
        slots = [pc.variant_lock_slot(v, HOPPER) for v in (variant, other)]
        print(json.dumps({"during": during, "after": seen_by_another_process(variant),
                          "slots_differ": slots[0] != slots[1]}))
    ''')
    assert seen["slots_differ"]
    assert seen["during"] == ["held", "free"]  # another variant's compile does not wait
    assert seen["after"] == "free"


def test_a_launch_under_compile_locks_waits_for_another_process_compiling_its_variant(tmp_path):
    """The other process (a helper, a rank, a test worker) holds the variant's lock while it compiles; the launch
    waits for it, then finds the variant in the cache instead of compiling it again."""
    (tmp_path / "launcher.py").write_text(PRELUDE + textwrap.dedent('''
        import time
        import triton
        hits = []
        triton.knobs.compilation.listener = lambda *, cache_hit, **kwargs: hits.append(cache_hit)
        start = time.monotonic()
        with pc.compile_locks() as launched:
            scale.warmup(torch.ones(64), torch.zeros(64), 64, BLOCK=64, grid=(1,))
        print(json.dumps({"hits": hits, "waited_s": time.monotonic() - start,
                          "launched": [[v.name, v.specialization] for v in launched]}))
    '''))
    seen = run_case(tmp_path, '''
        import subprocess, sys, time
        import triton
        (variant,) = pc.record_launches(lambda: scale[(1,)](torch.ones(64), torch.zeros(64), 64, BLOCK=64))
        with pc._variant_lock(variant, HOPPER):
            launcher = subprocess.Popen([sys.executable, "launcher.py"], stdout=subprocess.PIPE, text=True)
            time.sleep(10)  # the launcher imports, launches and waits for the lock (unlocked, it compiles now)
            src, options = pc._compile_inputs(variant, HOPPER)
            triton.compile(src, target=HOPPER, options=options)
        out, _ = launcher.communicate(timeout=120)
        seen = json.loads(out.strip().splitlines()[-1])
        seen["recorded"] = [variant.name, variant.specialization]
        print(json.dumps(seen))
    ''')
    assert seen["hits"] == [True]  # one compile asked for, found in the cache
    assert seen["waited_s"] > 1.0
    assert seen["launched"] == [seen["recorded"]]  # what a launch compiles is named as a dry pass records it


def test_a_lock_never_let_go_delays_a_compile_but_never_hangs_it(tmp_path):
    (tmp_path / "waiter.py").write_text(PRELUDE + textwrap.dedent('''
        import sys, time
        pc.LOCK_WAIT_S = 1.0
        (variant,) = pc.record_launches(lambda: scale[(1,)](torch.ones(64), torch.zeros(64), 64, BLOCK=64))
        start = time.monotonic()
        with pc._variant_lock(variant, HOPPER):
            print(json.dumps({"entered_after_s": time.monotonic() - start}))
    '''))
    seen = run_case(tmp_path, '''
        import subprocess, sys
        (variant,) = pc.record_launches(lambda: scale[(1,)](torch.ones(64), torch.zeros(64), 64, BLOCK=64))
        with pc._variant_lock(variant, HOPPER):  # held for the waiter's whole life
            done = subprocess.run([sys.executable, "waiter.py"], capture_output=True, text=True, timeout=120)
        print(done.stdout.strip().splitlines()[-1])
    ''')
    assert 1.0 <= seen["entered_after_s"] < 30.0


def test_a_recorded_variant_never_launched_is_named_with_what_differs():
    def variant(name: str, **spec) -> pc.KernelVariant:
        return pc.KernelVariant("kernels", name, json.dumps(spec))

    launched = [variant("skinny", attrs=[[16]], warps=4), variant("skinny", attrs=[[1]], warps=8), variant("norm")]
    recorded = (launched[0], variant("skinny", attrs=[[1]], warps=4), variant("top1", warps=4))
    assert pc.never_launched(recorded, launched) == [
        "skinny: attrs=[[1]] (launched: [[16]])",  # the nearest launched variant differs in one field
        "top1: no launched variant of that kernel",
    ]


def test_a_launched_variant_the_dry_pass_missed_is_named_by_the_argument_that_differs():
    def variant(readers_divisibility: list, block: int = 64) -> pc.KernelVariant:
        spec = {"name": "skinny", "signature": {"x_ptr": "*bf16", "num_readers": "i32", "BLOCK": "constexpr"},
                "constant_keys": [[2]], "constant_vals": [block], "attrs_keys": [[0], [1]],
                "attrs_vals": [[["tt.divisibility", 16]], readers_divisibility], "options": {"num_warps": 4},
                "key": "the cache key, which repeats the rest"}
        return pc.KernelVariant("kernels", "skinny", json.dumps(spec))

    recorded = (variant([["tt.divisibility", 16]]), variant([["tt.divisibility", 16]], block=128))
    launched = [recorded[0], variant([])]
    assert pc.unforeseen(launched, recorded) == [
        'skinny: num_readers attrs=[] (recorded: [["tt.divisibility", 16]])'
    ]
    assert pc.never_launched(recorded, launched) == ["skinny: BLOCK=128 (launched: 64)"]


def test_a_warm_up_that_fails_in_the_dry_run_is_left_to_the_real_one(tmp_path):
    seen = run_case(tmp_path, '''
        def broken():
            raise ValueError("head_dim=24 must be a power of two >= 16")

        helpers = pc.CompileHelpers(1)
        report = helpers.compile_for(broken, HOPPER)
        print(json.dumps({"errors": list(report.errors), "ended": helpers.ended()}))
    ''')
    assert seen["errors"] == ["warm-up: ValueError: head_dim=24 must be a power of two >= 16"] and seen["ended"]


def test_named_warm_ups_are_recorded_in_one_pass_and_a_failing_one_keeps_the_others(tmp_path):
    seen = run_case(tmp_path, '''
        x, y = torch.ones(1024), torch.zeros(1024)

        def reads_back():
            scale[(4,)](x, y, 1000, BLOCK=256)
            raise RuntimeError("a probe read its result back")

        warm_ups = {
            "forward": lambda: scale[(4,)](x, y, 1024, BLOCK=256),
            "probe": reads_back,
            "sampling": lambda: [scale[(4,)](x, y, 1024, BLOCK=b) for b in (256, 128)],
        }
        helpers = pc.CompileHelpers(2)
        report = helpers.compile_for(warm_ups, HOPPER)
        print(json.dumps({"recorded": report.recorded, "by": report.recorded_by, "missing": report.missing,
                          "compiled": report.compiled, "errors": list(report.errors), "ended": helpers.ended(),
                          "cached": [pc.is_cached(v, HOPPER) for v in pc.record_launches(lambda: [
                              warm_up() for name, warm_up in warm_ups.items() if name != "probe"])]}))
    ''')
    # the sampling warm-up's BLOCK=256 launch is the forward's variant: recorded once, by the first
    assert seen["by"] == {"forward": 1, "probe": 1, "sampling": 1}
    assert (seen["recorded"], seen["missing"], seen["compiled"]) == (3, 3, 3)
    assert seen["errors"] == ["probe: RuntimeError: a probe read its result back"] and seen["ended"]
    assert seen["cached"] == [True, True]  # what the failing warm-up launched before it failed is compiled too


def test_a_dry_pass_refuses_to_read_device_tensors_on_the_host(monkeypatch):
    monkeypatch.setattr(pc, "HOST_DEVICE_TYPES", ("meta",))  # this machine's tensors stand for a device's
    tensor = torch.tensor([3, 4])
    with pc.dry_pass():
        assert pc.in_dry_pass()
        for read in (tensor.tolist, tensor[0].item, tensor.cpu, tensor.numpy, lambda: bool(tensor[0]),
                     lambda: int(tensor[0]), lambda: float(tensor[0]), lambda: [0, 1, 2][tensor[0]]):
            with pytest.raises(pc.DryPassReadError, match="read a cpu tensor on the host"):
                read()
        assert torch.empty(2, device="meta").shape == (2,)  # no data: nothing to read
    assert not pc.in_dry_pass()
    assert tensor.tolist() == [3, 4] and int(tensor[1]) == 4  # as before, once the pass has ended
    assert all(name not in torch.Tensor.__dict__ for name in ("item", "tolist", "__bool__"))


def test_a_read_back_in_a_warm_up_ends_only_its_own_dry_run(monkeypatch):
    monkeypatch.setattr(pc, "HOST_DEVICE_TYPES", ("meta",))
    ran = []

    def reads_back():
        ran.append("reads back")
        if torch.zeros(1).item() == 0:  # a dry run must never branch on what a skipped launch would have written
            ran.append("acted on garbage")

    helpers = pc.CompileHelpers(1)
    report = helpers.compile_for({"probe": reads_back, "after": lambda: ran.append("after")}, HOPPER_IN_PROCESS)
    assert ran == ["reads back", "after"]
    assert len(report.errors) == 1 and report.errors[0].startswith("probe: DryPassReadError")
    assert helpers.ended()


def test_a_dry_pass_forgets_the_variants_an_eager_skinny_call_recorded():
    skinny_gemm = pytest.importorskip("diffulex.kernels.skinny_gemm")
    earlier = ("an earlier eager call",)
    skinny_gemm._WARMED.add(earlier)
    try:
        with pc.dry_pass():
            skinny_gemm._WARMED.add(("a variant whose compile the dry pass skipped",))
        assert earlier in skinny_gemm._WARMED
        assert ("a variant whose compile the dry pass skipped",) not in skinny_gemm._WARMED
    finally:
        skinny_gemm._WARMED.discard(earlier)


def test_a_dry_pass_forgets_them_too_when_its_first_launch_imports_the_skinny_gemm():
    """In a fresh process nothing has imported the skinny GEMM before the build's dry pass, whose first dense forward
    then does: what it records there must still be gone afterwards, or the real warm-ups skip every such variant."""
    script = textwrap.dedent("""
        import sys
        import diffulex.kernels.parallel_compile as pc
        assert "diffulex.kernels.skinny_gemm" not in sys.modules
        with pc.dry_pass():
            from diffulex.kernels import skinny_gemm
            skinny_gemm._WARMED.add(("recorded dry",))
        assert skinny_gemm._WARMED == set(), skinny_gemm._WARMED
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_hook_in_place_before_a_dry_pass_is_put_back_after_one_that_raised():
    def outer_hook(**_):
        return False

    triton.knobs.runtime.jit_cache_hook = outer_hook
    try:
        with pytest.raises(ValueError), pc.dry_pass():
            raise ValueError("a warm-up bug")
        assert triton.knobs.runtime.jit_cache_hook is outer_hook and not pc.in_dry_pass()
    finally:
        triton.knobs.runtime.jit_cache_hook = None


def test_the_sampling_warm_up_is_recorded_dry_and_its_variants_compiled_by_the_helpers(tmp_path):
    seen = run_case(tmp_path, '''
        from diffulex.kernels import acceptance, split_counters, top1

        cpu = torch.device("cpu")
        split_counters._SM_COUNT[cpu] = 132  # an H100's, which the top-1 split plans read

        def warm_up():  # the multi_bd sampler's warm-up (`MultiBDSampler.warm_up`) for 64 rows
            top1.warm_up(cpu, 1000, torch.bfloat16, 990, 3, 64)
            acceptance.warm_up(cpu, 0.9, 64)

        helpers = pc.CompileHelpers(2)
        report = helpers.compile_for({"sampling": warm_up}, HOPPER)
        variants = pc.record_launches(warm_up)
        print(json.dumps({"names": sorted({v.name for v in variants}), "report": [report.recorded, report.missing,
                          report.compiled], "errors": list(report.errors), "ended": helpers.ended(),
                          "cached": [pc.is_cached(v, HOPPER) for v in variants]}))
    ''')
    assert {"_accept_kernel"} < set(seen["names"]) and any("top1" in name for name in seen["names"])
    recorded, missing, compiled = seen["report"]
    assert recorded == missing == compiled == len(seen["cached"]) and seen["errors"] == [] and seen["ended"]
    assert all(seen["cached"])  # the real warm-up finds every variant it launches in the cache


def test_another_threads_launches_compile_as_they_would_during_a_dry_pass(tmp_path):
    seen = run_case(tmp_path, '''
        import threading
        x, y = torch.ones(64), torch.zeros(64)
        elsewhere = []
        with pc.dry_pass() as variants:
            scale[(1,)](x, y, 64, BLOCK=64)  # this thread's: recorded, skipped
            thread = threading.Thread(target=lambda: elsewhere.append(scale.warmup(x, y, 48, BLOCK=64, grid=(1,))))
            thread.start()
            thread.join()
        print(json.dumps({"recorded": len(variants), "compiled_elsewhere": elsewhere[0] is not None,
                          "cache": len(cache_entries())}))
    ''')
    assert seen == {"recorded": 1, "compiled_elsewhere": True, "cache": 1}
