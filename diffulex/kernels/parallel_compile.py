"""Compiling a build's Triton kernel variants in helper processes, all at once, before its warm-ups run.

Why processes: a cold start compiles its variants one after another, and Triton's compile holds the interpreter's
lock for nearly all of its work, so threads cannot share it (measured with triton 3.6 on two cores: six compiles
took 1.16 s on one thread, 1.30 s on two threads, 0.76 s on two processes).

How: on an empty Triton cache `CompileHelpers` starts the helpers when the build begins, so that their imports
(torch, triton, the kernel modules) run while the weights load; otherwise it starts them only for what turns out to
be missing. `CompileHelpers.compile_for` then runs the build's warm-ups *dry*
(`dry_pass`): through Triton's ``jit_cache_hook`` every launch that would compile is recorded and skipped (nothing
is compiled, that kernel does not run). The recorded variants that Triton's on-disk cache lacks are handed to the
helpers one at a time, the longest kernels first, and they compile them into that cache; then the caller runs the
warm-ups for real and finds each variant there. The engine's build (`diffulex.engine.assembly`) runs its profile
forward, the attention warm-up, the CUDA graphs' warm-up forwards and the sampling warm-up dry, in one pass before the
first of them runs for real (unless its manifest, `diffulex.kernels.build_manifest`, shows every variant it will
launch cached already). Once done compiling, each helper builds its variants' launchers as well (`build_launcher`),
the host-side C modules Triton otherwise builds on a variant's first launch.

Builds on one host at once (tensor-parallel ranks, data-parallel replicas, a test suite's workers) would compile
the same variants side by side: every compile, a helper's or a real warm-up's (`compile_locks`), holds a lock per
variant that the others wait on, and then find the variant in the cache.

The helpers only ever fill the cache: one that fails, is slow or compiles under another key changes nothing but the
time, since the real warm-up compiles whatever it does not find (and raises what a broken kernel raises). They are
plain subprocesses (never ``multiprocessing``, which would import the user's ``__main__`` again) and never touch
the GPU (the target is handed to them).

What a dry pass may run: a skipped launch leaves its outputs unwritten, so whatever reads them afterwards sees
garbage. A warm-up run dry must therefore never read device data back to the host (a ``.item()``, ``.tolist()``,
``bool()`` of a device tensor: `dry_pass` turns such a read into `DryPassReadError`, which ends that warm-up's dry
run) and never index memory with values a kernel computed (a garbage index could fault the device, which no
exception undoes): the engine runs dry only warm-ups whose inputs are placeholders made on the host and whose
device-computed values flow only into arithmetic (its dense forwards, the attention and sampling warm-ups; not
an MoE forward, whose expert routing indexes by the router's output). Kernels compiled before the pass launch for
real (the hook sees only compiles), on those same placeholders. Build state that a launch records (which skinny
GEMM variants an eager call has compiled) is put back as it was once the pass ends, so that the real warm-up
compiles them again.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import json
import logging
import os
import selectors
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diffulex.kernels.compile_log import log_compiles_from_env

logger = logging.getLogger("diffulex")

HELPER_COMMAND = "from diffulex.kernels.parallel_compile import serve; serve()"
# the modules a helper imports before it is handed any variant (the kernels the dry warm-ups launch)
HELPER_MODULES = (
    "diffulex.kernels.paged_attention",
    "diffulex.kernels.kv_store",
    "diffulex.kernels.skinny_gemm",
    "diffulex.kernels.fused_norm",
    "diffulex.kernels.activation",
    "diffulex.kernels.token_inputs",
    "diffulex.kernels.top1",
    "diffulex.kernels.acceptance",
    "diffulex.kernels.edit_acceptance",
    "diffulex.kernels.step_advance",
    "diffulex.kernels.host_publish",
)
# Sets in which a launch records that it has compiled a variant, so that later calls skip it: (module, name). A dry
# pass skips the compile, so it puts each back as it found it.
WARM_STATE = (("diffulex.kernels.skinny_gemm", "_WARMED"),)
# Helpers compile one variant each at a time, on a core each (a compile is single-threaded and CPU-bound), so a
# start compiles about as fast as it has idle cores up to this many; builds that share a host's cores (a test
# suite's workers) cap theirs with DIFFULEX_COMPILE_HELPERS (`diffulex.engine.assembly.helper_limit`).
MAX_HELPERS = 16
ANSWER_PREFIX = "DIFFULEX_COMPILED "  # a helper's answer lines, told apart from anything a library prints
# fewer missing variants than this are left to the build's own warm-ups when no helper runs yet: starting helpers
# costs their imports (about 4 s on an H100 host: as long as compiling several variants one after another)
MIN_MISSING_FOR_HELPERS = 8
LOCK_SLOTS = 1 << 20  # bytes of the lock file the variants' locks are spread over (`_variant_lock`)
LOCK_WAIT_S = 60.0  # the longest a compile waits for another process's compile of its variant (some take 20 s)
LOCK_POLL_S = 0.05
HELPER_TIMEOUT_S = 120.0  # past this the helpers are ended and the real warm-up compiles what is left


@dataclass(frozen=True)
class KernelVariant:
    """One compile a launch asked for: the kernel (module and name) and Triton's specialization data (JSON)."""

    module: str
    name: str
    specialization: str


def parallel_compile_supported() -> bool:
    """Whether this triton has the hook a dry run needs, and compiles for real (not under its interpreter)."""
    try:
        import triton
    except ImportError:
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return hasattr(runtime, "jit_cache_hook") and not runtime.interpret


class DryPassReadError(RuntimeError):
    """A warm-up run dry read device data on the host: a value a skipped launch should have written."""


_DRY_PASS: contextvars.ContextVar[bool] = contextvars.ContextVar("diffulex_dry_pass", default=False)
# the tensor methods that bring a device tensor's values to the host, each refused on a device tensor in a dry pass
_HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
HOST_DEVICE_TYPES = ("cpu", "meta")  # tensors a dry pass may read on the host: host memory, or no data at all


def in_dry_pass() -> bool:
    """Whether this code runs inside `dry_pass`: where a warm-up must skip what reads results back (a probe that
    checks a kernel's output) rather than act on garbage."""
    return _DRY_PASS.get()


@contextlib.contextmanager
def _host_reads_refused() -> Iterator[None]:
    """Make each of `_HOST_READS` raise `DryPassReadError` on a tensor outside host memory, for the block's time
    and only in a dry pass's context (another thread reads as it would)."""
    import torch

    own = {name: torch.Tensor.__dict__.get(name) for name in _HOST_READS}

    def refusing(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _DRY_PASS.get() and self.device.type not in HOST_DEVICE_TYPES:
                raise DryPassReadError(f"a dry warm-up read a {self.device} tensor on the host (Tensor.{name})")
            return original(self, *args, **kwargs)

        return guarded

    for name in _HOST_READS:
        setattr(torch.Tensor, name, refusing(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, original in own.items():
            if original is None:  # inherited from torch's C base class: uncover it again
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def _warm_state_kept() -> Iterator[None]:
    """Put each of `WARM_STATE`'s sets back as it was when the block began. Its module is imported first where no
    launch has imported it yet: otherwise the first launch inside the block would import it and fill its set, which
    would then outlive the block, so that the real warm-ups would skip (as done) every variant the dry pass recorded
    and leave it to the graphs' capture to compile."""
    saved = []
    for module_name, name in WARM_STATE:
        state = getattr(importlib.import_module(module_name), name)
        saved.append((state, set(state)))
    try:
        yield
    finally:
        for state, contents in saved:
            state.clear()
            state.update(contents)


@contextlib.contextmanager
def dry_pass() -> Iterator[list[KernelVariant]]:
    """Within the block, every Triton launch that would compile is skipped and its variant appended to the list
    yielded (once each); reading a device tensor on the host raises `DryPassReadError`; `in_dry_pass` is true;
    `WARM_STATE` is put back at the end. Needs triton (`parallel_compile_supported`)."""
    import triton

    recorded: dict[KernelVariant, None] = {}
    variants: list[KernelVariant] = []
    runtime = triton.knobs.runtime
    previous = runtime.jit_cache_hook

    def record(*, fn: Any, compile: dict[str, Any], **kwargs: Any) -> bool:
        if not _DRY_PASS.get():  # another thread's launch (the hook is the process's): compiled as it would be
            return bool(previous(fn=fn, compile=compile, **kwargs)) if previous is not None else False
        variant = KernelVariant(fn.module, fn.name, compile["specialization_data"])
        if variant not in recorded:
            recorded[variant] = None
            variants.append(variant)
        return True  # skip: neither compiled nor launched

    runtime.jit_cache_hook = record
    token = _DRY_PASS.set(True)
    try:
        with _warm_state_kept(), _host_reads_refused():
            yield variants
    finally:
        _DRY_PASS.reset(token)
        runtime.jit_cache_hook = previous


def record_launches(warm_up: Callable[[], None]) -> list[KernelVariant]:
    """Run `warm_up` dry (`dry_pass`) and return what it would compile."""
    with dry_pass() as variants:
        warm_up()
    return list(variants)


def _kernel(variant: KernelVariant) -> Any:
    """The JIT function a variant names (unwrapped from any decorator that holds it as ``fn``)."""
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(variant.module), variant.name)
    while not isinstance(kernel, JITFunction) and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def _as_tuples(value: Any) -> Any:
    """JSON gives lists where Triton's keys and signatures hold tuples."""
    return tuple(_as_tuples(item) for item in value) if isinstance(value, list) else value


def _compile_inputs(variant: KernelVariant, target: Any) -> tuple[Any, dict[str, Any]]:
    """The source and options `triton.compile` gets for this variant: what the JIT would have passed it."""
    import triton.language as tl
    from triton.compiler import ASTSource

    data = json.loads(variant.specialization)
    constants = {}
    for key, value in zip(data["constant_keys"], data["constant_vals"], strict=True):
        if tl.dtype.is_dtype(value):
            value = tl.dtype(value)
        elif isinstance(value, dict) and "constexpr" in value:
            value = tl.constexpr(_as_tuples(value["constexpr"]))
        elif isinstance(value, dict) and "jit_function" in value:  # a kernel handed to a kernel: "module:name"
            module, name = value["jit_function"].split(":")
            value = _kernel(KernelVariant(module, name, ""))
        else:
            value = _as_tuples(value)
        constants[tuple(key)] = value
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"], strict=True))
    signature = {name: _as_tuples(kind) for name, kind in data["signature"].items()}
    options = {name: _as_tuples(value) for name, value in data["options"].items()}
    return ASTSource(_kernel(variant), signature, constants, attrs), options


def is_cached(variant: KernelVariant, target: Any) -> bool:
    """Whether Triton's on-disk cache holds this variant for `target` (looked up as `triton.compile` does)."""
    import hashlib

    from triton.compiler import compiler  # the names `triton.compile` looks its cache up with

    src, options = _compile_inputs(variant, target)
    backend = compiler.make_backend(target)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = compiler.get_cache_key(src, backend, parsed, env_vars=compiler.get_cache_invalidating_env_vars())
    manager = compiler.get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
    name = f"{src.name[:150]}.json"
    return bool((manager.get_group(name) or {}).get(name))


def compile_variant(variant: KernelVariant, target: Any) -> Any:
    """Compile one variant for `target` into Triton's on-disk cache (no device needed); the compiled kernel (for
    `build_launcher`). Builds on one machine (replicas, tensor-parallel ranks, a test suite's workers) wait for each
    other's compile of a variant (`_variant_lock`), and ``triton.compile`` then finds it in the cache instead of
    compiling it again."""
    import triton

    with _variant_lock(variant, target):
        src, options = _compile_inputs(variant, target)
        return triton.compile(src, target=target, options=options)


def build_launcher(kernel: Any, target: Any) -> None:
    """Build the host-side launcher of a compiled variant into Triton's cache, as its first launch would.

    Why: on NVIDIA GPUs Triton launches a kernel through a small C module made for its argument types, compiled with
    the system's C compiler on the first launch in a process whose cache lacks it (half a second to a second each;
    the SDAR-1.7B geometry's build needs about ten, which its first start otherwise compiled one after another
    while capturing its graphs). It needs no device. Any failure is left unsaid: the first launch builds it."""
    if getattr(target, "backend", None) != "cuda":
        return
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        # one launcher serves every variant of its argument types: helpers building it at once wait for the first
        key = repr([sorted(kernel.src.signature.items()), getattr(kernel.metadata, "tensordesc_meta", None)])
        with _slot_lock(*_lock_slot(key)):
            CudaLauncher(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001, S110  (an internal of triton changed: the launch builds its launcher itself)
        pass


def variant_lock_slot(variant: KernelVariant, target: Any) -> tuple[str, int]:
    """The lock file and the byte of it (of `LOCK_SLOTS`, by the variant's hash) that stand for this variant of
    this Triton cache, for this target."""
    return _lock_slot(json.dumps([asdict(variant), [target.backend, target.arch, target.warp_size]]))


def _lock_slot(key: str) -> tuple[str, int]:
    """The lock file and the byte of it that stand for `key` in this Triton cache."""
    import hashlib
    import tempfile

    import triton

    digest = hashlib.sha256(json.dumps([triton.knobs.cache.dir, key]).encode()).digest()
    slot = int.from_bytes(digest[:8], "little") % LOCK_SLOTS
    return os.path.join(tempfile.gettempdir(), f"diffulex-compile-{os.getuid()}.lock"), slot


def _variant_lock(variant: KernelVariant, target: Any) -> contextlib.AbstractContextManager[None]:
    """Hold, across this machine's processes, the lock of this variant (`variant_lock_slot`)."""
    return _slot_lock(*variant_lock_slot(variant, target))


@contextlib.contextmanager
def _slot_lock(path: str, slot: int) -> Iterator[None]:
    """Hold a POSIX record lock on byte `slot` of `path`, released when the process closes the file or ends. Two
    keys whose bytes collide only wait for each other. The wait is bounded (`LOCK_WAIT_S`), then the block runs
    without the lock: a holder that never lets go (a rank whose compile failed and which now waits in a collective
    for this one) costs a repeated compile, never a hang. No lock where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system: the compiles may repeat, nothing else changes
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
                break
            except OSError:  # held by another process
                if time.monotonic() >= deadline:
                    break
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def compile_locks() -> Iterator[list[KernelVariant]]:
    """Within the block, each compile a launch of this process starts holds its variant's lock (`_variant_lock`,
    the lock a helper compiling that variant holds): processes building at once on one host (tensor-parallel
    ranks, replicas, test workers) compile a variant once, the others then finding it in Triton's cache
    (``triton.compile`` looks there first). Taken in Triton's ``jit_cache_hook`` (called before a compile) and
    released in its ``jit_post_compile_hook`` (after it) or at the block's end; the hooks in place before are still
    called, and put back at the end. Yields the list of the variants compiled (or looked up on disk) in the block, in
    order. Needs triton (`parallel_compile_supported`)."""
    import triton
    from triton.runtime import driver

    runtime = triton.knobs.runtime
    previous_before, previous_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    held = contextlib.ExitStack()
    launched: list[KernelVariant] = []

    def before(*, fn: Any, compile: dict[str, Any], **kwargs: Any) -> bool:
        held.close()  # the lock of a compile that raised (no post-compile call came for it)
        if previous_before is not None and previous_before(fn=fn, compile=compile, **kwargs):
            return True  # another hook skips this compile: nothing to lock
        variant = KernelVariant(fn.module, fn.name, compile["specialization_data"])
        launched.append(variant)
        held.enter_context(_variant_lock(variant, driver.active.get_current_target()))
        return False

    def after(**kwargs: Any) -> None:
        held.close()
        if previous_after is not None:
            previous_after(**kwargs)

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
    try:
        yield launched
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = previous_before, previous_after
        held.close()


def _read_jobs(lines: Iterator[str]) -> Iterator[tuple[KernelVariant, Any]]:
    from triton.backends.compiler import GPUTarget

    for line in lines:
        if line.strip():
            job = json.loads(line)
            yield KernelVariant(**job["variant"]), GPUTarget(*job["target"])


def serve() -> None:
    """A helper's life: import the kernels, then compile each variant read from stdin (one JSON line each) until
    stdin ends, answering one line per variant on stdout (`ANSWER_PREFIX`, then JSON; an error is reported there,
    never raised); then build the compiled variants' launchers (`build_launcher`)."""
    log_compiles_from_env("compile helper")
    for module in HELPER_MODULES:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001, S112  (a variant of that module then fails alone, and is reported)
            continue
    compiled = []
    for variant, target in _read_jobs(iter(sys.stdin.readline, "")):
        try:
            compiled.append((compile_variant(variant, target), target))
            answer: dict[str, Any] = {"ok": True}
        except Exception as err:  # noqa: BLE001  (the real warm-up compiles it again and raises for itself)
            answer = {"ok": False, "error": f"{variant.name}: {type(err).__name__}: {err}"}
        print(ANSWER_PREFIX + json.dumps(answer), flush=True)
    for kernel, target in compiled:  # after every compile: a launcher another helper is building is waited for
        build_launcher(kernel, target)


@dataclass
class CompileReport:
    """What the helpers did for the warm-ups: variants recorded (all told and per warm-up), of them missing from the
    cache, compiled; the dry runs' and the helpers' errors."""

    variants: tuple[KernelVariant, ...] = ()  # those recorded, in order
    missing: int = 0
    missing_names: tuple[str, ...] = ()  # the kernel of each missing variant
    compiled: int = 0
    errors: tuple[str, ...] = ()
    recorded_by: dict[str, int] = field(default_factory=dict)  # variants each named warm-up launched

    @property
    def recorded(self) -> int:
        """How many variants the dry pass recorded."""
        return len(self.variants)


def never_launched(recorded: tuple[KernelVariant, ...], launched: list[KernelVariant]) -> list[str]:
    """Each variant the dry pass recorded that the real warm-ups never compiled (`compile_locks` saw them all), with
    what tells it from the nearest variant of that kernel they did compile (`_unmatched`). A warm start finds such a
    variant missing from the cache every time, so it is what a dry pass that foresees the warm-ups exactly must not
    produce."""
    return _unmatched(list(recorded), launched, "launched")


def unforeseen(launched: list[KernelVariant], recorded: tuple[KernelVariant, ...]) -> list[str]:
    """Each variant the real warm-ups compiled that the dry pass did not record, with what tells it from the nearest
    recorded variant of that kernel (`_unmatched`): the compiles the build still made itself, one after another
    (a capture's among them), which the dry pass should have foreseen."""
    return _unmatched(launched, list(recorded), "recorded")


def _unmatched(variants: list[KernelVariant], others: list[KernelVariant], label: str) -> list[str]:
    """``kernel: field=value (label: other value); ...`` for each of `variants` not among `others`, the fields
    (`_spec_fields`) in which it differs from the nearest of `others` of the same kernel."""
    seen = set(others)
    lines = []
    for variant in dict.fromkeys(variants):
        if variant in seen:
            continue
        mine = _spec_fields(variant.specialization)
        closest: list[str] | None = None
        for other in others:
            if (other.module, other.name) != (variant.module, variant.name):
                continue
            theirs = _spec_fields(other.specialization)
            differing = [f"{key}={mine.get(key)} ({label}: {theirs.get(key)})"
                         for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]  # fmt: skip
            if closest is None or len(differing) < len(closest):
                closest = differing
        lines.append(f"{variant.name}: " + ("; ".join(closest) if closest else f"no {label} variant of that kernel"))
    return lines


def _spec_fields(specialization: str) -> dict[str, str]:
    """A variant's specialization (Triton's JSON) as named fields: each argument's type, constant value and
    attributes (divisibility) under the argument's name, each option; other entries as they are."""
    spec = json.loads(specialization)
    names = list(spec.get("signature", {}))

    def name(key: Any) -> str:
        index = key[0] if isinstance(key, list) and key else None
        return names[index] if isinstance(index, int) and 0 <= index < len(names) else json.dumps(key)

    fields: dict[str, str] = {}
    for entry, value in spec.items():
        if entry in ("name", "key", "constant_keys", "attrs_keys"):  # the cache key repeats the rest
            continue
        if entry == "signature" and isinstance(value, dict):
            fields.update({f"{arg} type": str(kind) for arg, kind in value.items()})
        elif entry in ("constant_vals", "attrs_vals"):
            keys = spec.get(entry.replace("_vals", "_keys"), [])
            suffix = " attrs" if entry == "attrs_vals" else ""
            fields.update({name(key) + suffix: json.dumps(v) for key, v in zip(keys, value, strict=False)})
        elif entry == "options" and isinstance(value, dict):
            fields.update({f"option {option}": json.dumps(v) for option, v in value.items()})
        else:
            fields[entry] = json.dumps(value)
    return fields


class CompileHelpers:
    """Up to `count` helper processes, used once by `compile_for`, ended by it or by `close`.

    With `start_now` they all start at once, so that their imports (seconds: as long as several compiles) run while
    the weights load: what a first start on a machine wants, every variant being missing. Otherwise they start only once
    the dry pass has found variants the cache lacks, as many as those variants (up to `count`), and none for fewer
    than `MIN_MISSING_FOR_HELPERS`: a warm start starts none, and engines built one after another on a busy machine
    (a test suite, several replicas) do not spend a core's import on each build."""

    def __init__(self, count: int, start_now: bool = True) -> None:
        package_parent = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH", "")) if p)
        self._env = {**os.environ, "PYTHONPATH": path}
        self.count = count
        self._helpers: list[subprocess.Popen[bytes]] = []
        if start_now:
            self._start(count)

    def _start(self, count: int) -> None:
        self._helpers += [
            subprocess.Popen(
                [sys.executable, "-c", HELPER_COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=self._env,
            )  # fmt: skip
            for _ in range(count)
        ]

    @property
    def started(self) -> int:
        """How many helpers have been started."""
        return len(self._helpers)

    def compile_for(
        self, warm_ups: Mapping[str, Callable[[], None]] | Callable[[], None], target: Any
    ) -> CompileReport:
        """Record the variants of `warm_ups` (each named, or one callable), run dry one after another; have the
        helpers compile those the cache lacks, wait for them (at most `HELPER_TIMEOUT_S`), and end the helpers. A
        warm-up whose dry run raises keeps what it recorded until then and is named in the report's errors; the
        others still run. The caller then runs the warm-ups for real."""
        if callable(warm_ups):
            warm_ups = {"warm-up": warm_ups}
        report = CompileReport()
        try:
            errors: list[str] = []
            # one pass for all: a variant an earlier warm-up compiled (`WARM_STATE`) is not launched again later
            with dry_pass() as variants:
                for name, warm_up in warm_ups.items():
                    before = len(variants)
                    try:
                        warm_up()
                    except Exception as err:  # noqa: BLE001  (the real warm-up runs it again and raises for itself)
                        errors.append(f"{name}: {type(err).__name__}: {err}")
                    report.recorded_by[name] = len(variants) - before
            report.errors = tuple(errors)
            missing = [v for v in variants if not cached_or_unknown_false(v, target)]
            report.variants, report.missing = tuple(variants), len(missing)
            report.missing_names = tuple(v.name for v in missing)
            if len(missing) >= (1 if self._helpers else MIN_MISSING_FOR_HELPERS):
                compiled, helper_errors = self.compile_variants(missing, target)
                report.compiled, report.errors = compiled, (*report.errors, *helper_errors)
        except Exception as err:  # noqa: BLE001  (the real warm-up compiles what is missing, or raises it again)
            report.errors = (*report.errors, f"{type(err).__name__}: {err}")
        finally:
            self.close()
        return report

    def compile_variants(self, variants: list[KernelVariant], target: Any) -> tuple[int, tuple[str, ...]]:
        """Have the helpers (started now where fewer than `count` and than the variants run) compile `variants` and
        wait for them: how many compiled, and what failed (by name). Each helper holds one variant at a time and is
        handed the next as it answers, the longest kernels first (`_compile_cost`): compile times differ tenfold
        (an attention variant against an argmax), so shares fixed beforehand would leave helpers idle while one
        still works through its long ones."""
        self._start(min(self.count, len(variants)) - len(self._helpers))
        jobs = deque(sorted(variants, key=_compile_cost, reverse=True))
        target_fields = [target.backend, target.arch, target.warp_size]
        compiled, errors = 0, []
        deadline = time.monotonic() + HELPER_TIMEOUT_S
        with selectors.DefaultSelector() as selector:
            for helper in self._helpers:
                working = _HelperPipe(helper)
                if working.hand(jobs, target_fields):
                    selector.register(helper.stdout, selectors.EVENT_READ, working)
            while selector.get_map():
                ready = selector.select(timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    errors.append(f"the helpers did not finish in {HELPER_TIMEOUT_S:.0f} s")
                    break
                for key, _ in ready:
                    working = key.data
                    answers = working.answers()
                    if answers is None:  # it died: what it held is compiled by the real warm-up
                        errors.append(f"a helper ended while compiling {working.holding}")
                        selector.unregister(key.fileobj)
                        continue
                    for answer in answers:
                        compiled += bool(answer["ok"])
                        if not answer["ok"]:
                            errors.append(answer["error"])
                        if not working.hand(jobs, target_fields):
                            selector.unregister(key.fileobj)
                            break
        for helper in self._helpers:  # building their variants' launchers (`serve`), which nothing waits for later
            try:
                helper.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        return compiled, tuple(errors)

    def ended(self) -> bool:
        """Whether every helper has exited."""
        return all(helper.poll() is not None for helper in self._helpers)

    def close(self) -> None:
        """End every helper still running (its work is only a cache to fill)."""
        for helper in self._helpers:
            if helper.poll() is None:
                helper.kill()
            helper.wait()
            for stream in (helper.stdin, helper.stdout):
                if stream is not None and not stream.closed:
                    with contextlib.suppress(OSError):  # a job written to a helper that had died: nowhere to go
                        stream.close()


class _HelperPipe:
    """The parent's end of one helper: the variant it holds, and its answers as whole lines (read from the pipe's
    descriptor as they come, so that a selector never waits on a line already buffered)."""

    def __init__(self, helper: subprocess.Popen[bytes]) -> None:
        self.helper = helper
        self.holding = ""
        self._pending = b""

    def hand(self, jobs: deque[KernelVariant], target_fields: list[Any]) -> bool:
        """Hand the helper the next job; with none left, close its input (it then builds its launchers and ends).
        Whether it holds a job now."""
        if not jobs:
            with contextlib.suppress(OSError):  # it died meanwhile: nothing was left for it anyway
                self.helper.stdin.close()
            return False
        variant = jobs.popleft()
        try:
            self.helper.stdin.write((json.dumps({"variant": asdict(variant), "target": target_fields}) + "\n").encode())
            self.helper.stdin.flush()
        except OSError:  # it died: another helper (or the real warm-up) compiles the variant
            jobs.appendleft(variant)
            return False
        self.holding = variant.name
        return True

    def answers(self) -> list[dict[str, Any]] | None:
        """The answers read now (maybe none: half a line so far), or None once the helper's output has ended."""
        chunk = os.read(self.helper.stdout.fileno(), 1 << 16)
        if not chunk:
            return None
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        prefix = ANSWER_PREFIX.encode()
        return [json.loads(line[len(prefix) :]) for line in lines if line.startswith(prefix)]  # not a library's print


def _compile_cost(variant: KernelVariant) -> int:
    """How long a variant's compile takes, roughly: its kernel's source length (0 where the kernel cannot be
    found; the helper then reports it)."""
    try:
        return len(_kernel(variant).src)
    except Exception:  # noqa: BLE001
        return 0


def cached_or_unknown_false(variant: KernelVariant, target: Any) -> bool:
    """`is_cached`, with a lookup this triton does not support counted as not cached (the helper compiles it)."""
    try:
        return is_cached(variant, target)
    except Exception:  # noqa: BLE001  (an internal of triton changed: compiling it again costs only time)
        return False
