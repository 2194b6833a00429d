"""The small all-reduces of a tensor-parallel decode step through peer memory instead of NCCL.

Why: a decode step of an 8B model under TP=2 runs two all-reduces per layer (72 for SDAR-8B), each of a few rows
of the hidden size (32 KB at batch 1). NCCL's ring spends several microseconds of protocol per call at that size,
whatever the bytes, and the 72 of them cost TP=2 a third of what halving the weights saves (measured on two
H200s: TP=1 4.08 ms, TP=2 3.28 ms per step, against a halved memory floor of 1.84 ms).

How: each rank allocates one buffer in symmetric memory (`torch.distributed._symmetric_memory`: every rank can
address every other rank's buffer over NVLink) once, when its group is set up. An all-reduce is then one kernel,
PyTorch's one-shot all-reduce: it copies this rank's input into its buffer, waits at a barrier for the peers to
have done the same, reads every rank's buffer and sums them in rank order. Every rank therefore computes the same
sum in the same order (the ranks' results are bitwise equal, as the sampler needs), and the kernel is captured in
CUDA graphs like any other. Inputs above `MAX_BYTES` (prefill) still go through NCCL, whose bandwidth wins there.

Only where it works: the buffer is set up and checked with a test sum on every rank, and any rank failing
(no peer access, an old PyTorch, a CPU group) makes every rank keep NCCL, since the ranks must all take the same
path. NVLink multicast is not used (the one-shot kernel reads peers with plain loads).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger("diffulex")

# Largest all-reduce (bytes) sent through peer memory: decode steps of a few hundred rows (SDAR-8B at 64 requests
# of 4 rows: 2 MB); larger ones are bandwidth-bound, where NCCL's ring is at least as fast.
MAX_BYTES = 4 << 20
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PeerAllReduce:
    """One group's peer-memory all-reduce: a `MAX_BYTES` symmetric buffer and the group's name."""

    def __init__(self, process_group: dist.ProcessGroup, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = process_group.group_name
        self.buffer = symm_mem.empty(MAX_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, process_group)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through peer memory: a contiguous CUDA tensor of a float dtype within `MAX_BYTES`."""
        return (
            x.is_cuda and x.dtype in _DTYPES and x.is_contiguous() and x.numel() * x.element_size() <= MAX_BYTES
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group's ranks, as a new tensor (``x`` unchanged)."""
        staging = self.buffer[: x.numel() * x.element_size()].view(x.dtype)
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x.reshape(-1), "sum", self.group_name)
        return out.view_as(x)


def peer_all_reduce_for(process_group: dist.ProcessGroup, size: int, rank: int) -> PeerAllReduce | None:
    """The group's `PeerAllReduce` where every rank can set one up and its test sum is right on every rank, else
    None (NCCL then). A collective: every rank of the group calls it at the same point."""
    if not torch.cuda.is_available() or dist.get_backend(process_group) != "nccl":
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    reducer: PeerAllReduce | None = None
    try:
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
            raise RuntimeError("this PyTorch has no symm_mem.one_shot_all_reduce_copy")
        reducer = PeerAllReduce(process_group, device)
        ok = all(_test_sum(reducer, size, rank, dtype, device) for dtype in (torch.bfloat16, torch.float32))
    except Exception as exc:  # noqa: BLE001 - whatever fails, NCCL is the safe path
        logger.info("peer-memory all-reduce unavailable on rank %d (%s); NCCL all-reduces", rank, exc)
        ok = False
    everyone = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=process_group)
    if not everyone.item():
        return None
    if rank == 0:
        logger.info("tensor-parallel all-reduces up to %d KB through peer memory (one-shot)", MAX_BYTES >> 10)
    return reducer


def _test_sum(reducer: PeerAllReduce, size: int, rank: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Two back-to-back sums (the second overwrites the buffer the first read) with known results."""
    results = []
    for offset in (1, 10):
        x = torch.full((1000,), float(rank + offset), dtype=dtype, device=device)
        results.append((reducer(x), sum(r + offset for r in range(size))))
    torch.cuda.synchronize(device)
    return all(bool((out == expected).all()) for out, expected in results)
