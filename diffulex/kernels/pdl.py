"""Programmatic dependent launch (PDL): let a kernel start while the one before it on the stream finishes.

Why: at batch 1 a decode step is ~290 small kernels in a CUDA graph, and each one pays its launch latency, its
ramp-up and its tail on the critical path (measured on an H100: ~0.25 ms of gaps per SDAR-1.7B step, and each
weight-streaming GEMM loses 2-4 us to fixed costs). With PDL (Hopper and later), a kernel launched with the
attribute may become resident as soon as every program of its predecessor has signalled (`release_dependents`)
or exited; it does whatever does not depend on the predecessor (index math, metadata loads, prefetching its
weights into L2), then blocks in `wait_for_inputs` until the predecessor has completed and its writes are
visible.

The protocol every kernel here keeps, which makes the chain safe:

* Before `wait_for_inputs` a program reads only what no kernel of the current forward writes: weights, the
  step's metadata (copied in before the first kernel), KV-cache slots of earlier steps. It writes nothing. (The
  sampling kernels after the LM head follow the same rule: the step advance reads the source rows it alone
  writes, and only after the wait writes them.) What a kernel of the forward writes is read after the wait,
  however far back that kernel is: a chain of kernels that release at their start lets a kernel be resident
  while one several launches back still runs (the first layer's q/k rotary behind the gather of the step's
  rotary angles, `diffulex.kernels.token_inputs`).
* Every program calls `wait_for_inputs`, also one that returns early (a kernel must never complete before its
  predecessor has, or a third kernel waiting on it would see the older kernel's outputs unfinished).
* `release_dependents` may come at any point. A GEMM streaming a large weight (16 MiB or more) calls it at its
  start, so the next kernels' prologues and the next GEMM's small L2 prefetch overlap its stream; a shorter one
  calls it after its main loop, its stream being too short to hide its successors' start.

Kernels take a ``USE_PDL`` constexpr and are launched with `launch_kwargs`; with the flag off both helpers
compile to nothing and the launch is an ordinary one. Off on the CPU, under the Triton interpreter (which has
no grid dependency control), and before Hopper. A launch after a kernel
that is not PDL-aware (cuBLAS, PyTorch's own) simply waits for it as usual.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off (see `_triton_has_gdc`)
    gdc_launch_dependents = gdc_wait = None

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # Triton runs kernels on the CPU
_MIN_CAPABILITY = 9  # griddepcontrol is a Hopper (sm_90) instruction
# Launches over more rows than this run without PDL. PDL pays where a step is a chain of latency-bound kernels and
# weight-streaming GEMMs: on an H200 (2026-11-26, graphs, bf16) raising this from 16 to 64 rows made SDAR-8B
# steps of 32 and 64 rows 2-3% faster (5.16 -> 5.02 ms at batch 8, 5.46 -> 5.36 at batch 16) and Fast-dLLM-v2-7B's
# 33-row whole-block forwards 2% faster. From 64 to 128 rows (batch 32 of blocks of 4; H100, 2026-11-28,
# `bench/step_anatomy.py --batch 32`, twice each): SDAR-1.7B 2.452 -> 2.400 ms a step, SDAR-8B 7.01 -> 6.95,
# SDAR-30B-A3B 22.14 -> 21.95. At 256 rows (batch 64, one run each) SDAR-1.7B gained (3.04 -> 2.96 ms) and SDAR-8B lost
# (8.84 -> 8.90); an H100 run on an older tree had SDAR-1.7B 6% slower there.
PDL_MAX_ROWS = 128


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (cached: the query is slow next to a kernel launch)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def pdl_enabled(device: torch.device, rows: int) -> bool:
    """Whether a kernel over `rows` token rows launched on `device` should use programmatic dependent launch."""
    if INTERPRETING or gdc_wait is None or device.type != "cuda" or rows > PDL_MAX_ROWS:
        return False
    return device_capability(device)[0] >= _MIN_CAPABILITY


def launch_kwargs(use_pdl: bool) -> dict[str, bool]:
    """Extra keyword arguments of a Triton launch: the PDL launch attribute when it is on, nothing otherwise
    (so a Triton that lacks the option never sees it)."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Block until the previous kernel on the stream has completed and its writes are visible."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def release_dependents(USE_PDL: tl.constexpr):
    """Allow the next kernel on the stream to start (it still waits for this one in its `wait_for_inputs`)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask the memory system to bring the 128-byte lines at ``ptrs`` into L2 (a hint: no data comes back)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
