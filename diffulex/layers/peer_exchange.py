"""The inboxes a tensor-parallel rank's peers write its all-reduce rows into (`diffulex.kernels.peer_all_reduce`).

Why its own object: the fused all-reduce + RMSNorm needs memory every rank of the group can store into (one
allocation per rank, mapped into every peer's address space by CUDA IPC: `open_peer_exchange`), the table of
those addresses, and per-row-position counters that are the wire format's flags; they are allocated once per
engine, before the KV cache is planned, and read by the kernel on every decode step. The row-parallel layers of a
model hold it (`attach_peer_exchange`), and their partials take it whenever they fit (`exchange_supports`);
anything larger (prefill chunks, the memory-profile forward) takes NCCL as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from diffulex.layers.parallel_state import TensorParallelGroup

if TYPE_CHECKING:
    from diffulex.layers.linear import RowParallelLinear

logger = logging.getLogger("diffulex")

# Rows an exchange carries at most: decode steps (a batch's blocks) and short chunks; larger launches are
# bandwidth-bound, where NCCL's ring is as good, and would make every inbox that much larger.
EXCHANGE_MAX_ROWS = 256
_SLOTS = 2  # each row position alternates between two inbox slots (see the kernel's module docstring)
_WORD_BYTES = 8  # 4 data bytes and a 4-byte flag
# Copies of each row position's exchange count: the most programs that push one row (the kernel's `row_programs`).
ROW_PROGRAMS_MAX = 8


@dataclass(frozen=True)
class PeerExchange:
    """This rank's inbox ``[2 slots, ranks, rows, words]`` of int64 words, the addresses of every rank's inbox
    (``inboxes``, int64 on the device), the per-row-position exchange counts (``uses``: `ROW_PROGRAMS_MAX` equal
    copies a row position, one for each program that may push the row), the flag a timed-out wait
    sets (``failed``) and what keeps the peers' inboxes mapped (``peer_storages``: theirs, opened in this process).
    ``trap_on_timeout``: a timed-out wait aborts the step with a CUDA error (an engine's exchange) instead of only
    setting ``failed`` (a test's)."""

    rank: int
    inbox: torch.Tensor
    inboxes: torch.Tensor
    uses: torch.Tensor
    failed: torch.Tensor
    timeout_ns: int
    peer_storages: list[torch.UntypedStorage] = field(default_factory=list)
    trap_on_timeout: bool = False

    @classmethod
    def over(
        cls,
        rank: int,
        inbox: torch.Tensor,
        inboxes: torch.Tensor,
        timeout_s: float,
        peer_storages: list[torch.UntypedStorage] | None = None,
        trap_on_timeout: bool = False,
    ) -> PeerExchange:
        """The exchange of ``rank`` over its ``inbox`` (zeroed) and every rank's inbox address, its counters new."""
        return cls(
            rank=rank,
            inbox=inbox,
            inboxes=inboxes,
            uses=torch.zeros(inbox.shape[2], ROW_PROGRAMS_MAX, dtype=torch.int32, device=inbox.device),
            failed=torch.zeros(1, dtype=torch.int32, device=inbox.device),
            timeout_ns=int(timeout_s * 1e9),
            peer_storages=peer_storages or [],
            trap_on_timeout=trap_on_timeout,
        )

    @property
    def world(self) -> int:
        return self.inbox.shape[1]

    @property
    def max_rows(self) -> int:
        return self.inbox.shape[2]

    @property
    def row_bytes(self) -> int:
        """The widest row (in bytes of the model dtype) an exchange carries."""
        return self.inbox.shape[3] * 4

    def supports(self, local: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether ``local`` (this rank's partial) with ``residual`` goes through this exchange."""
        from diffulex.kernels.peer_all_reduce import exchange_supports

        return local.device == self.inbox.device and exchange_supports(local, residual, self.row_bytes, self.max_rows)

    def release(self) -> None:
        """Unmap the peers' inboxes (drop the storages opened from their handles): before a process ends, so that each
        peer's inbox is freed rather than held for a reader that is gone (PyTorch warns at the peer's exit then:
        "Producer process has been terminated before all shared CUDA tensors released"). No launch may use the
        exchange afterwards."""
        self.peer_storages.clear()

    def timed_out(self) -> bool:
        """Whether a wait for a peer's rows ever gave up (that step's result is not the sum; reads the device)."""
        return bool(self.failed.item())


def inbox_shape(world: int, row_bytes: int, max_rows: int) -> tuple[int, int, int, int]:
    return (_SLOTS, world, max_rows, -(-row_bytes // 4))


def _map_peer_inboxes(inbox: torch.Tensor, group: TensorParallelGroup) -> tuple[list[int], list[torch.UntypedStorage]]:
    """Every rank's inbox address in this process (a collective): its own, and each peer's inbox opened from the
    CUDA IPC handle the peer shares, with this rank's device current, so that this device is the one given access
    to the peer's memory. Returns the addresses and the opened storages (the mappings live as long as they do).

    Why CUDA IPC rather than PyTorch's symmetric memory: the latter keys each rendezvous by how many the process
    has done (pytorch/pytorch#196082), so the second sharded engine of a process, whose workers are new processes,
    waited forever under another key than theirs (measured: two H100s, 2026-11-27)."""
    device = inbox.device
    shared = inbox.untyped_storage()._share_cuda_()  # (device, handle, size, offset, ref counter, event...)
    gathered: list = [None] * group.size
    dist.all_gather_object(gathered, (device.index, shared[1:]), group=group.process_group)
    addresses, opened = [], []
    for rank, (peer_device, peer_inbox) in enumerate(gathered):
        if rank == group.rank:
            addresses.append(inbox.data_ptr())
            continue
        if not torch.cuda.can_device_access_peer(device, peer_device):
            raise RuntimeError(f"cuda:{device.index} cannot access the memory of cuda:{peer_device} (rank {rank})")
        storage = torch.UntypedStorage._new_shared_cuda(device.index, *peer_inbox)
        opened.append(storage)
        addresses.append(storage.data_ptr())
    return addresses, opened


def open_peer_exchange(
    group: TensorParallelGroup,
    device: torch.device,
    row_bytes: int,
    timeout_s: float,
    max_rows: int = EXCHANGE_MAX_ROWS,
) -> PeerExchange | None:
    """Allocate this rank's inbox and map every peer's (a collective: every rank calls it, in the same order as its
    other collectives). None, with the reason logged, where the ranks cannot map each other's memory (no CUDA, a
    device without peer access to another's, an allocator whose memory CUDA IPC cannot share): the all-reduces
    stay NCCL's."""
    if group.size == 1 or device.type != "cuda" or group.process_group is None:
        return None
    inbox = torch.zeros(inbox_shape(group.size, row_bytes, max_rows), dtype=torch.int64, device=device)
    failure = ""
    # a rank that cannot map its peers (or whose PyTorch lacks the storage IPC calls) still joins the agreement below
    try:
        addresses, opened = _map_peer_inboxes(inbox, group)
    except (RuntimeError, AttributeError, TypeError) as err:
        failure = f"rank {group.rank}: {err}"
    failures = [None] * group.size
    dist.all_gather_object(failures, failure, group=group.process_group)  # every rank takes the same path
    if any(failures):
        logger.info(
            "tensor parallel: peer memory unavailable (%s): all-reduces by NCCL", "; ".join(filter(None, failures))
        )
        return None
    torch.cuda.synchronize(device)
    # no rank pushes before every inbox is zeroed and mapped (the device named for NCCL, which would warn otherwise)
    nccl = dist.get_backend(group.process_group) == "nccl"
    dist.barrier(group=group.process_group, device_ids=[device.index] if nccl else None)
    logger.info(
        "tensor parallel: all-reduces before a norm go through peer memory up to %d rows of %d bytes (%.1f MiB an "
        "inbox); larger ones by NCCL", max_rows, row_bytes, inbox.numel() * _WORD_BYTES / 2**20,
    )  # fmt: skip
    table = torch.tensor(addresses, dtype=torch.int64, device=device)
    return PeerExchange.over(group.rank, inbox, table, timeout_s, peer_storages=opened, trap_on_timeout=True)


def exchanges_in_one_process(
    world: int, device: torch.device, row_bytes: int, max_rows: int = 8, timeout_s: float = 10.0
) -> list[PeerExchange]:
    """``world`` exchanges over plain memory of one process, each rank's inbox reachable from the others: how tests
    run every rank's kernel in one process, one rank after another (on the CPU under the Triton interpreter, or on
    one GPU)."""
    inboxes = [
        torch.zeros(inbox_shape(world, row_bytes, max_rows), dtype=torch.int64, device=device) for _ in range(world)
    ]
    addresses = torch.tensor([inbox.data_ptr() for inbox in inboxes], dtype=torch.int64, device=device)
    return [PeerExchange.over(rank, inbox, addresses, timeout_s) for rank, inbox in enumerate(inboxes)]


def row_parallel_projections(model: nn.Module) -> list[RowParallelLinear]:
    """``model``'s row-parallel projections: the layers whose partial outputs an exchange all-reduces."""
    from diffulex.layers.linear import RowParallelLinear

    return [module for module in model.modules() if isinstance(module, RowParallelLinear)]


def attach_peer_exchange(model: nn.Module, exchange: PeerExchange) -> int:
    """Hand ``exchange`` to every row-parallel projection of ``model`` sharded over its ranks (their unsummed output
    then goes to the next norm through it, `RowParallelLinear.forward_unsummed`); returns how many."""
    sharded = [module for module in row_parallel_projections(model) if module.tp.size == exchange.world]
    for module in sharded:
        module.peer_exchange = exchange
    return len(sharded)


def release_peer_exchange(model: nn.Module) -> None:
    """Take the peer exchange from ``model``'s projections and unmap the peers' inboxes (`PeerExchange.release`),
    after its last step: the projections all-reduce by NCCL from then on."""
    exchanges = {id(module.peer_exchange): module.peer_exchange for module in row_parallel_projections(model)}
    for module in row_parallel_projections(model):
        module.peer_exchange = None
    for exchange in exchanges.values():
        if exchange is not None:
            exchange.release()


def connect_peer_exchange(model: nn.Module, device: torch.device, dtype: torch.dtype, timeout_s: float) -> int:
    """Open the tensor-parallel group's exchange (`open_peer_exchange`, a collective) sized for ``model``'s widest
    row-parallel output in ``dtype``, and hand it to those projections; how many took it (0: NCCL all-reduces)."""
    from diffulex.layers.parallel_state import tensor_parallel_group

    group = tensor_parallel_group()
    widths = [module.weight.shape[0] for module in row_parallel_projections(model)]
    if group.size == 1 or not widths:
        return 0
    exchange = open_peer_exchange(group, device, max(widths) * dtype.itemsize, timeout_s)
    return 0 if exchange is None else attach_peer_exchange(model, exchange)
