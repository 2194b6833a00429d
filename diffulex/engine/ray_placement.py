"""Data-parallel replicas as Ray actors (``distributed_executor_backend="ray"``), so that they span the hosts of a Ray
cluster.

Ray only places and starts the replicas: one placement group with one bundle per replica (its GPUs, one per
tensor-parallel rank, when the cluster has GPUs, else none; one CPU), one actor per bundle. The actor then runs the
same replica loop as a local process (`diffulex.engine.replica_process`), over a socket the engine opens to it with
``multiprocessing.connection`` (authenticated with a key only the engine and its actors know). Why a socket and not
actor method calls: a replica steps on its own and streams what every step did, and the engine waits on every
replica at once; actor calls would queue each add and abort behind the running step and need a poll per step. With
the same channel, the engine's code and its failure semantics are the same on both backends: an actor that dies
closes its socket, and the engine fails that replica's requests only.

Ray is an optional dependency (``pip install 'diffulex[ray]'``), imported only here. The engine joins the running
cluster named by ``RAY_ADDRESS`` (``ray start --head`` on one host, ``ray start --address=...`` on the others), else
starts a local instance of its own for its lifetime (even where ``ray start`` ran on this host: the address says
which cluster to use); a Ray already initialized in this process is used as it is.
"""

from __future__ import annotations

import os
import secrets
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
from diffulex.engine.replica_process import serve_replica
from diffulex.engine.tensor_parallel import engine_world_size


class ReplicaActor:
    """The process of one replica on its Ray node (made a Ray actor class by `RayPlacement`)."""

    def __init__(self, authkey: bytes) -> None:
        self._authkey = authkey
        self._listener: Listener | None = None

    def open(self) -> tuple[tuple[str, int], int]:
        """Listen for the engine; returns the address to connect to and this process's id."""
        import ray

        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=self._authkey)
        return self._listener.address, os.getpid()

    def serve(self, model: str, kwargs: dict[str, Any]) -> None:
        """Accept the engine's connection, then run the replica until the engine closes it."""
        assert self._listener is not None, "open() first"
        conn = self._listener.accept()
        self._listener.close()
        serve_replica(model, kwargs, conn)


class RayReplicaProcess:
    """A replica actor seen as the engine sees a local replica process (`pid`, `is_alive`, `join`, `kill`)."""

    def __init__(self, ray: Any, actor: Any, serving: Any, pid: int) -> None:
        self._ray, self.actor, self._serving, self.pid = ray, actor, serving, pid

    def is_alive(self) -> bool:
        done, _ = self._ray.wait([self._serving], timeout=0)
        return not done

    def join(self, timeout: float | None = None) -> None:
        self._ray.wait([self._serving], timeout=timeout)

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)


def replica_bundles(config: Config, cluster_gpus: float) -> list[dict[str, float]]:
    """One bundle per replica: one CPU, and its ranks' GPUs where the cluster has GPUs (one per rank of its tensor-
    and expert-parallel layout, `diffulex.engine.tensor_parallel.engine_world_size`)."""
    bundle: dict[str, float] = {"CPU": 1.0}
    if cluster_gpus > 0:
        bundle["GPU"] = float(engine_world_size(config))
    return [dict(bundle) for _ in range(config.data_parallel_size)]


class RayPlacement:
    """The Ray connection and placement group of one `DataParallelEngine`, and the replica actors started in it."""

    def __init__(self, config: Config) -> None:
        ray = self.ray = import_ray()
        self.started_ray = join_ray(ray, config.data_parallel_size)
        self.bundles = replica_bundles(config, ray.cluster_resources().get("GPU", 0.0))
        self.group = place(ray, self.bundles, "data_parallel_size", config.data_parallel_size)
        self.actors: list[Any] = []

    def start(self, rank: int, model: str, kwargs: dict[str, Any]) -> tuple[Connection, RayReplicaProcess]:
        """Start replica ``rank`` in its bundle; returns the engine's end of its channel and its process."""
        ray = self.ray
        bundle = self.bundles[rank]
        authkey = secrets.token_bytes(32)
        actor_class = ray.remote(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0))(ReplicaActor)
        actor = actor_class.options(scheduling_strategy=in_bundle(self.group, rank), max_restarts=0).remote(authkey)
        self.actors.append(actor)
        try:
            address, pid = ray.get(actor.open.remote(), timeout=ACTOR_START_TIMEOUT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            raise RuntimeError(f"data-parallel replica {rank} failed to start as a Ray actor: {err}") from None
        serving = actor.serve.remote(model, kwargs)
        conn = Client(address, authkey=authkey)
        keep_alive(conn)
        return conn, RayReplicaProcess(ray, actor, serving, pid)

    def close(self) -> None:
        """End every actor, free the placement group, and stop the Ray instance this placement started."""
        actors, self.actors = self.actors, []
        release(self.ray, actors, self.group, self.started_ray)

