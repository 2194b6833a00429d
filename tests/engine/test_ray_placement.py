"""Data-parallel replicas as Ray actors (``distributed_executor_backend="ray"``) on a local Ray instance (CPU).

Starting Ray costs seconds, so one instance serves the whole module and its engines.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from diffulex import Diffulex, SamplingParams
from diffulex.config import Config
from diffulex.engine import ray_cluster
from diffulex.engine.data_parallel import DataParallelEngine
from diffulex.engine.ray_placement import RayPlacement, import_ray, replica_bundles
from diffulex.engine.ray_workers import RayWorkerProcess
from diffulex.errors import EngineDeadError
from diffulex.testing import write_tiny_checkpoint
from diffulex.testing.distributed import free_ports

# On a machine with CUDA each replica's bundle takes a GPU; a single-GPU machine cannot place two.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="two replicas need two GPUs here"
)
FIELDS = {"block_size": 4, "max_model_len": 128}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["one", "two three", "four five six", "seven", "eight nine"]
LOCAL_CPUS = 4  # logical CPUs of the test's Ray instance: room for two replicas' bundles, not for five


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ray"), init_std=1.0, seed=3)


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module; engines built meanwhile join it and leave it running."""
    ray = import_ray()
    ray.init(num_cpus=LOCAL_CPUS, include_dashboard=False)
    yield ray
    ray.shutdown()


def test_two_ray_replicas_give_the_tokens_of_two_local_processes(ckpt, local_ray):
    with Diffulex(str(ckpt), data_parallel_size=2, **FIELDS) as local:
        expected = [t.token_ids for t in local.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with Diffulex(str(ckpt), data_parallel_size=2, distributed_executor_backend="ray", **FIELDS) as llm:
        assert isinstance(llm, DataParallelEngine)
        assert len(set(llm.replica_pids)) == 2 and os.getpid() not in llm.replica_pids
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [t.index for t in out] == list(range(len(PROMPTS)))
        assert [t.token_ids for t in out] == expected
        assert [r.alive for r in llm.load().replicas] == [True, True]
    assert local_ray.is_initialized()  # the engine leaves a Ray it did not start running
    assert local_ray.util.placement_group_table() and all(
        g["state"] == "REMOVED" for g in local_ray.util.placement_group_table().values()
    )


def test_a_ray_replica_that_dies_fails_only_its_requests(ckpt, local_ray):
    long = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    with Diffulex(str(ckpt), data_parallel_size=2, distributed_executor_backend="ray", **FIELDS) as llm:
        ids = [llm.add_request(prompt, long) for prompt in PROMPTS[:4]]  # replicas 0, 1, 0, 1
        llm.step()
        os.kill(llm.replica_pids[0], signal.SIGKILL)  # the actor's process, on this host
        finished = {}
        while not llm.is_finished():
            finished.update((u.req_id, u.trajectory) for u in llm.step() if u.finished)
        for i, req_id in enumerate(ids):
            traj = finished[req_id]
            if i % 2 == 0:
                assert traj.completion_reason == "error" and "data-parallel replica 0 died" in traj.error
            else:
                assert traj.error is None and len(traj.token_ids) == long.max_tokens
        assert [r.alive for r in llm.load().replicas] == [False, True]
        again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)  # the replica left takes the new requests
        assert all(t.error is None and t.token_ids for t in again)


@pytest.fixture(scope="module")
def tp_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """Two K/V heads: one per tensor-parallel rank."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ray-tp"), seed=1, init_std=1.0, num_key_value_heads=2)


def tensor_parallel_fields(backend: str, replicas: int = 1) -> dict:
    """Replica r's ranks meet at ``master_port + r``: a free run of one port per replica."""
    return {**FIELDS, "tensor_parallel_size": 2, "distributed_executor_backend": backend, "dtype": "float32",
            "master_addr": "127.0.0.1", "master_port": free_ports(replicas), "distributed_timeout_seconds": 120}


def test_tensor_parallel_ranks_as_ray_actors_give_the_tokens_of_local_workers(tp_ckpt, local_ray):
    with Diffulex(str(tp_ckpt), **tensor_parallel_fields("mp")) as local:
        expected = [t.token_ids for t in local.generate(PROMPTS, GREEDY, use_tqdm=False)]
    groups_before = set(local_ray.util.placement_group_table())
    llm = Diffulex(str(tp_ckpt), **tensor_parallel_fields("ray"))
    try:
        (worker,) = llm.workers.workers
        assert isinstance(worker.process, RayWorkerProcess) and worker.process.pid != os.getpid()
        (group,) = set(local_ray.util.placement_group_table()) - groups_before
        table = local_ray.util.placement_group_table()[group]
        assert table["state"] == "CREATED" and list(table["bundles"].values()) == [{"CPU": 1.0}] * 2  # a rank each
        assert [t.token_ids for t in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    finally:
        llm.exit()
    assert worker.process.exitcode == 0  # it left at the stop message, not killed
    assert local_ray.util.placement_group_table()[group]["state"] == "REMOVED"
    assert local_ray.is_initialized()  # a Ray the engine did not start stays up


def test_two_ray_replicas_each_split_over_two_ranks_give_the_tokens_of_one_split_engine(tp_ckpt, local_ray):
    """Each replica actor runs its tensor-parallel group on its host, at a port of its own."""
    with Diffulex(str(tp_ckpt), **tensor_parallel_fields("mp")) as one:
        expected = [t.token_ids for t in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with Diffulex(str(tp_ckpt), data_parallel_size=2, **tensor_parallel_fields("ray", replicas=2)) as llm:
        assert isinstance(llm, DataParallelEngine)
        assert [t.token_ids for t in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_a_ray_worker_that_dies_fails_the_engine_naming_it(tp_ckpt, local_ray):
    llm = Diffulex(str(tp_ckpt), **tensor_parallel_fields("ray"))
    try:
        os.kill(llm.workers.pids[0], signal.SIGKILL)  # the actor's process, on this host
        with pytest.raises(EngineDeadError, match="tensor-parallel worker rank 1"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.exit()


def test_replicas_the_cluster_cannot_place_are_refused_with_its_resources(ckpt, local_ray, monkeypatch):
    monkeypatch.setattr(ray_cluster, "PLACEMENT_TIMEOUT_S", 1.0)
    config = Config.from_kwargs(str(ckpt), data_parallel_size=LOCAL_CPUS + 1, **FIELDS)
    with pytest.raises(RuntimeError, match=f"needs {LOCAL_CPUS + 1} bundles of .*could not place"):
        RayPlacement(config)


def test_each_replica_bundle_holds_its_tensor_parallel_gpus_where_the_cluster_has_gpus(ckpt):
    config = Config.from_kwargs(str(ckpt), data_parallel_size=3, tensor_parallel_size=2, **FIELDS)
    assert replica_bundles(config, cluster_gpus=0.0) == [{"CPU": 1.0}] * 3
    assert replica_bundles(config, cluster_gpus=8.0) == [{"CPU": 1.0, "GPU": 2.0}] * 3


def test_the_ray_backend_without_ray_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails as when it is not installed
    with pytest.raises(ImportError, match=r"needs Ray, which is not installed: pip install 'diffulex\[ray\]'"):
        import_ray()
