"""A kernel that stores a small device tensor into pinned host memory, so that a CUDA graph can end with it.

Why: a decode step's result (``[2, rows]`` int64: accepted flags and tokens) must reach the host every step. A
copy into pinned memory (``Tensor.copy_``) is a copy-engine operation: a memcpy node inside a graph, a stream
operation of its own outside one. On an H100 at batch 1 the GPU spent 3-6 us before that copy and 9-13 us after
it before the next step's first kernel (measured in the batch-1 graph), against about a
microsecond for the same few bytes stored by a kernel. Pinned host memory is mapped into the device's address
space (unified virtual addressing), so a kernel's stores reach it directly; the host reads it once the stream
has synchronized, exactly as after the copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

_BLOCK = 1024  # elements per program: a decode step's result is at most a few thousand


@triton.jit
def _publish_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    release_dependents(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    wait_for_inputs(USE_PDL)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok), mask=ok)


def publish_to_host(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` by a kernel: ``src`` contiguous on the device, ``dst`` contiguous pinned host memory (on
    the CPU, under the Triton interpreter, any contiguous CPU tensor) of the same shape and dtype."""
    if src.shape != dst.shape or src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(
            f"need contiguous tensors of one shape and dtype, got {tuple(src.shape)} {src.dtype} -> "
            f"{tuple(dst.shape)} {dst.dtype}"
        )
    if src.is_cuda and (dst.is_cuda or not dst.is_pinned()):
        raise ValueError(f"the destination must be pinned host memory, got {dst.device} (pinned: {dst.is_pinned()})")
    n = src.numel()
    if n:
        use_pdl = pdl_enabled(src.device, src.shape[-1])
        _publish_kernel[(triton.cdiv(n, _BLOCK),)](
            src, dst, n, BLOCK=_BLOCK, USE_PDL=use_pdl, num_warps=4, **launch_kwargs(use_pdl)
        )
