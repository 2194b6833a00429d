"""The tensor-parallel and expert-parallel groups of this process: each one's rank, size and the collectives the
sharded layers need.

Why a process-wide group: tensor parallelism runs one process per device and every sharded layer of that process
belongs to the same group, so the layers read it once, when they are built (`tensor_parallel_group`), and keep it;
nothing in a forward looks it up. Without `init_tensor_parallel` the group is the single rank of size 1, whose
collectives return their input, so TP=1 runs exactly the code it always ran and needs no ``torch.distributed``.

The expert-parallel group is the same idea for the experts of a mixture-of-experts layer (`diffulex.layers.moe`):
each rank holds a contiguous range of the experts (`ExpertParallelGroup.owned_experts`) and the ranks' partial sums
are added by one all-reduce. It is set on its own (`init_expert_parallel`) because it need not be the TP group:
with ``expert_parallel_size == tensor_parallel_size`` on one host both are the same processes, but an engine may run
EP over ranks that are TP replicas of each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """``size`` ranks that each hold a slice of every sharded layer; this process is ``rank``.

    ``process_group`` is the ``torch.distributed`` group the collectives run on (None for the single rank).
    """

    rank: int = 0
    size: int = 1
    process_group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place); ``x`` itself at size 1."""
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` joined along ``dim`` in rank order (all ranks pass the same shape); ``x`` at size 1."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place: each rank passes a tensor of the same shape and dtype); ``x``
        itself at size 1."""
        if self.size == 1:
            return x
        dist.broadcast(x, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        return x

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' ``value`` (``value`` at size 1): a quantity every rank must agree on, such as
        the KV pages each can hold. ``device``: where the collective's tensor lives (CUDA for NCCL)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.process_group)
        return int(tensor.item())

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """``(start, length)`` of this rank's equal slice of ``total`` items; ``what`` names them in the error
        raised when ``total`` does not split evenly."""
        if total % self.size:
            raise ValueError(
                f"{what}={total} is invalid for tensor_parallel_size={self.size}: must be divisible by it, "
                f"since every rank holds an equal slice"
            )
        length = total // self.size
        return self.rank * length, length

    def head_shard(self, total: int, what: str) -> tuple[int, int]:
        """``(first head, heads)`` this rank holds of ``total`` attention heads: an equal slice where they split
        evenly, else (fewer heads than ranks, each dividing the rank count) one head shared by ``size / total``
        consecutive ranks. ``what`` names the config field in the error for a count that fits neither way."""
        if total % self.size == 0:
            return self.shard(total, what)
        if self.size % total == 0:
            return self.rank // (self.size // total), 1
        raise ValueError(
            f"{what}={total} is invalid for tensor_parallel_size={self.size}: the heads must split evenly across "
            f"the ranks or (K/V heads) divide the rank count, so that each is replicated on whole ranks"
        )

    def padded_shard(self, total: int) -> tuple[int, int, int]:
        """``(start, length, padded)`` of this rank's slice of ``total`` items split into equal slices of
        ``padded`` (the last ones short or empty where ``total`` does not split evenly); for the vocabulary,
        whose size need not be a multiple of the rank count."""
        padded = -(-total // self.size)
        start = min(self.rank * padded, total)
        return start, min(padded, total - start), padded


SINGLE_RANK = TensorParallelGroup()

_group: TensorParallelGroup = SINGLE_RANK


def tensor_parallel_group() -> TensorParallelGroup:
    """The group layers built now will shard over (`SINGLE_RANK` until `init_tensor_parallel`)."""
    return _group


@contextmanager
def using_tensor_parallel_group(group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Build layers over ``group`` inside the block (then back to the group before it): how the engine checks, on
    the meta device and before starting any worker, that a model's shapes split over a rank count."""
    global _group
    previous, _group = _group, group
    try:
        yield group
    finally:
        _group = previous


def _joined(
    process_group: dist.ProcessGroup | None, caller: str
) -> tuple[int, int, dist.ProcessGroup]:
    """(rank, size, group) of ``process_group`` (default: the whole initialized world) for `caller`'s group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{caller} needs torch.distributed initialized first (torch.distributed.init_process_group)")
    group = process_group if process_group is not None else dist.group.WORLD
    return dist.get_rank(group), dist.get_world_size(group), group


def init_tensor_parallel(process_group: dist.ProcessGroup | None = None) -> TensorParallelGroup:
    """Make ``process_group`` (default: every process of the initialized ``torch.distributed`` world) this
    process's tensor-parallel group, and return it. Layers built afterwards are sharded over it."""
    global _group
    _group = TensorParallelGroup(*_joined(process_group, "init_tensor_parallel"))
    return _group


def reset_tensor_parallel() -> None:
    """Back to the single rank (layers built afterwards hold whole weights)."""
    global _group
    _group = SINGLE_RANK


@dataclass(frozen=True)
class ExpertParallelGroup:
    """``size`` ranks over which a mixture's experts are split in contiguous ranges; this process is ``rank``.

    ``process_group`` is the ``torch.distributed`` group of the all-reduce (None for the single rank).
    """

    rank: int = 0
    size: int = 1
    process_group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place); ``x`` itself at size 1."""
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.process_group)
        return x

    def owned_experts(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds: its equal contiguous range of ``num_experts``."""
        if num_experts % self.size:
            raise ValueError(
                f"num_experts={num_experts} is invalid for expert_parallel_size={self.size}: must be divisible by "
                "it, since every rank holds an equal contiguous range of the experts"
            )
        count = num_experts // self.size
        return range(self.rank * count, (self.rank + 1) * count)


SINGLE_EXPERT_RANK = ExpertParallelGroup()

_expert_group: ExpertParallelGroup = SINGLE_EXPERT_RANK


def expert_parallel_group() -> ExpertParallelGroup:
    """The group mixture-of-experts layers built now split their experts over (`SINGLE_EXPERT_RANK` until
    `init_expert_parallel`)."""
    return _expert_group


@contextmanager
def using_expert_parallel_group(group: ExpertParallelGroup) -> Iterator[ExpertParallelGroup]:
    """Build MoE layers over ``group`` inside the block (then back to the group before it): the engine's check, on
    the meta device, that a model's experts split over a rank count."""
    global _expert_group
    previous, _expert_group = _expert_group, group
    try:
        yield group
    finally:
        _expert_group = previous


def init_expert_parallel(process_group: dist.ProcessGroup | None = None) -> ExpertParallelGroup:
    """Make ``process_group`` (default: every process of the initialized ``torch.distributed`` world) this
    process's expert-parallel group, and return it. MoE layers built afterwards hold only this rank's experts."""
    global _expert_group
    _expert_group = ExpertParallelGroup(*_joined(process_group, "init_expert_parallel"))
    return _expert_group


def reset_expert_parallel() -> None:
    """Back to the single rank (MoE layers built afterwards hold every expert)."""
    global _expert_group
    _expert_group = SINGLE_EXPERT_RANK


def engine_ranks() -> TensorParallelGroup:
    """Every rank of this process's engine, as one group: the collectives the whole engine must agree on (the KV
    pages each rank can hold) and which process is rank 0. The engine's layouts (`diffulex.engine.tensor_parallel`)
    make the larger of the tensor- and expert-parallel groups span all its ranks: TP alone, EP alone (attention
    replicated), or both over the same ranks."""
    expert = _expert_group
    if expert.size > _group.size:
        return TensorParallelGroup(expert.rank, expert.size, expert.process_group)
    return _group
