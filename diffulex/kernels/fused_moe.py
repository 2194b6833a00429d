"""Triton fused mixture-of-experts for decode-sized steps: the selected experts of one MoE layer over ``T`` rows
and their ``top_k`` token-expert pairs, as a stream of those experts' weights.

Why: at decode a MoE layer's work is reading the weights of the experts its rows select (SDAR-30B-A3B at batch
1: 32 pairs over ~29 of 128 experts); the FLOPs are small next to those bytes. ``torch._grouped_mm`` around a
sort, a gather and a scatter of the pairs is a dozen launches per layer and tiles shaped for large groups.

Four launches, every shape fixed by ``(T, top_k, experts, config)`` and nothing read back to the host, so a CUDA
graph captures them:

1. ``_align_kernel`` (one program per expert): sorts the pairs by expert and pads each expert's run of pairs to
   a whole number of ``block_m``-row tiles. It writes the pair of every padded row (``num_pairs`` on padding
   rows), the expert of every tile and the number of real tiles. The tile buffers are sized by an upper bound
   (`max_tiles`), so the grids below are fixed; their programs past the real tiles return at once. Pairs whose
   expert is outside ``[0, experts)`` (another rank's, under expert parallelism) get no row at all, and an
   expert without pairs gets no tile, so neither costs a weight byte. Up to `INLINE_ALIGN_MAX_PAIRS` pairs (a
   decode step of a few rows) this launch is left out: every gate_up program works out its own tile's rows and
   expert the same way from the pairs' experts, and the first column block writes them for the down kernel.
2. ``_gate_up_kernel`` (tiles x column blocks): the tile's rows of ``x`` (gathered by token) times one column
   block of its expert's gate and up rows, the gated activation in the epilogue, stored to a
   ``[tiles * block_m, inter]`` activation buffer in the padded order. The activation is a compile-time choice
   (`ACTIVATIONS`): ``"silu"`` (SwiGLU: SDAR-MoE, LLaDA2) or ``"gelu_tanh"`` (Gemma's GELU with the tanh
   approximation: DiffusionGemma). Either rounds as the unfused path does: the gate and up products are rounded
   to the input dtype (what a GEMM stores), the activation of the gate is computed in float32 and rounded to the
   dtype, and its product with up is formed in float32 and rounded once (`diffulex.kernels.activation`).
3. ``_down_kernel`` (tiles x column blocks): the activation rows times the expert's down block; the product is
   rounded to the input dtype (what a separate GEMM stores), multiplied in float32 by the pair's router weight
   and stored per pair, ``[T * top_k, hidden]`` float32.
4. ``_combine_kernel`` (token x column blocks): the token's ``top_k`` slots summed in slot order, skipping
   pairs of experts not held here, rounded to the dtype. No float atomics: the result is the same run to run,
   and it is bit for bit `diffulex.layers.moe.weighted_slots` of the per-pair outputs.

Each program of a GEMM streams one column block of its tile's expert once; when an expert's pairs fit one tile
(the decode case: `config_for` sizes ``block_m`` by the pairs per expert) every selected expert's weights are
read exactly once. Accumulation is float32 on the tensor cores (``tl.dot``); float32 inputs use IEEE products,
not TF32. Programmatic dependent launch chains the four launches at decode row counts (`diffulex.kernels.pdl`);
nothing of a launch's inputs is known before the previous one completes, so no prefetch precedes the wait.

No autotuning at run time; `config_for` picks the tile from the pairs per expert (or a measured table). Under
``TRITON_INTERPRET=1`` (the CPU tests) the tiles are multiplied in float32, as the interpreter's ``tl.dot``
mishandles bf16 operands;
products of bf16/fp16 values are exact in float32, so the result is the one the tensor cores accumulate.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from diffulex.kernels.activation import PRECISE_EXP, gelu_tanh_mul_rounded, silu_mul_rounded
from diffulex.kernels.fused_norm import cast_rne
from diffulex.kernels.pdl import INTERPRETING, launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The gated activations the gate_up epilogue applies, ``act(gate) * up``.
ACTIVATIONS = ("silu", "gelu_tanh")
# An MMA tile has at least 16 rows, and 16 is the smallest reduction tile it takes.
_MIN_TILE = 16
# Pairs the alignment reads per step of its loops: every program scans all pairs twice (the histogram, then its
# own), so a step's pairs in few wide loads; at least the fewest, at most the most (registers). LLaDA2-mini at batch
# 32 (8,192 pairs) took 51 us a layer in chunks of 256 on an H100, 21.8 in chunks of 2,048 and 19.2 in one chunk of
# 8,192 over 8 warps (2026-11-28, `bench/step_anatomy.py --model llada2-mini --batch 32`: 415 -> 366 us a step).
# Chunks wider than `_ALIGN_NARROW_CHUNK` take `_ALIGN_WIDE_WARPS` (up to 32 pairs a thread); narrower ones keep
# `_ALIGN_WARPS`, as measured before. Between the two (LLaDA2-mini at batch 9-31) the wide loads are not measured.
_ALIGN_MIN_CHUNK = 256
_ALIGN_MAX_CHUNK = 8192
_ALIGN_NARROW_CHUNK = 2048
_ALIGN_WARPS = 4
_ALIGN_WIDE_WARPS = 8
# Up to this many pairs, every gate_up program aligns the pairs itself and the alignment's launch is left out: at
# batch 1 (SDAR-30B-A3B: 32 pairs) a launch a layer costs more than each program's few loads and reductions
# (H100: 3.84 -> 3.73 ms a step). At 256 pairs the programs' share costs more than the launch (LLaDA2-mini at
# batch 1: 2.46 -> 2.63 ms; SDAR-30B-A3B at batch 8: 11.07 -> 11.10 ms).
INLINE_ALIGN_MAX_PAIRS = 64
# Columns of the combine's programs.
_COMBINE_BLOCK = 1024


class FusedMoEConfig(NamedTuple):
    """One launch shape of the two GEMMs: rows per tile, output columns per program (per half for gate_up),
    reduction tile, warps and pipeline stages."""

    block_m: int
    block_n_gate_up: int
    block_n_down: int
    block_k: int
    num_warps: int
    num_stages: int


# Rows per tile by the most pairs one expert is expected to get (average pairs per expert times
# `_SPREAD`): the smallest tile that keeps an expert's pairs in one tile, so its weights are read once.
_BLOCK_M_STEPS = (16, 32, 64)
# Headroom over the average pairs per expert: uniform routing of a few thousand pairs over a hundred or more
# experts leaves the busiest expert about twice the average.
_SPREAD = 2


# (experts, hidden, inter) -> (fewest pairs, config): configs measured faster than the default from that many pairs
# on (`bench/fused_moe_bench.py`, H100, 2026-11-26). DiffusionGemma-26B-A4B at 8 canvases (2,048 rows): 1,158 us
# against 1,383 a layer, each expert's 128 pairs in two tiles of 64 whose programs take 128 columns in 8 warps; at
# 1,024 rows and fewer the default was as fast or faster. (Row tiles of 128 and 256 were slower everywhere.)
MEASURED_CONFIGS: dict[tuple[int, int, int], tuple[int, FusedMoEConfig]] = {
    (128, 2816, 704): (2048 * 8, FusedMoEConfig(64, 128, 128, 64, 8, 4)),
    # LLaDA2-mini at batch 32 (1,024 rows, 2026-11-27): 732.6 us against the default's 775.1 (floor 537.2), down's
    # programs 256 columns wide, so each expert's activation tile is read by 8 programs instead of 32
    (256, 2048, 512): (1024 * 8, FusedMoEConfig(64, 64, 256, 64, 8, 3)),
    # The performance sweep's DiffusionGemma layout (32 experts of 2048 x 512, top 4; H200, 2026-11-28,
    # `--geometries diffusion-gemma-sweep`, docs/data/fused_moe_diffusion_gemma_sweep_h200.json): the same shape
    # from 256 rows, 73.5 / 83.5 / 127.7 / 206.9 us against the default's 78.6 / 100.1 / 148.9 / 262.8 at 256 / 512
    # / 1,024 / 2,048 rows
    (32, 2048, 512): (256 * 4, FusedMoEConfig(64, 64, 256, 64, 8, 3)),
}


def config_for(
    num_pairs: int, num_experts: int, hidden: int = 0, inter: int = 0, elem_size: int = 2
) -> FusedMoEConfig:
    """The config of a layer whose ``num_pairs`` token-expert pairs fall on ``num_experts`` experts of
    ``hidden x inter`` in inputs of ``elem_size`` bytes: a measured one (`MEASURED_CONFIGS`, bf16, whose tiles
    would not fit shared memory in float32) where there is one for that many pairs, else 64 columns per
    program and 128-wide reduction tiles, the skinny GEMM's measured choice for weight streams of this size
    (`diffulex.kernels.skinny_gemm`); three pipeline stages, so that two gate_up programs (a gate and an up tile
    per stage) share an SM's shared memory; and the row tile of `_BLOCK_M_STEPS`."""
    measured = MEASURED_CONFIGS.get((num_experts, hidden, inter))
    if measured is not None and num_pairs >= measured[0] and elem_size <= 2:
        return measured[1]
    busiest = triton.cdiv(num_pairs * _SPREAD, max(1, num_experts))
    block_m = next((m for m in _BLOCK_M_STEPS if m >= busiest), _BLOCK_M_STEPS[-1])
    return FusedMoEConfig(block_m, 64, 64, 128, 4, 3)


# (experts, hidden, inter, top_k) -> the most rows of a step at which the fused kernels measured faster than the
# grouped GEMM (`bench/fused_moe_bench.py`, bf16, CUDA-graph replay); unlisted geometries take the `fused_wins`
# default. DiffusionGemma-26B-A4B (H100, 2026-11-26): fused 580 / 650 / 824 / 1386 us against grouped 775 / 876 /
# 1116 / 1696 us at 256 / 512 / 1024 / 2048 rows (1 to 8 canvases), the largest row count measured. Its experts on
# one rank of tensor_parallel_size=2 (half the width; H200, 2026-11-28): fused 238 / 293 / 398 / 628 us against
# grouped 467 / 552 / 756 / 1210 us. The performance sweep's DiffusionGemma layout (32 experts of 2048 x 512, top 4;
# H200, 2026-11-28): fused 48.7 / 63.6 / 100.1 / 262.8 us against grouped 140.4 / 171.9 / 208.7 / 489.2 at 16 / 128 /
# 512 / 2,048 rows (1 to 128 canvases of 16), where the default rule took the grouped GEMM from 512 rows.
_FASTER_ROWS: dict[tuple[int, int, int, int], int] = {
    (128, 2816, 704, 8): 2048, (128, 2816, 352, 8): 2048, (32, 2048, 512, 4): 2048,
}  # fmt: skip


def fused_wins(rows: int, top_k: int, num_experts: int, hidden: int, inter: int) -> bool:
    """Whether the fused kernels should run a step of ``rows`` rows rather than the grouped GEMM: the measured
    row limit of the geometry, else (unmeasured) while the busiest expert's expected pairs fit one tile of the
    largest `_BLOCK_M_STEPS` (decode: each selected expert streamed once; SDAR-30B-A3B up to 512 rows,
    LLaDA2-mini up to 1024). Larger steps (prefill) stream each
    expert once per tile, where the grouped GEMM's large tiles are the better choice."""
    measured = _FASTER_ROWS.get((num_experts, hidden, inter, top_k))
    if measured is not None:
        return rows <= measured
    return rows * top_k * _SPREAD <= num_experts * _BLOCK_M_STEPS[-1]


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the tiles the alignment makes: every active expert (at most ``min(experts, pairs)``)
    pads its pairs by fewer than ``block_m`` rows."""
    active = min(num_experts, num_pairs)
    return (num_pairs + active * (block_m - 1)) // block_m


@triton.jit(do_not_specialize=["num_pairs"])
def _align_kernel(
    experts_ptr,  # [num_pairs] int32/int64 expert of each pair; outside [0, num_experts): skipped
    sorted_ptr,  # [max_tiles * BLOCK_M] int32: the pair of each padded row (num_pairs on padding rows)
    tile_expert_ptr,  # [max_tiles] int32: the expert of each real tile
    num_tiles_ptr,  # [1] int32: how many tiles are real
    num_pairs,
    num_experts,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_BINS: tl.constexpr,  # a power of two > num_experts: bin num_experts collects the skipped pairs
    USE_PDL: tl.constexpr,
):
    expert = tl.program_id(0)
    wait_for_inputs(USE_PDL)  # the router's choice comes from the kernels before
    bins = tl.arange(0, NUM_BINS)
    counts = tl.zeros([NUM_BINS], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(experts_ptr + offs, mask=offs < num_pairs, other=num_experts).to(tl.int32)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)
        counts += tl.histogram(ids, NUM_BINS)
    padded = tl.where(bins < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    start = tl.sum(tl.where(bins < expert, padded, 0), axis=0)
    mine = tl.sum(tl.where(bins == expert, counts, 0), axis=0)
    if expert == 0:
        tl.store(num_tiles_ptr, tl.sum(padded, axis=0) // BLOCK_M)
    release_dependents(USE_PDL)
    if mine > 0:
        placed = tl.zeros([], dtype=tl.int32)
        for c0 in range(0, num_pairs, CHUNK):
            offs = c0 + tl.arange(0, CHUNK)
            ids = tl.load(experts_ptr + offs, mask=offs < num_pairs, other=num_experts).to(tl.int32)
            hit = (ids == expert).to(tl.int32)
            slot = start + placed + tl.cumsum(hit, axis=0) - 1
            tl.store(sorted_ptr + slot, offs, mask=hit > 0)
            placed += tl.sum(hit, axis=0)
        rows = (mine + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad = mine + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + start + pad, num_pairs, mask=pad < rows)
        for tile in range(start // BLOCK_M, (start + rows) // BLOCK_M):
            tl.store(tile_expert_ptr + tile, expert)


@triton.jit
def _tile_rows(sorted_ptr, tile_expert_ptr, tile, num_pairs, BLOCK_M: tl.constexpr):
    """``(expert, rows, pair, ok)`` of a real tile: its expert, its padded rows, the pair of each row and which
    rows hold a pair."""
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    return expert, rows, pair, pair < num_pairs


@triton.jit
def _mma(acc, w, a, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``acc += w @ a^T`` (``w [BLOCK_N, BLOCK_K]`` weights, ``a [BLOCK_M, BLOCK_K]`` rows; ``acc [BLOCK_N,
    BLOCK_M]``) with float32 accumulation. The weight tile is the MMA's large side, as in the skinny GEMM."""
    if UPCAST:
        w = w.to(tl.float32)
        a = a.to(tl.float32)
    return tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)


@triton.jit
def _inline_tile_rows(
    experts_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, tile, num_pairs, num_experts,
    BLOCK_M: tl.constexpr, NUM_BINS: tl.constexpr, PAIRS: tl.constexpr,
):
    """`_tile_rows` of a tile worked out from the pairs' experts, as `_align_kernel` lays them out (``PAIRS``, a
    power of two, at least the pairs), and the padded rows of every real tile (the tile is real below them); a
    program of the first column block also writes its real tile's rows and expert there, and the first program the
    number of real tiles, for `_down_kernel`."""
    p = tl.arange(0, PAIRS)
    ids = tl.load(experts_ptr + p, mask=p < num_pairs, other=num_experts).to(tl.int32)
    ids = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    bins = tl.arange(0, NUM_BINS)
    padded = tl.where(bins < num_experts, (tl.histogram(ids, NUM_BINS) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    first_column = tl.program_id(1) == 0
    if first_column & (tile == 0):
        tl.store(num_tiles_ptr, total // BLOCK_M)
    row0 = tile * BLOCK_M
    expert = tl.sum((ends <= row0).to(tl.int32), axis=0)  # the first expert whose padded run ends past row0
    start = tl.sum(tl.where(bins == expert, ends - padded, 0), axis=0)
    mine = ids == expert
    slot = start + tl.cumsum(mine.to(tl.int32), axis=0) - 1  # the padded row of each of the expert's pairs
    rows = row0 + tl.arange(0, BLOCK_M)
    match = mine[None, :] & (slot[None, :] == rows[:, None])
    ok = tl.sum(match.to(tl.int32), axis=1) > 0
    pair = tl.where(ok, tl.sum(tl.where(match, p[None, :], 0), axis=1), num_pairs)
    if first_column & (row0 < total):
        tl.store(sorted_ptr + rows, pair)
        tl.store(tile_expert_ptr + tile, expert)
    return expert.to(tl.int64), rows, pair, ok, total


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr,  # [T, hidden]
    w_ptr,  # [experts, 2 * inter, hidden]: gate rows, then up rows
    experts_ptr,  # [num_pairs]: the expert of each pair (read only with ``INLINE_PAIRS``)
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    act_ptr,  # [max_tiles * BLOCK_M, inter] in x's dtype
    num_pairs,
    num_experts,
    inter,
    hidden,
    stride_xm,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    USE_PDL: tl.constexpr,
    ACTIVATION: tl.constexpr = "silu",  # one of ACTIVATIONS
    # > 0 (a power of two, at least the pairs): align the pairs here (`_inline_tile_rows`), no `_align_kernel`
    INLINE_PAIRS: tl.constexpr = 0,
    NUM_BINS: tl.constexpr = 1,  # with ``INLINE_PAIRS``: `_align_kernel`'s
):
    wait_for_inputs(USE_PDL)
    tile = tl.program_id(0)
    if INLINE_PAIRS > 0:
        expert, rows, pair, ok, real_rows = _inline_tile_rows(
            experts_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, tile, num_pairs, num_experts,
            BLOCK_M, NUM_BINS, INLINE_PAIRS,
        )  # fmt: skip
        if tile * BLOCK_M >= real_rows:  # past the real tiles: nothing to read or write
            return
    else:
        if tile >= tl.load(num_tiles_ptr):  # past the real tiles: nothing to read or write
            return
        expert, rows, pair, ok = _tile_rows(sorted_ptr, tile_expert_ptr, tile, num_pairs, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    cols = offs_n % inter  # columns past inter read valid rows and are never stored
    token = tl.where(ok, pair // TOP_K, 0).to(tl.int64)
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    gate_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    up_offset = inter.to(tl.int64) * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs, mask=ok[:, None], other=0.0)
            g = tl.load(gate_ptrs)
            u = tl.load(gate_ptrs + up_offset)
        else:
            k_ok = (k + offs_k) < hidden
            xv = tl.load(x_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(gate_ptrs, mask=k_ok[None, :], other=0.0)
            u = tl.load(gate_ptrs + up_offset, mask=k_ok[None, :], other=0.0)
        acc_gate = _mma(acc_gate, g, xv, UPCAST, PRECISION)
        acc_up = _mma(acc_up, u, xv, UPCAST, PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
    release_dependents(USE_PDL)
    out_dtype: tl.constexpr = act_ptr.dtype.element_ty
    # the two products rounded as a GEMM stores them, then the activation's roundings
    gate = cast_rne(tl.trans(acc_gate), out_dtype)
    up = cast_rne(tl.trans(acc_up), out_dtype)
    if ACTIVATION == "gelu_tanh":
        act = gelu_tanh_mul_rounded(gate, up, out_dtype, PRECISE_EXP)
    else:
        act = silu_mul_rounded(gate, up, out_dtype, PRECISE_EXP)
    act_ptrs = act_ptr + rows.to(tl.int64)[:, None] * inter + offs_n[None, :]
    tl.store(act_ptrs, act, mask=(offs_n < inter)[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr,  # [max_tiles * BLOCK_M, inter]
    w_ptr,  # [experts, hidden, inter]
    sorted_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    route_ptr,  # [num_pairs] float32 router weight of each pair
    per_pair_ptr,  # [num_pairs, hidden] float32
    num_pairs,
    hidden,
    inter,
    stride_we,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    tile = tl.program_id(0)
    if tile >= tl.load(num_tiles_ptr):  # past the real tiles: nothing to read or write
        return
    expert, rows, pair, ok = _tile_rows(sorted_ptr, tile_expert_ptr, tile, num_pairs, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    cols = offs_n % hidden
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * inter + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k + offs_k) < inter
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        acc = _mma(acc, w, a, UPCAST, PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    release_dependents(USE_PDL)
    route = tl.load(route_ptr + pair, mask=ok, other=0.0)
    y = cast_rne(tl.trans(acc), act_ptr.dtype.element_ty).to(tl.float32) * route[:, None]
    out_ptrs = per_pair_ptr + pair.to(tl.int64)[:, None] * hidden + offs_n[None, :]
    tl.store(out_ptrs, y, mask=ok[:, None] & (offs_n < hidden)[None, :])


@triton.jit
def _combine_kernel(
    per_pair_ptr,  # [T * TOP_K, hidden] float32
    experts_ptr,  # [T * TOP_K]
    out_ptr,  # [T, hidden]
    hidden,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < hidden
    wait_for_inputs(USE_PDL)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(experts_ptr + pair + tl.zeros([BLOCK], dtype=tl.int64))  # one value, per column
        held = (expert >= 0) & (expert < num_experts)  # another rank's pair was never written
        total += tl.load(per_pair_ptr + pair * hidden + cols, mask=col_ok & held, other=0.0)
    release_dependents(USE_PDL)
    tl.store(out_ptr + token * hidden + cols, cast_rne(total, out_ptr.dtype.element_ty), mask=col_ok)


def fused_moe(
    x: torch.Tensor,
    route_weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    config: FusedMoEConfig | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """``sum_j route_weights[t, j] * expert_{experts[t, j]}(x[t])`` over the ``top_k`` slots, in ``x``'s dtype,
    where an expert is ``down @ (act(gate @ x) * (up @ x))`` and ``act`` is `activation` (one of `ACTIVATIONS`).

    ``x [T, hidden]``; ``route_weights [T, top_k]`` (float32); ``experts [T, top_k]`` integer indices into the
    stacked weights ``gate_up [E, 2 * inter, hidden]`` (gate rows, then up rows) and ``down [E, hidden, inter]``.
    A pair whose index is outside ``[0, E)`` contributes nothing (another rank's expert under expert
    parallelism: pass global indices minus this rank's first). `config` overrides `config_for` (benchmarks and
    tests). Works on CUDA and under the Triton interpreter; no host sync, so a CUDA graph may capture it.
    """
    _check(x, route_weights, experts, gate_up, down)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    T, top_k = experts.shape
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    out = torch.empty_like(x)
    if T == 0:
        return out
    num_pairs = T * top_k
    cfg = config if config is not None else config_for(num_pairs, num_experts, hidden, inter, x.element_size())
    if cfg.block_m < _MIN_TILE or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"config block_m must be a power of two >= {_MIN_TILE}, got {cfg.block_m}")
    tiles = max_tiles(num_pairs, num_experts, cfg.block_m)
    device = x.device
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(2) == 1 else gate_up.contiguous()
    down = down if down.stride(2) == 1 else down.contiguous()
    flat_experts = experts.reshape(-1)
    flat_routes = route_weights.reshape(-1).float()
    sorted_pairs = torch.empty(tiles * cfg.block_m, dtype=torch.int32, device=device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=device)
    num_tiles = torch.empty(1, dtype=torch.int32, device=device)
    act = torch.empty(tiles * cfg.block_m, inter, dtype=x.dtype, device=device)
    per_pair = torch.empty(num_pairs, hidden, dtype=torch.float32, device=device)
    use_pdl = pdl_enabled(device, T)
    pdl = launch_kwargs(use_pdl)
    upcast = INTERPRETING
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    num_bins = triton.next_power_of_2(num_experts + 1)
    inline_pairs = triton.next_power_of_2(num_pairs) if num_pairs <= INLINE_ALIGN_MAX_PAIRS else 0
    if not inline_pairs:
        chunk = align_chunk(num_pairs)
        _align_kernel[(num_experts,)](
            flat_experts, sorted_pairs, tile_expert, num_tiles, num_pairs, num_experts,
            BLOCK_M=cfg.block_m, CHUNK=chunk, NUM_BINS=num_bins, USE_PDL=use_pdl,
            num_warps=_ALIGN_WIDE_WARPS if chunk > _ALIGN_NARROW_CHUNK else _ALIGN_WARPS, **pdl,
        )  # fmt: skip
    k_gate_up = _reduction_tile(cfg.block_k, hidden)
    _gate_up_kernel[(tiles, triton.cdiv(inter, cfg.block_n_gate_up))](
        x, gate_up, flat_experts, sorted_pairs, tile_expert, num_tiles, act, num_pairs, num_experts, inter, hidden,
        x.stride(0), gate_up.stride(0), gate_up.stride(1),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_gate_up, BLOCK_K=k_gate_up,
        EVEN_K=hidden % k_gate_up == 0, UPCAST=upcast, PRECISION=precision, PRECISE_EXP=PRECISE_EXP,
        USE_PDL=use_pdl, ACTIVATION=activation, INLINE_PAIRS=inline_pairs, NUM_BINS=num_bins,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    k_down = _reduction_tile(cfg.block_k, inter)
    _down_kernel[(tiles, triton.cdiv(hidden, cfg.block_n_down))](
        act, down, sorted_pairs, tile_expert, num_tiles, flat_routes, per_pair, num_pairs, hidden, inter,
        down.stride(0), down.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=k_down, EVEN_K=inter % k_down == 0,
        UPCAST=upcast, PRECISION=precision, USE_PDL=use_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )  # fmt: skip
    _combine_kernel[(T, triton.cdiv(hidden, _COMBINE_BLOCK))](
        per_pair, flat_experts, out, hidden, num_experts,
        TOP_K=top_k, BLOCK=_COMBINE_BLOCK, USE_PDL=use_pdl, num_warps=4, **pdl,
    )  # fmt: skip
    return out


def align_chunk(num_pairs: int) -> int:
    """Pairs per load of the alignment's loops (`_ALIGN_MIN_CHUNK` to `_ALIGN_MAX_CHUNK`): all where they fit."""
    return min(max(triton.next_power_of_2(num_pairs), _ALIGN_MIN_CHUNK), _ALIGN_MAX_CHUNK)


def _reduction_tile(block_k: int, size: int) -> int:
    """The config's reduction tile, narrowed to a short reduction (at least the MMA's 16)."""
    return max(_MIN_TILE, min(block_k, triton.next_power_of_2(size)))


def _check(
    x: torch.Tensor, route_weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> None:
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be [T, hidden] in one of {SUPPORTED_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    if experts.dim() != 2 or experts.shape[0] != x.shape[0] or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"experts must be int32/int64 [{x.shape[0]}, top_k], got {experts.dtype} {tuple(experts.shape)}"
        )
    if route_weights.shape != experts.shape:
        raise ValueError(f"route_weights must be {tuple(experts.shape)} like experts, got {tuple(route_weights.shape)}")
    if gate_up.dim() != 3 or gate_up.shape[2] != x.shape[1] or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [experts, 2 * inter, {x.shape[1]}], got {tuple(gate_up.shape)}")
    expected_down = (gate_up.shape[0], x.shape[1], gate_up.shape[1] // 2)
    if tuple(down.shape) != expected_down:
        raise ValueError(f"down must be {list(expected_down)} to match gate_up, got {tuple(down.shape)}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"gate_up and down must be {x.dtype} like x, got {gate_up.dtype} and {down.dtype}")
    tensors = (route_weights, experts, gate_up, down)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"every operand must be on {x.device}, got {[str(t.device) for t in tensors]}")
