"""Joining a Ray cluster and placing actors in placement groups: what the Ray placements of data-parallel replicas
(`diffulex.engine.ray_placement`) and of tensor-parallel workers (`diffulex.engine.ray_workers`) share.

Ray is an optional dependency (``pip install 'diffulex[ray]'``), imported only through `import_ray`. The engine
joins the running cluster named by ``RAY_ADDRESS`` (``ray start --head`` on one host, ``ray start --address=...``
on the others), else starts a local instance of its own for its lifetime (even where ``ray start`` ran on this
host: the address says which cluster to use); a Ray already initialized in this process is used as it is.
"""

from __future__ import annotations

import os
import socket
from multiprocessing.connection import Connection
from typing import Any

# How long the cluster may take to find room for every bundle (replica or rank) before the engine gives up.
PLACEMENT_TIMEOUT_S = 120.0
# How long an actor may take to start (import torch and this package) and open its socket.
ACTOR_START_TIMEOUT_S = 300.0
# TCP keepalive on the channel to an actor: a host that vanishes without closing its sockets (power, network) is
# noticed after idle + interval * probes seconds, and its replica (or rank) is reported instead of waited for.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3


def import_ray() -> Any:
    """The ``ray`` module, or an error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray, which is not installed: pip install 'diffulex[ray]' "
            "(or use distributed_executor_backend='mp' for processes on this host)"
        ) from None
    return ray


def join_ray(ray: Any, bundles: int) -> bool:
    """Join the cluster ``RAY_ADDRESS`` names, else start a local instance (with room for `bundles` one-CPU
    bundles); a Ray already initialized here is used as it is. Returns whether this call started Ray."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto")
        return False
    # Logical CPUs: a bundle needs one even on a host with fewer cores than bundles.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, bundles), include_dashboard=False,
             log_to_driver=True)
    return True


def place(ray: Any, bundles: list[dict[str, float]], field: str, value: int) -> Any:
    """A ready placement group of `bundles` (strategy ``PACK``: as few hosts as fit them), or an error naming
    `field` and the cluster's resources when the cluster cannot place them within `PLACEMENT_TIMEOUT_S`."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(
            f"{field}={value} with distributed_executor_backend='ray' needs {len(bundles)} bundles of {bundles[0]}, "
            f"which the Ray cluster could not place within {PLACEMENT_TIMEOUT_S:.0f} s (its resources: "
            f"{ray.cluster_resources()})"
        ) from None
    return group


def in_bundle(group: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


def keep_alive(conn: Connection) -> None:
    """Turn on TCP keepalive probes for the socket under ``conn`` (where the platform has the options)."""
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a duplicate of the same socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                              ("TCP_KEEPCNT", KEEPALIVE_PROBES)):  # fmt: skip
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def release(ray: Any, actors: list[Any], group: Any, started_ray: bool) -> None:
    """End ``actors``, free their placement ``group``, and stop the Ray instance if this placement started it."""
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        ray.kill(actor, no_restart=True)
    remove_placement_group(group)
    if started_ray:
        ray.shutdown()
