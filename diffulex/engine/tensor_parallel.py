"""Tensor and expert parallelism across processes: the engine's own process is rank 0, ranks 1..N-1 are workers.

The layout (`engine_world_size`): ``max(tensor_parallel_size, expert_parallel_size)`` ranks, one per device, with
``expert_parallel_size`` either 1 (tensor parallelism alone), equal to ``tensor_parallel_size`` (both groups span
the same ranks: attention, dense MLPs and shared experts split by TP, each routed expert whole on the rank owning
it), or used with ``tensor_parallel_size=1`` (attention and everything but the routed experts replicated on every
rank, each rank computing it whole; the experts split). So the ranks of one engine are always one group, and the
config refuses the other combinations (``Config``). vLLM's convention, EP ranks = the TP x DP ranks of a replica,
is the same at DP=1; DP ranks here are separate engines (`diffulex.engine.data_parallel`).

Every rank builds the same engine (`diffulex.engine.assembly.assemble`, with the process's tensor- and
expert-parallel groups joined first, so that each layer holds its rank's shard), in the same order, so that the
collectives of the build
(memory profiling, warm-ups, CUDA-graph capture) meet. Then only rank 0 schedules: each step it sends the step's
inputs, the flat `StepInputs` the model runner turns into tensors and, for replayed steps, the graph bucket and
sampling layout, in ONE broadcast over a gloo group (`diffulex.engine.step_broadcast`), and runs the step; each
worker receives it
and runs the same forward (and the same LM head, whose logits are gathered across the ranks, and on the graph path
the same in-graph greedy sampler) on its shard. Requests, their blocks and the scheduler exist on rank 0 only: a
worker never hears of a request.

`start_workers` starts ranks given an init method: processes of this host (``distributed_executor_backend="mp"``);
with ``"ray"`` the same seam is `diffulex.engine.ray_workers.RayWorkerPlacement.start_workers` (actors in one
placement group, reporting over sockets instead of pipes), and the group's life is the same from there on. A worker
that dies is found before the next broadcast (`TensorParallelWorkers.dead`) or by the collective it leaves hanging
(gloo reports the closed connection; every collective has ``distributed_timeout_seconds``), and the engine fails
with an error naming it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from diffulex.engine.step_broadcast import MessageKind, StepChannel, StepMessage
from diffulex.engine.stop_signals import leave_stop_signals_to_the_parent
from diffulex.layers.parallel_state import (
    engine_ranks,
    init_expert_parallel,
    init_tensor_parallel,
    reset_expert_parallel,
    reset_tensor_parallel,
)
from diffulex.layers.peer_exchange import release_peer_exchange

if TYPE_CHECKING:
    from diffulex.config import Config
    from diffulex.engine.assembly import EngineParts

    # How worker ranks start: (config, ranks, init_method, build) -> the started workers (`start_workers`'s shape).
    WorkerStarter = Callable[[Config, range, str, Callable[[Config], EngineParts]], list["WorkerProcess"]]

logger = logging.getLogger("diffulex")

# How long `TensorParallelWorkers.shutdown` waits for a worker to leave after the stop message, then after SIGKILL.
SHUTDOWN_WAIT_S = 30.0
KILL_WAIT_S = 5.0
# After a step failed: how long to wait for a worker that dropped out of a collective to be reaped, so that its
# death (and not a vague connection error) is what the engine reports.
DEATH_WAIT_S = 2.0
JOIN_POLL_S = 0.2  # how often rank 0, waiting for the workers to reach the group, checks that they still run


def rank_device(config: Config, rank: int) -> torch.device:
    """The CUDA device of ``rank``: ``device_ids[rank]``, else ``device_start + rank``; the CPU without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", config.device_ids[rank] if config.device_ids else config.device_start + rank)


def engine_world_size(config: Config) -> int:
    """The engine's ranks: the larger of its tensor- and expert-parallel sizes (the layouts of this module)."""
    return max(config.tensor_parallel_size, config.expert_parallel_size)


def join_group(config: Config, rank: int, init_method: str) -> StepChannel:
    """Join the engine's ranks (`engine_world_size`) as ``rank``: the collectives' process group (NCCL on CUDA,
    unless ``distributed_backend`` says gloo; gloo on the CPU), this process's tensor-parallel group (with
    ``tensor_parallel_size > 1``), its expert-parallel group (with ``expert_parallel_size > 1``), and the gloo group
    the step messages travel on. Every collective times out after ``distributed_timeout_seconds``."""
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = config.distributed_backend if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=config.distributed_timeout_seconds)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=engine_world_size(config), timeout=timeout
    )
    if config.tensor_parallel_size > 1:
        init_tensor_parallel()
    if config.expert_parallel_size > 1:
        init_expert_parallel()
    control = dist.new_group(backend="gloo", timeout=timeout)
    return StepChannel(control, rank)


def leave_group() -> None:
    """Back to the single rank, with ``torch.distributed`` torn down (a later engine may join a new group).

    An NCCL group is aborted rather than destroyed: its collectives captured in CUDA graphs are work that, from the
    process group's view, never completes (their events were captured, not recorded), and an orderly destroy waits
    for it forever on every rank (measured on two H200s: both ranks of a TP=2 engine with graphs stuck in
    ``destroy_process_group``; pytorch/pytorch#115388). The ranks leave only after the stop message
    (`stop_together`), when no collective is in flight, or after a worker died, when one may never finish: an abort
    loses nothing in the first case and is what the second needs. Gloo groups are destroyed as
    usual."""
    reset_tensor_parallel()
    reset_expert_parallel()
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
        dist.distributed_c10d._abort_process_group()  # also frees a kernel stuck on a dead peer (`kill`)
    else:
        dist.destroy_process_group()


@dataclass
class WorkerProcess:
    """One started worker: its rank, its process and the pipe it reports its build on."""

    rank: int
    process: mp.process.BaseProcess
    reports: Connection


def start_workers(
    config: Config, ranks: range, init_method: str, build: Callable[[Config], EngineParts]
) -> list[WorkerProcess]:
    """Start the worker ``ranks`` as processes of this host (the ``mp`` backend), each joining the group at
    ``init_method`` and building its engine with ``build`` (`diffulex.engine.assembly.assemble`: handed over, not
    imported, since the assembly starts the workers). Spawned (CUDA cannot be forked); not daemonic, so that a
    worker may start processes of its own (torch.compile's), which is why `TensorParallelWorkers.shutdown` ends
    them itself."""
    context = mp.get_context("spawn")
    workers = []
    for rank in ranks:
        ours, theirs = context.Pipe(duplex=False)
        process = context.Process(
            target=run_worker, args=(build, config, rank, init_method, theirs, True), name=f"diffulex-tp{rank}",
            daemon=False,
        )
        process.start()
        theirs.close()
        workers.append(WorkerProcess(rank, process, ours))
    return workers


def run_worker(
    build: Callable[[Config], EngineParts],
    config: Config,
    rank: int,
    init_method: str,
    reports: Connection,
    owns_process: bool = False,
) -> None:
    """A worker's life: say it is joining, join the group, build the same engine as rank 0 (its shard), report,
    then repeat rank 0's steps until the stop message. ``owns_process``: the worker is its process's whole life
    (the ``mp`` placement), so on NCCL it may end the process itself (below); a Ray actor's process is Ray's, and its
    `run` returns instead."""
    if owns_process:  # rank 0's process decides when this one ends (its stop message): `stop_signals`
        leave_stop_signals_to_the_parent()
    reports.send(("joining", None))
    try:
        channel = join_group(config, rank, init_method)
        parts = build(config)
    except BaseException:
        reports.send(("failed", traceback.format_exc()))
        raise
    reports.send(("ready", None))
    # An NCCL worker that owns its process ends the process at once when its work is over: with collectives captured
    # in CUDA graphs, tearing the group down (`leave_group`) or the interpreter's own teardown of it can wait forever
    # (measured on two H200s: rank 0's abort returned, the worker never exited). Its memory and communicators go
    # with the process; rank 0 has left the group by then (`TensorParallelWorkers.shutdown`).
    ends_process = owns_process and dist.get_backend() == "nccl"
    code = 0
    try:
        follow(parts, config, channel)
    except BaseException:
        if not ends_process:
            raise
        traceback.print_exc()  # the exit code says it failed
        code = 1
    finally:
        if not ends_process:
            leave_group()
        else:
            if code == 0:  # its steps are over: unmap the peers' inboxes, so that rank 0's is freed (not if a
                # collective failed, when a kernel may still be on them)
                release_peer_exchange(parts.runner.model)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def wait_until_joining(workers: list[WorkerProcess]) -> None:
    """Wait for every worker's word that it is joining the group, watching that each still runs: the rendezvous
    waits for every rank, so rank 0 enters it only once they all got that far (a worker that dies before, say while
    starting, fails the start at once instead of holding rank 0 there for the whole timeout)."""
    for worker in workers:
        while not worker.reports.poll(JOIN_POLL_S):
            if not worker.process.is_alive():
                raise WorkerDiedError(f"worker rank {worker.rank} exited with code {worker.process.exitcode}")
        try:
            status, _ = worker.reports.recv()
        except EOFError:  # its end of the pipe closed: it is exiting
            worker.process.join(KILL_WAIT_S)
            raise WorkerDiedError(
                f"worker rank {worker.rank} exited with code {worker.process.exitcode} before joining the group"
            ) from None
        if status != "joining":
            raise WorkerDiedError(f"worker rank {worker.rank} reported {status!r} before joining the group")


def follow(parts: EngineParts, config: Config, channel: StepChannel) -> None:
    """Receive and run rank 0's steps on this rank's shard until the stop message. A step's device work is queued,
    not awaited, as on rank 0; before a graph step stages its inputs into a host buffer, the device is done with
    that buffer's previous step."""
    runner = parts.runner
    buffer_done: dict[int, torch.cuda.Event] = {}
    while True:
        message = channel.receive()
        if message.kind is MessageKind.STOP:
            stop_together(channel)
            return
        if message.kind is MessageKind.STATIC_DECODE:  # as rank 0 runs it: outside inference mode
            parts.policy.enable_static_decode(runner, config, message.capture)
            continue
        done = buffer_done.pop(message.micro_batch, None)
        if done is not None:
            done.synchronize()
        hidden = runner.follow_step(message)
        if hidden is not None and hidden.is_cuda:
            event = torch.cuda.Event()
            event.record()
            buffer_done[message.micro_batch] = event


def stop_together(channel: StepChannel) -> None:
    """After the stop message: wait until every rank has it (a barrier on the gloo channel, bounded by
    `SHUTDOWN_WAIT_S`), so that no rank tears down its connections while another may still be reading the message;
    then all ranks leave the group at once."""
    dist.monitored_barrier(group=channel.group, timeout=timedelta(seconds=SHUTDOWN_WAIT_S))


class TensorParallelWorkers:
    """Rank 0's side of the group: the started workers, the channel to them, their liveness and shutdown."""

    def __init__(
        self, workers: list[WorkerProcess], channel: StepChannel, release: Callable[[], None] | None = None
    ) -> None:
        self.workers = workers
        self.channel = channel
        self.release = release  # frees what placed the workers (Ray's actors and placement group), once they ended
        self._closed = False

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def dead(self, wait_s: float = 0.0) -> str | None:
        """Which worker has exited, and how (None while all run); waits up to ``wait_s`` for one to be reaped."""
        for worker in self.workers:
            if wait_s:
                worker.process.join(wait_s)
            if not worker.process.is_alive():
                process = worker.process
                return (
                    f"tensor-parallel worker rank {worker.rank} (pid {process.pid}) exited with code "
                    f"{process.exitcode}{self._report_of(worker)}"
                )
        return None

    @staticmethod
    def _report_of(worker: WorkerProcess) -> str:
        """A worker's build failure, where it reported one."""
        try:
            while worker.reports.poll():
                status, detail = worker.reports.recv()
                if status == "failed":
                    return f"; its build failed:\n{detail}"
        except (EOFError, OSError):
            pass
        return ""

    def send(self, message: StepMessage) -> None:
        """Broadcast one step's message, refusing it when a worker has exited (it would never receive it)."""
        death = self.dead()
        if death is not None:
            raise WorkerDiedError(death)
        self.channel.send(message)

    def send_runner_pass(self, payload: object) -> None:
        """Broadcast a pass of a strategy's own runner (`MessageKind.RUNNER`): ``payload`` is that runner's message,
        which each worker's runner reads in its ``follow_step`` (the strategy need not know the message's frame)."""
        self.send(StepMessage(MessageKind.RUNNER, payload=payload))

    def wait_ready(self) -> None:
        """Wait for every worker's report of its finished build; raise the first failure."""
        for worker in self.workers:
            try:
                status, detail = worker.reports.recv()
            except EOFError:
                raise WorkerDiedError(self.dead(KILL_WAIT_S) or f"worker rank {worker.rank} closed its pipe") from None
            if status != "ready":
                raise WorkerDiedError(f"tensor-parallel worker rank {worker.rank} failed to build:\n{detail}")

    def shutdown(self) -> None:
        """Tell the workers to stop, leave the group with them, wait for them to exit, end any that stays. Safe to
        call twice.

        Rank 0 leaves the group once every worker has the stop message (`stop_together`), before it waits for them
        to exit: each worker leaves the group on its way out, and tearing down an NCCL communicator may wait for its
        peers to tear down theirs (``ncclCommAbort`` is collective in some NCCL versions), so a rank 0 that waited
        for the workers' exit before leaving would hold them in that teardown until it gave up and terminated
        them."""
        if self._closed:
            return
        self._closed = True
        stopped = False
        if self.dead() is None:  # else the others may be stuck in a collective the dead one left: end them
            try:
                self.channel.send(StepMessage(MessageKind.STOP))
                stop_together(self.channel)
                stopped = True
            except Exception:  # noqa: BLE001  (a broken group: the workers are ended below)
                logger.exception("could not send the stop message to the tensor-parallel workers")
        if stopped:
            leave_group()
        for worker in self.workers:
            worker.process.join(SHUTDOWN_WAIT_S if stopped else 0)
            if worker.process.is_alive():  # (a worker ignores SIGTERM: `stop_signals`)
                logger.warning("tensor-parallel worker rank %d did not stop; killing it", worker.rank)
                worker.process.kill()
                worker.process.join(KILL_WAIT_S)
            worker.reports.close()
        leave_group()
        self._release()

    def kill(self) -> None:
        """End the workers without a word (a build that failed on rank 0 leaves them inside a collective)."""
        kill_workers(self.workers)
        self._closed = True
        leave_group()
        self._release()

    def _release(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()


def kill_workers(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(KILL_WAIT_S)
        worker.reports.close()


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone: the model's shard it held cannot compute any more."""


def worker_placement(config: Config, size: int) -> tuple[WorkerStarter, Callable[[], None] | None, str]:
    """Where the `size` ranks' workers run (``distributed_executor_backend``): how to start them, what frees their
    placement once they ended, and the host the ranks meet at. ``mp``: `start_workers`, nothing, ``master_addr``.
    ``ray``: actors of one placement group (`diffulex.engine.ray_workers`), rank 0 on the GPU Ray reserved for it."""
    if config.distributed_executor_backend != "ray":
        return start_workers, None, config.master_addr
    from diffulex.engine.ray_workers import RayWorkerPlacement

    placement = RayWorkerPlacement(config, size)
    if placement.rank0_gpu is not None:  # rank 0's device is that GPU; each worker's, its own actor's only one
        config.device_ids = [placement.rank0_gpu] + [0] * (size - 1)

    def start(
        config: Config, ranks: range, init_method: str, build: Callable[[Config], EngineParts]
    ) -> list[WorkerProcess]:
        started = placement.start_workers(config, ranks, init_method, build, run_worker)
        return [WorkerProcess(rank, process, reports) for rank, process, reports in started]

    return start, placement.close, placement.master_addr(config)


def start_tensor_parallel(config: Config, build: Callable[[Config], EngineParts]) -> TensorParallelWorkers:
    """From the engine's process: check that the model splits over the engine's ranks (`engine_world_size`),
    start the workers (which build their engines with ``build``), and join the group as rank 0 (the build that
    follows runs in step with theirs)."""
    from diffulex.engine.tensor_parallel_check import check_parallel_layout, parallel_fields

    check_parallel_layout(config)
    size, asked = engine_world_size(config), parallel_fields(config)
    if config.device_ids and len(config.device_ids) < size:
        raise ValueError(
            f"device_ids={config.device_ids} is invalid with {asked}: must name one device per rank ({size})"
        )
    if torch.cuda.is_available() and config.distributed_executor_backend == "mp":
        count = torch.cuda.device_count()
        wanted = [rank_device(config, rank).index for rank in range(size)]
        if len(set(wanted)) < size or max(wanted) >= count:
            raise ValueError(
                f"{asked} is invalid here: it needs {size} distinct CUDA devices and got "
                f"{wanted} (device_ids={config.device_ids}, device_start={config.device_start}) of the {count} "
                "this process sees"
            )
    if mp.current_process().daemon:
        raise ValueError(
            f"{asked} is invalid in a data-parallel replica (its process "
            "may not start workers): with data_parallel_size > 1 use distributed_executor_backend='ray', whose "
            "replicas start their tensor-parallel workers"
        )
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            f"{asked} is invalid here: this process already belongs to a "
            "torch.distributed group (another tensor-parallel engine still open?); exit() that engine first"
        )
    if engine_ranks().size != 1:
        raise RuntimeError("this process already has a tensor- or expert-parallel group")
    start, release, master_addr = worker_placement(config, size)
    init_method = f"tcp://{master_addr}:{config.master_port}"
    workers: list[WorkerProcess] = []
    try:
        workers = start(config, range(1, size), init_method, build)
        wait_until_joining(workers)
        channel = join_group(config, 0, init_method)
    except Exception as err:
        exited = [w for w in workers if not w.process.is_alive()]
        kill_workers(workers)
        leave_group()
        if release is not None:
            release()
        why = f"worker rank {exited[0].rank} exited with code {exited[0].process.exitcode}" if exited else f"{err}"
        raise WorkerDiedError(f"could not join the tensor-parallel group at {init_method}: {why}") from err
    return TensorParallelWorkers(workers, channel, release)
