"""Tensor-parallel ranks as Ray actors (``distributed_executor_backend="ray"`` with ``tensor_parallel_size > 1``).

One placement group with a bundle per rank (one CPU, and one GPU where the cluster has GPUs). Rank 0 is the
engine's own process: an actor holds bundle 0 so that Ray hands its GPU to nobody else, and that bundle must be on
the engine's host. Ranks 1..N-1 are actors in bundles 1..N-1; each runs the same worker as a local process
(`diffulex.engine.tensor_parallel.run_worker`, handed in, not imported: that module imports this one), reporting
its build over an authenticated socket instead of a pipe. The collectives and the step messages then travel as
between local processes (`torch.distributed` at ``master_addr:master_port``), so the group's life, its liveness
checks and its shutdown are `diffulex.engine.tensor_parallel`'s.
"""

from __future__ import annotations

import copy
import os
import secrets
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from diffulex.config import Config
from diffulex.engine.ray_cluster import (
    ACTOR_START_TIMEOUT_S,
    import_ray,
    in_bundle,
    join_ray,
    keep_alive,
    place,
    release,
)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class TensorParallelActor:
    """One tensor-parallel rank's process on its Ray node (made a Ray actor class by `RayWorkerPlacement`): ranks
    1..N-1 run a worker (`diffulex.engine.tensor_parallel.run_worker`) reporting over a socket; rank 0's actor only
    holds its bundle (its GPU) for the engine's process, which runs rank 0."""

    def __init__(self, authkey: bytes) -> None:
        self._authkey = authkey
        self._listener: Listener | None = None

    def where(self) -> tuple[str, list[int], int]:
        """This actor's node id, the GPUs Ray gave it (as the node numbers them) and its process id."""
        import ray

        return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()], os.getpid()

    def open(self) -> tuple[str, int]:
        """Listen for rank 0's connection; returns the address to connect to."""
        import ray

        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=self._authkey)
        return self._listener.address

    def run(self, run_worker: Callable[..., None], build: Any, config: Config, rank: int, init_method: str) -> None:
        """Accept rank 0's connection, then be worker `rank` (`run_worker`) until the stop message."""
        assert self._listener is not None, "open() first"
        reports = self._listener.accept()
        self._listener.close()
        run_worker(build, config, rank, init_method, reports)


class RayWorkerProcess:
    """A worker actor seen as rank 0 sees a worker process (`pid`, `is_alive`, `join`, `exitcode`, `terminate`,
    `kill`): its `run` call still running is the process running."""

    def __init__(self, ray: Any, actor: Any, running: Any, pid: int) -> None:
        self._ray, self.actor, self._running, self.pid = ray, actor, running, pid
        self._exitcode: int | None = None  # kept once known: Ray may be shut down after the workers end

    def is_alive(self) -> bool:
        if self._exitcode is not None:
            return False
        done, _ = self._ray.wait([self._running], timeout=0)
        if done:
            self._exitcode = self._outcome()
        return not done

    def join(self, timeout: float | None = None) -> None:
        if self._exitcode is None:
            self._ray.wait([self._running], timeout=timeout)
            self.is_alive()

    @property
    def exitcode(self) -> int | None:
        """None while it runs; 0 after the stop message, 1 after an error, -9 when its actor was killed."""
        self.is_alive()
        return self._exitcode

    def _outcome(self) -> int:
        try:
            self._ray.get(self._running, timeout=0)
        except self._ray.exceptions.RayActorError:
            return -9
        except self._ray.exceptions.RayError:
            return 1
        return 0

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)


class RayWorkerPlacement:
    """The tensor-parallel ranks of one engine placed by Ray (``distributed_executor_backend="ray"``): one
    placement group with a bundle per rank (one CPU, and one GPU where the cluster has GPUs). Bundle 0 is rank 0's,
    the engine's own process: an actor holds it so that Ray hands its GPU to nobody else, and it must be on the
    engine's host, whose GPU of that number rank 0 then uses. Ranks 1..N-1 are actors in bundles 1..N-1, started by
    `start_workers`, behind the same seam as `diffulex.engine.tensor_parallel.start_workers`."""

    def __init__(self, config: Config, size: int) -> None:
        ray = self.ray = import_ray()
        self.size = size
        self.started_ray = join_ray(ray, size)
        self.gpus = ray.cluster_resources().get("GPU", 0.0) > 0
        self.bundles = [{"CPU": 1.0, **({"GPU": 1.0} if self.gpus else {})} for _ in range(size)]
        self.group = place(ray, self.bundles, "tensor_parallel_size", config.tensor_parallel_size)
        self.actors: list[Any] = []
        try:
            self.rank0_gpu = self._hold_rank0()
        except BaseException:
            self.close()
            raise

    def _actor(self, rank: int, authkey: bytes) -> Any:
        bundle = self.bundles[rank]
        actor_class = self.ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0))(TensorParallelActor)
        actor = actor_class.options(scheduling_strategy=in_bundle(self.group, rank), max_restarts=0).remote(authkey)
        self.actors.append(actor)
        return actor

    def _get(self, ref: Any, rank: int) -> Any:
        ray = self.ray
        try:
            return ray.get(ref, timeout=ACTOR_START_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start as a Ray actor: {err}") from None

    def _hold_rank0(self) -> int | None:
        """Hold bundle 0 for the engine's process; the GPU it reserved (None without GPUs)."""
        node, gpus, _ = self._get(self._actor(0, b"").where.remote(), 0)
        if not gpus:
            return None
        here = self.ray.get_runtime_context().get_node_id()
        if node != here:
            raise RuntimeError(
                f"{self.size} tensor-parallel ranks with distributed_executor_backend='ray': rank 0 runs in the "
                f"engine's process, but Ray placed its bundle (GPU {gpus[0]}) on node {node}, not on this one "
                f"({here}); start the engine on a host with a free GPU of the cluster"
            )
        return gpus[0]

    def master_addr(self, config: Config) -> str:
        """Where the ranks meet: ``master_addr``, or this host's address on the cluster where that is a loopback
        address and the cluster has several hosts (the workers may be on another)."""
        if config.master_addr not in LOOPBACK_HOSTS:
            return config.master_addr
        if sum(1 for node in self.ray.nodes() if node.get("Alive")) <= 1:
            return config.master_addr
        return self.ray.util.get_node_ip_address()

    def start_workers(
        self, config: Config, ranks: range, init_method: str, build: Any, run_worker: Callable[..., None]
    ) -> list[tuple[int, RayWorkerProcess, Connection]]:
        """Start worker `ranks` as actors in their bundles, each running `run_worker`: joining the group at
        `init_method` and building with `build`. Returns each rank, its process and the socket it reports on (as a
        local worker does over its pipe)."""
        workers = []
        for rank in ranks:
            authkey = secrets.token_bytes(32)
            actor = self._actor(rank, authkey)
            _, _, pid = self._get(actor.where.remote(), rank)
            address = self._get(actor.open.remote(), rank)
            worker_config = copy.copy(config)
            if self.gpus:  # Ray makes the bundle's GPU the actor's only visible device
                worker_config.device_ids = [0] * self.size
            running = actor.run.remote(run_worker, build, worker_config, rank, init_method)
            reports = Client(address, authkey=authkey)
            keep_alive(reports)
            workers.append((rank, RayWorkerProcess(self.ray, actor, running, pid), reports))
        return workers

    def close(self) -> None:
        """End every actor (rank 0's holder too), free the placement group, stop the Ray this placement started."""
        actors, self.actors = self.actors, []
        release(self.ray, actors, self.group, self.started_ray)
