"""Triton skinny GEMM, ``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)``, for the few rows a decode step feeds a linear.

Why: at decode batch sizes (a block of 4 tokens per request, so M = 4 or 5 rows) every projection is a pure
weight stream: the FLOPs are nothing, the ``N * K`` weight bytes are everything. cuBLAS picks tensor-core tiles
sized for larger M (64x8 tiles, split-K plus a separate reduce kernel for tall-K shapes) and streams the
weights of SDAR's projections at about 2.1 TB/s on an H100 whose copy bandwidth is about 3 TB/s. This kernel is
shaped for the weight stream instead.

Design:

* Each program owns ``BLOCK_N`` output columns for all M rows, so every weight byte is read exactly once; ``x``
  (a few KB) is re-read by every program and stays in L2. The loop walks K in ``BLOCK_K`` tiles that are
  contiguous in memory; the split's start carries a ``multiple_of`` hint, without which the compiler cannot
  prove alignment and falls back to 2-byte loads (measured: about 0.65x of cuBLAS instead of a win). Columns
  past ``N`` are clamped to valid rows of ``W``, so the weight loads carry no predicate.
* Two inner products, chosen per shape by the config table: ``tl.dot`` with the operands swapped
  (``W_tile @ x_tile^T``, so the weight tile is the large M side of the MMA and the rows of ``x`` are padded to
  the 16 an MMA needs, which costs nothing when memory is the bound) with Triton's software pipelining keeping
  ``num_stages`` weight tiles in flight; or, for one or a few rows, a broadcast multiply and ``tl.sum`` on the
  CUDA cores, which avoids the shared-memory round trip of the MMA operands.
* Weight tiles through TMA (``SkinnyConfig.tma``, Hopper's tensor memory accelerator: one thread issues a tile's
  copy into shared memory, rows past ``N`` and columns past ``K`` come back as zeros) for the 1.7B geometry's
  qkv, o and gate_up: alone, in graph replay on an H100, 14-19% faster on the 8-17 MB matrices and 4% on the
  50 MB one, no gain on larger ones; in the engine's PDL chain, where the L2 prefetch already hides most of the
  fixed cost, the SDAR-1.7B batch-1 forward is 0.8% faster (1.728 -> 1.715 ms, two runs each).
* Split-K when ``N / BLOCK_N`` programs cannot fill the SMs (o_proj and down_proj have N = hidden): each split
  writes fp32 partials, bumps a per-tile counter (acq_rel atomic), and the last split to arrive sums the
  partials in split order (deterministic, independent of arrival order), adds the bias, writes the output and
  resets the counter to zero, so the counters need no memset. One launch, no host sync, and the only
  allocations depend on shapes, never on data, so the call can be captured in a CUDA graph. The counters are
  per device and shared by every call, so concurrent launches on different streams must not both split.
* No autotuning at run time (deterministic, nothing to tune inside a graph capture): a fixed table, measured
  on an H100 with ``bench/skinny_gemm_bench.py --sweep``, gives the config per (N, K, row bucket) of the SDAR
  geometries and says where cuBLAS is faster; other shapes of similar size get the config that won most of
  the table. The first call of a config compiles it, so capture a graph only after a warm-up forward.
* A launch may be told which rows of the product will be read (``readers``, device indices): when none is a
  row, every program returns before its weight stream. The host cannot know this when it queues a step whose
  inputs the device is still advancing (`diffulex.engine.continuation`), and an unread LM head is 0.15-0.2 ms.
* Outside graph capture a Triton launch costs more host time than cuBLAS's, so eager calls use the kernel only
  for LM-head-sized weights (see `use_skinny`).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from diffulex.kernels import tma
from diffulex.kernels.activation import PRECISE_EXP, silu_mul_rounded
from diffulex.kernels.pdl import (
    launch_kwargs,
    pdl_enabled,
    prefetch_l2,
    release_dependents,
    wait_for_inputs,
)
from diffulex.kernels.split_counters import MAX_SPLIT_TILES, split_counters

# Largest number of rows the kernel takes; beyond it the tiles of cuBLAS win. Above `GENERIC_MAX_ROWS` only shapes
# the table lists run on the kernel (whole-block forwards of a few dozen rows, such as Fast-dLLM v2's 33; the LM
# heads and gated gate_up of 17-32 requests' blocks).
MAX_ROWS = 128
GENERIC_MAX_ROWS = 16


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _skinny_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K (`GATED`: [2N, K], the gate rows then the up rows)
    w_desc,  # TMA descriptor of W with [BLOCK_N, BLOCK_K] boxes, or None (`USE_TMA` off)
    bias_ptr,  # [N] (`GATED`: [2N]) or unused
    y_ptr,  # [M, N], unit stride along N
    part_ptr,  # [splits, M, N] fp32 partials, or unused
    counters_ptr,  # [>= N tiles] int32, zero between launches, or unused
    readers_ptr,  # [num_readers] int32/int64 rows of y that will be read (-1: none), or unused (`READER_SLOTS` 0)
    num_readers,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    k_per_split,  # multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # whether the grid has more than one K split
    COMBINE: tl.constexpr,  # sum the splits into y here; off: leave the fp32 partials for the consumer to sum
    USE_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,  # weight tiles through the tensor memory accelerator (`w_desc`) instead of plain loads
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks at all
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (`diffulex.kernels.pdl`)
    PREFETCH_LINES: tl.constexpr,  # 128-byte weight lines per row of the tile to prefetch into L2 before waiting
    LINE_ELEMS: tl.constexpr,  # weight elements per 128-byte line
    GATED: tl.constexpr = False,  # y = silu(x @ W_gate^T) * (x @ W_up^T): each program owns both halves' columns
    PRECISE_EXP: tl.constexpr = True,  # `GATED`'s exp as libdevice's expf (False: the interpreter's tl.exp)
    RELEASE_EARLY: tl.constexpr = False,  # let the next kernels start now rather than after the weight stream
    READER_SLOTS: tl.constexpr = 0,  # > 0: skip everything when no entry of `readers_ptr` is a row (a power of 2)
):
    if RELEASE_EARLY:
        release_dependents(USE_PDL)
    if READER_SLOTS > 0:
        slots = tl.arange(0, READER_SLOTS)
        readers = tl.load(readers_ptr + slots, mask=slots < num_readers, other=-1)
        if tl.max(readers, axis=0) < 0:  # nobody reads this product: stream no weights, write nothing
            wait_for_inputs(USE_PDL)  # every program waits (`diffulex.kernels.pdl`)
            return
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # columns past N are clamped to valid rows of W (never stored), so the weight loads carry no predicate;
    # padded rows of x are masked instead, so they cost no memory traffic (the mask is constant along K and
    # keeps the loads vectorized)
    cols = offs_n % N
    row_ok = (offs_m < M)[:, None]
    # the hint keeps the 16-byte vectorization: without it the compiler cannot prove k_lo aligned
    k_lo = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if PREFETCH_LINES > 0:
        # the weights are not written by the kernel before this one: start streaming them now, while it finishes
        line_k = tl.minimum(k_lo + tl.arange(0, PREFETCH_LINES) * LINE_ELEMS, k_hi - 1)
        prefetch_l2(w_ptr + cols.to(tl.int64)[:, None] * stride_wn + line_k[None, :])
        if GATED:
            prefetch_l2(w_ptr + (cols + N).to(tl.int64)[:, None] * stride_wn + line_k[None, :])
    wait_for_inputs(USE_PDL)
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    up_offset = N.to(tl.int64) * stride_wn  # GATED: the up half's rows
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros_like(acc)  # GATED only
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k + offs_k) < k_hi  # unused when EVEN_K
        if EVEN_K:
            xv = tl.load(x_ptrs, mask=row_ok, other=0.0)
        else:
            xv = tl.load(x_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
        w = _weight_tile(w_desc, w_ptrs, pid_n * BLOCK_N, k, k_ok, USE_TMA, EVEN_K)
        acc = _accumulate(acc, w, xv, USE_DOT)
        if GATED:
            w_up = _weight_tile(w_desc, w_ptrs + up_offset, N + pid_n * BLOCK_N, k, k_ok, USE_TMA, EVEN_K)
            acc_up = _accumulate(acc_up, w_up, xv, USE_DOT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    # the weight stream is done: the next kernels may start their prologues. A long stream (and a product whose
    # consumers stream no weights) released them at its start instead (`RELEASE_EARLY`, `_EARLY_RELEASE_MIN_BYTES`),
    # so that the next GEMM's prologue and small prefetch overlap this stream rather than follow its tail.
    if not RELEASE_EARLY:
        release_dependents(USE_PDL)
    if USE_DOT:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        acc_up = tl.trans(acc_up)
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    mn_offs = offs_m[:, None] * N + offs_n[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT or not COMBINE:  # this split's fp32 partial (without COMBINE, the consumer sums them)
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + mn_offs, acc, mask=out_mask)
    if COMBINE and SPLIT:
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(1) - 1:
            tl.atomic_xchg(counters_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, tl.num_programs(1)):
                total += tl.load(part_ptr + s * M * N + mn_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
    elif COMBINE:
        out_dtype: tl.constexpr = y_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        if GATED:
            if HAS_BIAS:
                acc_up += tl.load(bias_ptr + N + cols).to(tl.float32)[None, :]
            # the two products rounded as a plain launch stores them, then SiLU-and-mul's roundings
            out = silu_mul_rounded(acc.to(out_dtype), acc_up.to(out_dtype), out_dtype, PRECISE_EXP)
        else:
            out = acc.to(out_dtype)
        tl.store(y_ptrs, out, mask=out_mask)


@triton.jit
def _weight_tile(w_desc, w_ptrs, row0, k, k_ok, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr):
    """One ``[BLOCK_N, BLOCK_K]`` weight tile: through TMA from row ``row0`` (rows past the matrix and columns
    past K come back as zeros; splits are whole K tiles), else by plain loads at ``w_ptrs``."""
    if USE_TMA:
        w = w_desc.load([row0, k])
    elif EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
    return w


@triton.jit
def _accumulate(acc, w, xv, USE_DOT: tl.constexpr):
    """``acc += w @ xv^T`` on the tensor cores (acc ``[BLOCK_N, BLOCK_M]``) or the CUDA cores (transposed)."""
    if USE_DOT:
        acc = tl.dot(w, tl.trans(xv), acc)
    else:
        prod = xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        acc += tl.sum(prod, axis=2)
    return acc


class SkinnyConfig(NamedTuple):
    """One launch shape: tile sizes, pipelining, inner product and the number of K splits requested."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool
    split_k: int = 1
    tma: bool = False  # weight tiles through TMA (Hopper): lower fixed cost on matrices of a few MB


def _bucket(m: int) -> int:
    """Row bucket of the config table: 1, 4 (2..4), then the next power of two (5..8 -> 8, 9..16 -> 16, ...)."""
    return 1 if m <= 1 else max(4, _next_pow2(m))


_C = SkinnyConfig
# (N, K, row bucket) -> config, the fastest of `bench/skinny_gemm_bench.py --sweep` on an H100 (bf16, weights
# read from HBM, CUDA-graph replay). Every entry beat cuBLAS there (by 2-18%, SDAR-1.7B gate_up at 9-16 rows
# ties it); a shape where cuBLAS wins would map to None. SDAR-1.7B: qkv, o, gate_up, down, LM head; then SDAR-8B.
_TABLE: dict[tuple[int, int, int], SkinnyConfig | None] = {
    (4096, 2048, 1): _C(64, 128, 4, 6, True, 1, True),
    (4096, 2048, 4): _C(64, 128, 4, 6, True, 1, True),
    (4096, 2048, 8): _C(64, 128, 4, 6, True, 1, True),
    (4096, 2048, 16): _C(64, 128, 4, 6, True, 1, True),
    (2048, 2048, 1): _C(64, 128, 4, 6, True, 1, True),
    (2048, 2048, 4): _C(64, 128, 4, 6, True, 1, True),
    (2048, 2048, 8): _C(64, 128, 4, 6, True, 1, True),
    (2048, 2048, 16): _C(64, 128, 4, 6, True, 1, True),
    (12288, 2048, 1): _C(128, 128, 4, 4, True, 1, True),
    (12288, 2048, 4): _C(128, 128, 4, 4, True, 1, True),
    (12288, 2048, 8): _C(128, 128, 4, 4, True, 1, True),
    (12288, 2048, 16): _C(128, 128, 4, 4, True, 1, True),
    (2048, 6144, 1): _C(64, 256, 4, 3, True, 4),
    (2048, 6144, 4): _C(64, 256, 4, 3, True, 4),
    (2048, 6144, 8): _C(64, 256, 4, 3, True, 4),
    (2048, 6144, 16): _C(64, 128, 4, 4, True, 4),
    (151936, 2048, 1): _C(64, 128, 4, 6, True, 1),
    (151936, 2048, 4): _C(64, 128, 4, 6, True, 1),
    (151936, 2048, 8): _C(64, 128, 4, 6, True, 1),
    (151936, 2048, 16): _C(128, 128, 8, 4, True, 1),
    (6144, 4096, 1): _C(64, 128, 4, 6, True, 1),
    (6144, 4096, 4): _C(64, 128, 4, 6, True, 1),
    (6144, 4096, 8): _C(64, 128, 4, 6, True, 1),
    (6144, 4096, 16): _C(64, 128, 4, 6, True, 1),
    (4096, 4096, 1): _C(64, 128, 4, 6, True, 1),
    (4096, 4096, 4): _C(64, 128, 4, 6, True, 1),
    (4096, 4096, 8): _C(64, 128, 4, 6, True, 1),
    (4096, 4096, 16): _C(64, 128, 4, 6, True, 1),
    (24576, 4096, 1): _C(64, 256, 4, 4, True, 1),
    (24576, 4096, 4): _C(64, 128, 4, 6, True, 1),
    (24576, 4096, 8): _C(64, 128, 4, 6, True, 1),
    (24576, 4096, 16): _C(64, 128, 4, 6, True, 1),
    (4096, 12288, 1): _C(64, 128, 4, 6, True, 2),
    (4096, 12288, 4): _C(64, 128, 4, 6, True, 2),
    (4096, 12288, 8): _C(64, 128, 4, 4, True, 4),
    (4096, 12288, 16): _C(64, 128, 4, 6, True, 2),
    (151936, 4096, 1): _C(64, 128, 4, 6, True, 1),
    (151936, 4096, 4): _C(64, 128, 4, 6, True, 1),
    (151936, 4096, 8): _C(64, 128, 4, 6, True, 1),
    (151936, 4096, 16): _C(128, 128, 4, 4, True, 1),
    # Qwen2.5-7B (Dream-7B, Fast-dLLM-v2-7B) on an H200, up to the 33 rows of a Fast-dLLM v2 whole-block forward
    # (bucket 64 measured at 33): its fused qkv stays on cuBLAS at every row count (0.86-0.92x there).
    **{(4608, 3584, b): None for b in (1, 4, 8, 16, 32, 64)},
    (3584, 3584, 1): _C(64, 256, 4, 4, True, 1),
    **{(3584, 3584, b): _C(64, 128, 4, 6, True, 1) for b in (4, 8, 16, 32)},
    (3584, 3584, 64): _C(64, 128, 4, 6, True, 2),
    (37888, 3584, 1): _C(64, 128, 4, 4, True, 1, True),
    (37888, 3584, 4): _C(32, 256, 4, 4, True, 1),
    **{(37888, 3584, b): _C(64, 128, 4, 4, True, 1, True) for b in (8, 16, 32)},
    (37888, 3584, 64): None,
    (3584, 18944, 1): _C(64, 128, 4, 6, True, 2),
    **{(3584, 18944, b): _C(64, 256, 4, 3, True, 2) for b in (4, 8)},
    **{(3584, 18944, b): _C(64, 128, 4, 6, True, 2) for b in (16, 32, 64)},
    **{(152064, 3584, b): _C(64, 128, 4, 4, True, 1, True) for b in (1, 4, 8)},
    (152064, 3584, 16): _C(128, 128, 4, 4, True, 1, True),
    **{(152064, 3584, b): _C(128, 128, 8, 4, True, 1, True) for b in (32, 64)},
    # SDAR-8B's shards under tensor parallelism of 2, one rank's qkv, gate_up, down and LM head on an H100 (its o_proj
    # shard is SDAR-1.7B's qkv shape above): 1.03-1.29x cuBLAS, 76-95% of the copy bandwidth.
    (3072, 4096, 1): _C(64, 128, 4, 4, True, 6),
    (3072, 4096, 4): _C(64, 128, 4, 4, True, 6),
    (3072, 4096, 8): _C(64, 128, 4, 4, True, 6),
    (3072, 4096, 16): _C(64, 128, 4, 6, True, 1, True),
    (12288, 4096, 1): _C(64, 128, 4, 6, True, 1),
    (12288, 4096, 4): _C(64, 128, 4, 6, True, 1, True),
    (12288, 4096, 8): _C(64, 128, 4, 6, True, 1),
    (12288, 4096, 16): _C(64, 128, 4, 6, True, 1),
    (4096, 6144, 1): _C(64, 128, 4, 6, True, 2),
    (4096, 6144, 4): _C(64, 128, 4, 6, True, 2),
    (4096, 6144, 8): _C(64, 128, 4, 6, True, 2),
    (4096, 6144, 16): _C(64, 128, 4, 6, True, 2),
    (75968, 4096, 1): _C(64, 128, 4, 6, True, 1),
    (75968, 4096, 4): _C(64, 256, 4, 4, True, 1),
    (75968, 4096, 8): _C(64, 128, 4, 6, True, 1),
    (75968, 4096, 16): _C(64, 128, 4, 6, True, 1),
    # The dense linears of the MoE geometries on an H100 (`bench/skinny_gemm_bench.py --sweep --geometries
    # sdar-30b-a3b llada2-mini`, 2026-11-26): SDAR-30B-A3B's qkv, o and (at 32 rows) LM head, 1.02-1.45x cuBLAS;
    # LLaDA2-mini's qkv, o and LM head at 32 rows (a block of 32 a request) and its shared expert, 1.03-1.39x.
    # SDAR-1.7B's entries of the same shapes above stay (they were chosen in its batch-1 chain).
    (5120, 2048, 1): _C(64, 128, 4, 6, True, 1),
    **{(5120, 2048, b): _C(64, 128, 4, 4, True, 1, True) for b in (4, 8, 16)},
    (5120, 2048, 32): _C(64, 128, 4, 6, True, 1),
    (2048, 4096, 1): _C(64, 128, 4, 6, True, 4),
    **{(2048, 4096, b): _C(64, 256, 4, 3, True, 4) for b in (4, 8)},
    **{(2048, 4096, b): _C(64, 128, 4, 6, True, 4) for b in (16, 32)},
    (151936, 2048, 32): _C(64, 128, 4, 6, True, 1),
    (3072, 2048, 1): _C(64, 128, 4, 4, True, 3),
    **{(3072, 2048, b): _C(32, 256, 4, 4, True, 6) for b in (4, 8)},
    **{(3072, 2048, b): _C(64, 128, 4, 6, True, 1, True) for b in (16, 32)},
    (2048, 2048, 32): _C(64, 128, 4, 6, True, 4),
    (1024, 2048, 1): _C(64, 256, 4, 4, True, 8),
    (1024, 2048, 4): _C(64, 256, 4, 3, True, 8),
    (1024, 2048, 8): _C(64, 256, 4, 4, True, 8),
    (1024, 2048, 16): _C(64, 128, 4, 6, True, 8),
    (1024, 2048, 32): _C(16, 512, 4, 4, True, 2),
    (2048, 512, 1): _C(16, 512, 4, 1, False, 1),
    **{(2048, 512, b): _C(64, 128, 4, 4, True, 1, True) for b in (4, 8, 16, 32)},
    **{(157184, 2048, b): _C(64, 256, 4, 4, True, 1) for b in (1, 4, 8)},
    (157184, 2048, 16): _C(64, 128, 4, 6, True, 1),
    (157184, 2048, 32): _C(64, 128, 4, 4, True, 1, True),
    # SDAR-30B-A3B's router (`bench/skinny_gemm_bench.py --sweep --geometries sdar-30b-a3b-router --rows 4 8 16 32`,
    # an H100, 2026-11-27): 3.1-3.8 us against cuBLAS's 5.1-5.5, and a link of the layer's PDL chain instead of a
    # break in it
    **{(128, 2048, b): _C(32, 256, 4, 4, True, 8) for b in (4, 8, 16, 32)},
    # A batch of 17-32 requests' blocks of 4 (`bench/skinny_gemm_bench.py --sweep --geometries sdar-1.7b sdar-8b
    # --rows 128`, an H100, 2026-11-27): the LM heads (1.7B 244 -> 236 us, 8B 461 -> 442) and SDAR-8B's gate_up,
    # which ties cuBLAS plain (78.2 against 78.8 us) and launches gated (SiLU-and-mul in the epilogue,
    # `gated_config`): its batch-32 step 7.11 -> 6.95 ms. SDAR-1.7B's gate_up takes 23.7 us plain against cuBLAS's
    # 22.4 (its gated launch not yet timed in a step), every other projection 0.68-0.89x: cuBLAS there.
    (151936, 2048, 128): _C(128, 128, 8, 3, True, 1, True),
    (151936, 4096, 128): _C(128, 128, 8, 3, True, 1, True),
    (24576, 4096, 128): _C(128, 64, 8, 3, True, 1, True),
}
# Shapes the table does not list get the config that won most of it, when they look like the measured ones:
# at least 4M weights (8 MB in bf16; smaller matrices are all launch latency) and K a multiple of the tile.
# K splits follow the measured pattern: none up to K = 4096, else enough to bring the grid near 128 programs.
_GENERIC_MIN_WEIGHTS = 4 << 20
# Eager launches of a Triton kernel cost more host time than cuBLAS's (~50 us against ~20 us measured per call),
# which a host-bound eager decode step pays in full; the kernel's gain covers that only on matrices this large
# (LM heads). Under CUDA-graph capture the launch cost is gone and every table entry wins.
_EAGER_MIN_BYTES = 256 << 20
# With programmatic dependent launch a GEMM starts while the kernels before it finish; it prefetches its weights
# into L2 meanwhile, at most this much per matrix. Measured in the SDAR-1.7B batch-1 chain on an H200,
# with the large GEMMs releasing early (below): 2-4 MB per matrix 1.150 ms per replay, 8 MB 1.164, 16 MB 1.229,
# 24 MB 1.261; without any prefetch 1.175. More than a few MB competes with the GEMM still streaming and evicts
# lines before they are read.
_PREFETCH_BUDGET_BYTES = 4 << 20
# A GEMM streaming at least this many weight bytes lets the kernels after it start at its beginning (as
# ``release_early`` does) rather than after its stream: the next GEMM's prologue and prefetch then overlap this
# stream instead of its tail. Measured on an H200 (SDAR-1.7B batch 1, 4 MB prefetch budget): replay
# 1.255 ms with every release after the stream, 1.143 with gate_up's (50 MB) and down_proj's (25 MB) at the start
# (q/k/v's already was), 1.151 with o_proj's (8 MB) too, which is too short to hide its successors' start.
_EARLY_RELEASE_MIN_BYTES = 16 << 20
_PREFETCH_MAX_ADDRESSES = 4096
_L2_LINE_BYTES = 128

# An unsummed product (`unsummed_config`) is split until the grid has about this many programs: the H100's 132
# SMs, rounded to what SDAR's column-tile counts divide (measured at batch 1: o_proj 4 splits of 32 tiles).
UNSUMMED_PROGRAMS = 128
MAX_UNSUMMED_SPLITS = 8
# Narrowest column tile per half of a gated launch. Measured: SDAR-1.7B's gate_up (128-column plain
# tiles, so 64 per half) replays 1% faster gated on an H100; SDAR-8B's (64-column tiles, 32 per half) made batch-1
# steps 4-5% slower on an H200 (4.48 -> 4.64-4.70 ms), so it keeps the separate activation launch.
MIN_GATED_BLOCK_N = 64

_SUPPORTED = (torch.bfloat16, torch.float16)
_READER_DTYPES = (torch.int32, torch.int64)


def config_for(n: int, k: int, m: int) -> SkinnyConfig | None:
    """The config for ``x [m, k] @ W[n, k]^T``: the table's entry for measured shapes, the generic one for
    similar shapes, None where cuBLAS is the better (or the only sensible) choice."""
    if m < 1 or m > MAX_ROWS:
        return None
    key = (n, k, _bucket(m))
    if key in _TABLE:
        return _TABLE[key]
    if m > GENERIC_MAX_ROWS or n * k < _GENERIC_MIN_WEIGHTS or n < 1024 or k % 128 != 0:
        return None
    split = 1 if k <= 4096 else max(1, min(4, round(128 / triton.cdiv(n, 64))))
    return SkinnyConfig(64, 128, 4, 6, True, split)


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Everything `use_skinny` asks except the shape table, compilation and the launch-cost gate."""
    if not x.is_cuda or x.dim() != 2 or x.dtype not in _SUPPORTED:
        return False
    m, k = x.shape
    if m < 1 or m > MAX_ROWS or x.stride(1) != 1:
        return False
    if weight.dtype != x.dtype or weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        return False
    if weight.device != x.device or (bias is not None and (bias.dtype != x.dtype or bias.device != x.device)):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return False
    return True


def use_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `skinny_linear` should replace ``F.linear(x, weight, bias)``.

    Requires CUDA, 2-D ``x`` of at most `MAX_ROWS` rows in bf16/fp16 with unit stride along K, a contiguous
    weight (and bias) of the same dtype, no autograd recording (the kernel has no backward), no
    ``torch.compile`` tracing (inductor plans its own GEMMs; an opaque call would split its graph), and a shape
    with a config (`config_for`). Outside CUDA-graph capture only very large weights qualify (launch cost).
    Always False on the CPU.
    """
    if capture_config(x, weight, bias) is None:
        return False
    return torch.cuda.is_current_stream_capturing() or weight.numel() * weight.element_size() >= _EAGER_MIN_BYTES


# Kernel variants that an eager call has compiled (`_eager_variant`).
_WARMED: set[tuple] = set()
# Triton specializes a pointer or integer argument on its divisibility by this (and an integer equal to 1 on its value)
_SPECIALIZATION_DIVISOR = 16


def _specialization(value: int) -> int:
    """What Triton's compiled variant records of an integer argument (or a pointer's address): 1 for the value 1,
    else whether it divides by `_SPECIALIZATION_DIVISOR`."""
    return 1 if value == 1 else int(value % _SPECIALIZATION_DIVISOR == 0) * _SPECIALIZATION_DIVISOR


def _eager_variant(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: SkinnyConfig,
    mode: Output,
    readers: torch.Tensor | None,
) -> tuple:
    """What tells an eager launch's compiled kernel variant from another's: the config, output and padded rows; the
    weight's shape, for what the launch derives from it (even K, split count, the L2 prefetch of PDL launches); and
    Triton's specialization of the arguments that vary between calls (x's row stride, the readers' count and the
    addresses of x, bias and readers; the row count and ``k_per_split`` are not specialized). Two calls with equal
    keys launch the same compiled kernel, so the first eager call per key compiles every variant a captured graph
    of those shapes will launch (a capture must not compile): e.g. 18 readers compile apart from 32 (18 is not a
    multiple of 16), though both take 32 reader slots."""
    varying = [x.stride(0), readers.numel() if readers is not None else 0]
    varying += [t.data_ptr() if t is not None else 0 for t in (x, bias, readers)]
    return (
        cfg, mode, _block_m(cfg, x.shape[0]), tuple(weight.shape), bias is not None, x.dtype, x.device,
        _reader_slots(readers), *(_specialization(value) for value in varying),
    )  # fmt: skip


def maybe_skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    output: str = "sum",
    release_early: bool = False,
    readers: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The product through the kernel where `use_skinny` allows it, else None (the caller then uses ``F.linear``).

    ``output`` (an `Output` value) picks what comes back: ``"sum"`` the product; ``"partials"``
    `skinny_partials`'s ``[splits, M, N]`` fp32 partials, split per `unsummed_config` (None where that gives one
    split, or with a bias); ``"silu_mul"`` `skinny_silu_mul` of a merged ``[gate; up]`` weight (None where the
    plain launch would split K).

    ``release_early`` lets the kernels after this one start (their prologues, before their wait for this
    product) while it streams its weights, instead of after: for a product whose consumers are latency-bound
    kernels that stream no weights of their own, such as q/k/v's (q/k norm + rotary, then attention, whose
    metadata and page-table reads then leave the critical path). The result is the same either way.

    ``readers`` (int32/int64 on the device, -1 for none) names the rows of the product anyone will read: when it holds
    no row at launch time the kernel skips the weight stream and leaves the output unwritten. Why: a decode
    step queued before its inputs are known (`diffulex.engine.continuation`) may turn out to sample no row, and
    then its LM head, a full vocabulary-sized weight stream, would be computed for nothing.

    A shape the kernel takes only under graph capture also runs through it on its first eager call per kernel
    variant: that call compiles the variant (and allocates the split counters), so the warm-up forward before
    a capture leaves nothing to compile or allocate inside the capture; later eager calls go to cuBLAS.
    """
    mode = Output(output)
    cfg = capture_config(x, weight, bias, mode.value)
    if cfg is None:
        return None
    if not torch.cuda.is_current_stream_capturing() and weight.numel() * weight.element_size() < _EAGER_MIN_BYTES:
        variant = _eager_variant(x, weight, bias, cfg, mode, readers)
        if variant in _WARMED:
            return None
        _WARMED.add(variant)
    return _launch(x, weight, bias, cfg, mode, release_early, readers)


def capture_config(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, output: str = "sum"
) -> SkinnyConfig | None:
    """The config a launch of this call under graph capture uses, or None where the kernel does not take it (the
    caller uses cuBLAS). An eager call of a config'd shape launches only the first time per variant
    (`maybe_skinny_linear`), and a caller whose later eager call comes back None must then take cuBLAS for the
    whole product, not another output of this kernel that no capture of the call would launch (and compile)."""
    if x.dim() != 2 or weight.dim() != 2:
        return None
    mode = Output(output)
    if mode is Output.PARTIALS and bias is not None:
        return None
    # the table first: most calls of more than a few rows have no entry, and its lookup is the cheapest check
    cfg = output_config(mode, weight.shape[0], x.shape[1], x.shape[0])
    if cfg is None or not _eligible(x, weight, bias) or torch.compiler.is_compiling():
        return None
    return cfg


def output_config(output: Output, n: int, k: int, m: int) -> SkinnyConfig | None:
    """The config of a launch writing `output` for ``x [m, k] @ W[n, k]^T``: the table's (`config_for`), given more
    K splits for unsummed partials (`unsummed_config`) or halved for a gated ``[gate; up]`` weight
    (`gated_config`); None where the kernel does not take the shape or that output gains nothing."""
    cfg = config_for(n, k, m)
    if cfg is None or output is Output.SUM:
        return cfg
    if output is Output.PARTIALS:
        return unsummed_config(cfg, n, k)
    return gated_config(cfg) if n % 2 == 0 else None


def unsummed_config(cfg: SkinnyConfig, n: int, k: int) -> SkinnyConfig | None:
    """`cfg` with enough K splits to give about `UNSUMMED_PROGRAMS` programs, for a caller that sums the
    partials itself; None when one split is all the shape allows.

    Splitting costs a GEMM whose consumer sums the partials nothing but the partials' few KB, so the grid can
    cover the SMs even where the table, which pays the split-K sum inside the kernel, kept one split (SDAR-1.7B's
    o_proj: 32 column tiles).
    """
    tiles = triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, cfg.block_k)
    splits = min(k_tiles, MAX_UNSUMMED_SPLITS, max(cfg.split_k, round(UNSUMMED_PROGRAMS / tiles)))
    if splits < 2 or tiles > MAX_SPLIT_TILES:
        return None
    return cfg._replace(split_k=splits)


def _reader_slots(readers: torch.Tensor | None) -> int:
    """The launch's ``READER_SLOTS``: the reader indices it checks, padded to a power of two (0: no check)."""
    if readers is None or readers.numel() == 0:
        return 0
    return _next_pow2(readers.numel())


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _block_m(cfg: SkinnyConfig, m: int) -> int:
    """Rows of the tile: an MMA needs 16 at least; the CUDA-core product takes any power of two."""
    return max(16, _next_pow2(m)) if cfg.use_dot else _next_pow2(m)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    release_early: bool = False,
    readers: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``x``'s dtype with fp32 accumulation, for few-row ``x [M, K]``.

    `config` overrides the table (benchmarks and tests); without it the shape must be in the table (check
    `use_skinny` first). ``release_early`` and ``readers`` as in `maybe_skinny_linear`; ``out`` (contiguous
    ``[M, N]`` in ``x``'s dtype) is written instead of a new tensor. Works on CUDA and under the Triton
    interpreter.
    """
    return _launch(x, weight, bias, config, Output.SUM, release_early, readers, out)


def skinny_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    readers: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(x @ gate^T + b_gate) * (x @ up^T + b_up)`` for a merged ``weight = [gate; up]`` (``[2I, K]``), in one
    launch; bit for bit `skinny_linear` with the same config followed by `diffulex.kernels.activation.silu_mul`.

    Why: at decode batch sizes the SiLU-and-mul launch between gate_up and down_proj is pure latency on the
    critical path of every MLP. Each program owns ``block_n`` columns of both halves, so the activation is
    formed in registers. `config` is the gated launch's own (``block_n`` columns per half); without it,
    `output_config` derives it from the table's config for the merged shape. ``readers`` as in
    `maybe_skinny_linear`.
    """
    return _launch(x, weight, bias, config, Output.SILU_MUL, readers=readers)


def skinny_partials(
    x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None, readers: torch.Tensor | None = None
) -> torch.Tensor:
    """The K splits of ``x @ weight.T`` left unsummed: fp32 ``[splits, M, N]`` whose sum over dim 0, in split
    order and starting from zero, is exactly what `skinny_linear` would round to ``x``'s dtype.

    Why: the last-arriving split's sum is a dependent tail of every split GEMM. A consumer that reads the
    product whole anyway (the residual add + RMSNorm after o_proj and down_proj) sums the partials itself, so
    the GEMM ends when its weight stream does. ``readers`` as in `maybe_skinny_linear`.
    """
    return _launch(x, weight, None, config, Output.PARTIALS, readers=readers)


class Output(enum.Enum):
    """What a launch writes: the product, its unsummed K splits, or SiLU-and-mul of its two halves."""

    SUM = "sum"
    PARTIALS = "partials"
    SILU_MUL = "silu_mul"


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: SkinnyConfig | None,
    output: Output,
    release_early: bool = False,
    readers: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    gated = output is Output.SILU_MUL
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight stacks gate and up: need an even row count, got {weight.shape[0]}")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    cfg = config if config is not None else output_config(output, weight.shape[0], k, m)
    if cfg is None:
        raise ValueError(f"no skinny GEMM config for M={m}, N={weight.shape[0]}, K={k}; use F.linear")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    k_per_split, splits = split_shape(cfg, n, k) if k > 0 else (0, 1)
    if gated and splits > 1:
        raise ValueError(f"a gated launch cannot split K (config {cfg})")
    if output is Output.PARTIALS:
        y = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    elif out is not None:
        if out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{m}, {n}] {x.dtype} tensor on {x.device}")
        y = out
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        if bias is None:
            return y.zero_()
        return y.copy_((F.silu(bias[:n]) * bias[n:] if gated else bias).expand(m, n))
    block_m = _block_m(cfg, m)
    tiles = triton.cdiv(n, cfg.block_n)
    if output is Output.PARTIALS:
        part = counters = y
    elif splits > 1:
        part = torch.empty(splits * m * n, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, tiles)
    else:
        part = counters = y  # never read
    if bias is not None:
        bias = bias.contiguous()
    use_pdl = pdl_enabled(x.device, m)
    line_elems = _L2_LINE_BYTES // weight.element_size()
    rows = weight.shape[0]  # both halves of a gated weight are streamed
    prefetch = _prefetch_lines(rows, splits, triton.cdiv(k_per_split, line_elems), cfg.block_n) if use_pdl else 0
    w_desc = tma.descriptor(weight, [cfg.block_n, cfg.block_k]) if cfg.tma else None
    if readers is not None and (
        readers.dtype not in _READER_DTYPES or readers.dim() != 1 or readers.device != x.device
    ):
        raise ValueError(
            f"readers must be a 1-D int32/int64 tensor on {x.device}, got {readers.dtype} {tuple(readers.shape)} "
            f"on {readers.device}"
        )
    reader_slots = _reader_slots(readers)
    release_early = release_early or _releases_early(weight)
    _skinny_kernel[(tiles, splits)](
        x,
        weight,
        w_desc,
        bias if bias is not None else y,
        y,
        part,
        counters,
        readers if reader_slots else y,
        readers.numel() if reader_slots else 0,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(-2),
        k_per_split,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        COMBINE=output is not Output.PARTIALS,
        USE_DOT=cfg.use_dot,
        USE_TMA=w_desc is not None,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_PDL=use_pdl,
        PREFETCH_LINES=prefetch,
        LINE_ELEMS=line_elems,
        GATED=gated,
        PRECISE_EXP=PRECISE_EXP,
        RELEASE_EARLY=release_early,
        READER_SLOTS=reader_slots,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_kwargs(use_pdl),
    )
    return y


def gated_config(cfg: SkinnyConfig) -> SkinnyConfig | None:
    """The gated launch of a merged ``[gate; up]`` weight whose plain launch uses `cfg`: half the columns per
    program from each half, so a program streams the same rows and the grid keeps its size; None where the
    plain launch splits K (the activation needs whole sums) or the halves would be narrower than
    `MIN_GATED_BLOCK_N`."""
    if cfg.split_k > 1 or cfg.block_n // 2 < MIN_GATED_BLOCK_N:
        return None
    return cfg._replace(block_n=cfg.block_n // 2)


def split_shape(cfg: SkinnyConfig, n: int, k: int) -> tuple[int, int]:
    """``(k_per_split, splits)`` of a launch: the config's split count rounded to whole K tiles, and no split
    when the output has more column tiles than the split counters cover."""
    k_per_split = triton.cdiv(triton.cdiv(k, max(1, cfg.split_k)), cfg.block_k) * cfg.block_k
    splits = max(1, triton.cdiv(k, k_per_split))
    if splits > 1 and triton.cdiv(n, cfg.block_n) > MAX_SPLIT_TILES:
        k_per_split, splits = triton.cdiv(k, cfg.block_k) * cfg.block_k, 1
    return k_per_split, splits


def _releases_early(weight: torch.Tensor) -> bool:
    """Whether a launch streaming `weight` lets its successors start at its beginning, whatever its caller asked
    (see `_EARLY_RELEASE_MIN_BYTES`)."""
    return weight.numel() * weight.element_size() >= _EARLY_RELEASE_MIN_BYTES


def _prefetch_lines(n: int, splits: int, lines_per_row: int, block_n: int) -> int:
    """L2 lines per weight row each program prefetches before it waits for its input (a power of two, or 0).

    As much of its K slice as `_PREFETCH_BUDGET_BYTES` allows over the whole matrix (more would evict lines the
    kernel has not read yet) and `_PREFETCH_MAX_ADDRESSES` allows per program (registers).
    """
    by_bytes = _PREFETCH_BUDGET_BYTES // (n * splits * _L2_LINE_BYTES)
    budget = min(lines_per_row, by_bytes, _PREFETCH_MAX_ADDRESSES // block_n)
    return 0 if budget < 1 else 1 << (budget.bit_length() - 1)
