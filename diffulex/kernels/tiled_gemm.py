"""Triton tiled GEMM, ``y[M, N] = x[M, K] @ W[N, K]^T``, for the mid-sized products where cuBLAS leaves SMs idle.

Why: at batch 128 with 4-token blocks a projection has M = 512 rows. cuBLAS covers SDAR-1.7B's 2048-column
o_proj and down_proj with 64 output tiles of 128 x 128, so half of an H100's 132 SMs have no work and the product
runs at about half the matmul peak (the issue's target is 60%). Smaller tiles or K split in two fill the GPU.

Design: both operands through TMA (Hopper's copy engine) into shared memory, ``num_stages`` K tiles in flight, one
``tl.dot`` per K tile with fp32 accumulation. Consecutive programs own the row tiles of one column tile, so a weight
tile is read from memory once and re-read from L2 by its neighbours. With ``split_k > 1`` each split stores its
fp32 partial and bumps a per-tile counter; the last split to arrive sums the partials in split order
(deterministic), writes the output and resets the counter (`diffulex.kernels.split_counters`). No allocation
depends on data, so calls can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors: no tiled GEMM
    TensorDescriptor = None

from diffulex.kernels.split_counters import split_counters


class TiledConfig(NamedTuple):
    """One launch shape: the output tile, the K tile, warps, pipeline depth and K splits."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1


@triton.jit(do_not_specialize=["M"])
def _tiled_kernel(
    x_desc,  # TMA descriptor of x [M, K] with [BLOCK_M, BLOCK_K] boxes
    w_desc,  # TMA descriptor of W [N, K] with [BLOCK_N, BLOCK_K] boxes
    y_ptr,  # [M, N], unit stride along N
    part_ptr,  # [splits, M, N] fp32 partials, or unused
    counters_ptr,  # [>= output tiles] int32, zero between launches, or unused
    M,
    N,
    K,
    stride_ym,
    k_per_split,  # multiple of BLOCK_K
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = tile % tiles_m
    pid_n = tile // tiles_m
    pid_k = tl.program_id(1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        a = x_desc.load([pid_m * BLOCK_M, k])
        b = w_desc.load([pid_n * BLOCK_N, k])
        acc = tl.dot(a, tl.trans(b), acc)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    if SPLIT:
        mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + mn, acc, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(1) - 1:
            tl.atomic_xchg(counters_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, tl.num_programs(1)):
                total += tl.load(part_ptr + s * M * N + mn, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, config: TiledConfig) -> torch.Tensor:
    """``x @ weight.T`` in ``x``'s dtype with fp32 accumulation (contiguous 2-D operands of one 16-bit dtype)."""
    if TensorDescriptor is None:
        raise RuntimeError("the tiled GEMM needs Triton's host tensor descriptors (triton >= 3.4)")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    k_tiles = triton.cdiv(k, config.block_k)
    splits = max(1, min(config.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, splits) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if splits > 1:
        part = torch.empty(splits * m * n, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, tiles)
    else:
        part = counters = y  # never read
    x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    _tiled_kernel[(tiles, splits)](
        x_desc, w_desc, y, part, counters, m, n, k, y.stride(0), k_per_split,
        SPLIT=splits > 1,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y
