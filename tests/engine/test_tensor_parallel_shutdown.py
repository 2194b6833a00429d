"""How rank 0 ends its tensor-parallel workers: the stop message, then the group left by every rank at once, then
each worker's own exit (none killed)."""

from __future__ import annotations

import logging
from pathlib import Path

from diffulex.engine import tensor_parallel
from diffulex.engine.step_broadcast import MessageKind
from diffulex.engine.tensor_parallel import TensorParallelWorkers, WorkerProcess


class GroupTeardown:
    """Whether rank 0 has left the group: a worker's teardown that waits for its peers (NCCL's) ends only then."""

    def __init__(self) -> None:
        self.rank0_left = False

    def leave(self) -> None:
        self.rank0_left = True


class CollectiveTeardownWorker:
    """A worker process that got the stop message and now tears down a communicator whose teardown is collective:
    it exits only once rank 0 has left the group too."""

    def __init__(self, teardown: GroupTeardown) -> None:
        self.teardown = teardown
        self.pid = 4242
        self.exitcode: int | None = None
        self.killed = False

    def join(self, timeout: float | None = None) -> None:
        if self.teardown.rank0_left and self.exitcode is None:
            self.exitcode = 0

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.killed = True
        self.exitcode = -9


class Reports:
    def close(self) -> None:
        pass

    def poll(self, timeout: float = 0.0) -> bool:
        return False


class RecordingChannel:
    """Records what rank 0 sends; every worker receives it (the barrier after the stop message passes)."""

    def __init__(self) -> None:
        self.sent: list[MessageKind] = []

    def send(self, message) -> None:
        self.sent.append(message.kind)


def test_rank_0_leaves_the_group_before_waiting_so_a_collective_teardown_lets_the_worker_exit(monkeypatch, caplog):
    teardown = GroupTeardown()
    monkeypatch.setattr(tensor_parallel, "stop_together", lambda channel: None)
    monkeypatch.setattr(tensor_parallel, "leave_group", teardown.leave)
    monkeypatch.setattr(tensor_parallel, "SHUTDOWN_WAIT_S", 0.01)
    process = CollectiveTeardownWorker(teardown)
    channel = RecordingChannel()
    workers = TensorParallelWorkers([WorkerProcess(1, process, Reports())], channel)
    with caplog.at_level(logging.WARNING, logger="diffulex"):
        workers.shutdown()
    assert channel.sent == [MessageKind.STOP]
    assert process.exitcode == 0 and not process.killed
    assert "did not stop" not in caplog.text


def test_a_worker_that_does_not_exit_after_the_stop_is_still_killed(monkeypatch, caplog):
    """Leaving first does not give up the guard: a worker stuck elsewhere is ended after the wait."""
    teardown = GroupTeardown()
    monkeypatch.setattr(tensor_parallel, "leave_group", lambda: None)  # its teardown never completes
    monkeypatch.setattr(tensor_parallel, "stop_together", lambda channel: None)
    monkeypatch.setattr(tensor_parallel, "SHUTDOWN_WAIT_S", 0.01)
    monkeypatch.setattr(tensor_parallel, "KILL_WAIT_S", 0.01)
    process = CollectiveTeardownWorker(teardown)
    workers = TensorParallelWorkers([WorkerProcess(1, process, Reports())], RecordingChannel())
    with caplog.at_level(logging.WARNING, logger="diffulex"):
        workers.shutdown()
    assert process.killed
    assert "tensor-parallel worker rank 1 did not stop" in caplog.text


def test_exit_lets_a_gloo_worker_stop_by_itself(tmp_path: Path, caplog) -> None:
    from diffulex.testing.checkpoints import write_tiny_checkpoint
    from tests.engine.test_tensor_parallel_engine import GREEDY, make_engine

    model_dir = write_tiny_checkpoint(tmp_path / "sdar", "sdar", seed=1, num_key_value_heads=2)
    llm = make_engine(model_dir, "sdar", 2)
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    (worker,) = llm.workers.workers
    with caplog.at_level(logging.WARNING, logger="diffulex"):
        llm.exit()
    assert worker.process.exitcode == 0
    assert "did not stop" not in caplog.text


