"""The engine loop in isolation, on a scripted fake engine: batching, abort, shutdown, failure, load test smoke."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from diffulex import SamplingParams
from diffulex.engine.engine_load import EngineLoad
from diffulex.engine.request_update import RequestUpdate
from diffulex.outputs import Trajectory
from diffulex.server.engine_loop import (
    Emission,
    EngineLoop,
    EngineUnavailableError,
    GenerationInput,
    QueueFullError,
    RequestTooLargeError,
)
from diffulex.server.metrics import ServerMetrics
from diffulex.strategy.request import StepRecord

from .conftest import RunningServer


class FakeEngine:
    """Each request takes ``max_tokens`` steps, one token (id 7) per step; records every batch it ran."""

    def __init__(self, fail_at_step: int | None = None, step_delay: float = 0.0005) -> None:
        self.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens=False: [1] * len(text.split()))
        self.config = SimpleNamespace(block_size=4, max_model_len=64, max_num_reqs=4, model="/fake")
        self.settings = SimpleNamespace(block_size=4)  # the span of a request's blocks
        self.mask_token_id = 0
        self.vocab_limit = 100
        self.requests: dict[int, dict] = {}
        self.batches: list[list[int]] = []
        self.steps = 0
        self.fail_at_step = fail_at_step
        self.step_delay = step_delay  # like a forward: gives other threads a chance to run
        self.closed = False

    def add_request(self, ids, params: SamplingParams) -> int:
        if len(ids) >= self.config.max_model_len:
            raise ValueError("prompt too long")
        req_id = len(self.requests)
        self.requests[req_id] = {"ids": list(ids), "left": params.max_tokens, "out": []}
        return req_id

    def abort_request(self, req_id: int) -> bool:
        return self.requests.pop(req_id, None) is not None

    def is_finished(self) -> bool:
        return not self.requests

    def load(self) -> EngineLoad:
        return EngineLoad(len(self.requests), 0, 0, 100)

    def step(self) -> list[RequestUpdate]:
        time.sleep(self.step_delay)
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("device lost")
        self.batches.append(sorted(self.requests))
        updates = []
        for req_id, req in list(self.requests.items()):
            req["out"].append(7)
            req["left"] -= 1
            done = req["left"] == 0
            record = StepRecord(self.steps, 1, 1, (0,), (7,), 0.001)
            traj = None
            if done:
                del self.requests[req_id]
                traj = Trajectory(0, req_id, req["ids"], req["out"], "x" * len(req["out"]), "max_new_tokens_reached",
                                  len(req["out"]))
            updates.append(RequestUpdate(req_id, record, done, list(req["out"]), list(req["out"]), traj))
        return updates

    def exit(self) -> None:
        self.closed = True
        self.requests.clear()


async def drain(sink: asyncio.Queue[Emission], count: int, timeout: float = 10.0) -> list[Emission]:
    """Collect emissions until ``count`` requests have ended (bounded in time)."""
    out, ended = [], 0
    while ended < count:
        emission = await asyncio.wait_for(sink.get(), timeout)
        out.append(emission)
        ended += emission.final
    return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_requests_join_a_running_batch_between_steps() -> None:
    async def scenario():
        engine = FakeEngine()
        loop = EngineLoop(engine, max_waiting=4)
        loop.start()
        sink: asyncio.Queue[Emission] = asyncio.Queue()
        await loop.submit([GenerationInput([1, 1], SamplingParams(max_tokens=400))], sink)
        while engine.steps < 3:
            await asyncio.sleep(0.001)
        await loop.submit([GenerationInput([3], SamplingParams(max_tokens=3))], sink)
        emissions = await drain(sink, 2)
        await loop.shutdown(1.0)
        return engine, emissions

    engine, emissions = run(scenario())
    assert [0, 1] in engine.batches, "the second request should have joined the first one's batch"
    finals = [e for e in emissions if e.final]
    assert [e.update.trajectory.completion_reason for e in finals] == ["max_new_tokens_reached"] * 2
    assert engine.closed


def test_bad_input_rejects_the_whole_submission_and_leaves_nothing_behind() -> None:
    async def scenario():
        engine = FakeEngine()
        loop = EngineLoop(engine)
        loop.start()
        sink: asyncio.Queue[Emission] = asyncio.Queue()
        good = GenerationInput([1], SamplingParams(max_tokens=5))
        with pytest.raises(ValueError, match="too long"):
            await loop.submit([good, GenerationInput(list(range(100)), SamplingParams())], sink)
        assert loop.in_flight == 0 and engine.is_finished()
        await loop.submit([good], sink)
        await drain(sink, 1)
        await loop.shutdown(1.0)

    run(scenario())


def test_capacity_rejects_or_waits() -> None:
    async def scenario():
        engine = FakeEngine()  # max_num_reqs=4
        loop = EngineLoop(engine, max_waiting=0, queue_policy="reject")
        loop.start()
        sink: asyncio.Queue[Emission] = asyncio.Queue()
        long = await loop.submit([GenerationInput([1], SamplingParams(max_tokens=10**6))] * 4, sink)
        with pytest.raises(QueueFullError):
            await loop.submit([GenerationInput([2], SamplingParams(max_tokens=1))], sink)
        with pytest.raises(RequestTooLargeError, match="can never run"):
            await loop.submit([GenerationInput([2], SamplingParams(max_tokens=1))] * 5, sink)
        loop.queue_policy, loop.queue_timeout = "wait", 10.0
        waiter = asyncio.create_task(loop.submit([GenerationInput([2], SamplingParams(max_tokens=1))], sink))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        loop.abort([long[0].rid])  # frees one slot: the waiter gets it
        await asyncio.wait_for(waiter, 5)
        ended = await drain(sink, 2)
        assert sorted(e.error or e.update.trajectory.completion_reason for e in ended if e.final) == [
            "aborted", "max_new_tokens_reached"]
        loop.queue_timeout = 0.05
        with pytest.raises(QueueFullError, match="within"):
            await loop.submit([GenerationInput([2], SamplingParams(max_tokens=1))] * 2, sink)
        await loop.shutdown(0.0)

    run(scenario())


def test_a_request_waiting_for_a_slot_at_shutdown_is_told_the_server_is_going_away() -> None:
    async def scenario():
        loop = EngineLoop(FakeEngine(), max_waiting=0, queue_policy="wait", queue_timeout=30.0)
        loop.start()
        sink: asyncio.Queue[Emission] = asyncio.Queue()
        await loop.submit([GenerationInput([1], SamplingParams(max_tokens=10**6))] * 4, sink)
        waiter = asyncio.create_task(loop.submit([GenerationInput([2], SamplingParams(max_tokens=1))], sink))
        await asyncio.sleep(0.05)
        await loop.shutdown(grace_s=0.0)
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            await asyncio.wait_for(waiter, 5)

    run(scenario())


def test_shutdown_aborts_what_does_not_finish_in_the_grace_period() -> None:
    async def scenario():
        engine = FakeEngine()
        metrics = ServerMetrics()
        loop = EngineLoop(engine, metrics=metrics)
        loop.start()
        sink: asyncio.Queue[Emission] = asyncio.Queue()
        await loop.submit([GenerationInput([1], SamplingParams(max_tokens=10**6))], sink)
        await loop.shutdown(grace_s=0.05)
        emissions = await drain(sink, 1)
        with pytest.raises(EngineUnavailableError):
            await loop.submit([GenerationInput([1], SamplingParams(max_tokens=1))], sink)
        return engine, emissions, loop

    engine, emissions, loop = run(scenario())
    assert emissions[-1].error == "aborted"
    assert engine.closed and not loop.running and loop.in_flight == 0


def test_engine_failure_fails_requests_and_stops_serving() -> None:
    async def scenario():
        engine = FakeEngine(fail_at_step=3)
        loop = EngineLoop(engine)
        loop.start()
        sink: asyncio.Queue[Emission] = asyncio.Queue()
        await loop.submit([GenerationInput([1], SamplingParams(max_tokens=10))], sink)
        emissions = await drain(sink, 1)
        for _ in range(100):
            if not loop.running:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineUnavailableError, match="device lost"):
            await loop.submit([GenerationInput([1], SamplingParams(max_tokens=1))], sink)
        return emissions, loop

    emissions, loop = run(scenario())
    assert "device lost" in emissions[-1].error
    assert loop.failure and not loop.running


def test_load_test_smoke(server: RunningServer, tmp_path: Path) -> None:
    """bench/load_test.py against the test server: bounded (2 s, 4 clients), and no request may fail."""
    path = Path(__file__).resolve().parents[2] / "bench" / "load_test.py"
    spec = importlib.util.spec_from_file_location("load_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module
    spec.loader.exec_module(module)
    out = tmp_path / "load.json"
    code = module.main(["--url", server.base_url, "--clients", "4", "--duration", "2", "--max-tokens", "12",
                        "--json", str(out)])
    assert code == 0
    import json

    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["requests"] >= 4 and report["tokens_per_s"] > 0
    assert report["ttft_p50_ms"] is not None and report["latency_p99_ms"] >= report["latency_p50_ms"]
    with pytest.raises(SystemExit, match="loopback"):
        module.main(["--url", "http://example.com:8000", "--duration", "1"])


def test_after_an_engine_failure_requests_and_health_answer_503() -> None:
    import httpx

    from diffulex.server.app import create_app

    async def scenario():
        engine = FakeEngine(fail_at_step=2)
        loop = EngineLoop(engine)
        loop.start()
        app = create_app(loop, "fake", manage_engine_loop=False)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/health")).status_code == 200
            failed = await http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 5})
            after = await http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 5})
            health = await http.get("/health")
        return failed, after, health

    failed, after, health = run(scenario())
    assert failed.status_code == 503 and "device lost" in failed.json()["error"]["message"]
    assert after.status_code == 503
    assert health.status_code == 503 and health.json()["status"] == "failed"


class BlockCommittingEngine(FakeEngine):
    """Like `FakeEngine`, but a request's tokens are committed a block of four at a time."""

    def step(self) -> list[RequestUpdate]:
        updates = super().step()
        return [u if u.finished else RequestUpdate(u.req_id, u.record, False, u.answer_token_ids[: 4 * (
            len(u.answer_token_ids) // 4)], u.answer_token_ids) for u in updates]


@pytest.mark.parametrize("interest", ["steps", "commits", "end"])
def test_a_request_is_woken_only_when_what_it_reads_has_changed(interest: str) -> None:
    async def scenario():
        engine = BlockCommittingEngine()
        loop = EngineLoop(engine, max_waiting=4)
        loop.start()
        sink: asyncio.Queue[Emission] = asyncio.Queue()
        await loop.submit([GenerationInput([1], SamplingParams(max_tokens=10))], sink, interest=interest)
        emissions = await drain(sink, 1)
        await loop.shutdown(1.0)
        return emissions

    emissions = run(scenario())
    committed = [len(e.update.committed_token_ids) for e in emissions]
    expected = {"steps": [0, 0, 0, 4, 4, 4, 4, 8, 8, 10], "commits": [4, 8, 10], "end": [10]}[interest]
    assert committed == expected
    # however many emissions it got, each one counts the steps the request has taken part in
    assert [e.steps for e in emissions][-1] == 10
    assert [e.steps for e in emissions] == {"steps": list(range(1, 11)), "commits": [4, 8, 10], "end": [10]}[interest]


def test_an_unknown_interest_is_refused_naming_it() -> None:
    async def scenario():
        loop = EngineLoop(FakeEngine(), max_waiting=4)
        loop.start()
        try:
            with pytest.raises(ValueError, match="interest='all' is invalid: must be one of steps, commits, end"):
                await loop.submit([GenerationInput([1], SamplingParams(max_tokens=1))], asyncio.Queue(), interest="all")
        finally:
            await loop.shutdown(1.0)

    run(scenario())


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_waits_and_graces_that_are_not_a_finite_number_of_seconds_are_refused_naming_them(seconds: float) -> None:
    from diffulex.server.app import create_app

    with pytest.raises(ValueError, match=r"queue_timeout=.* is invalid: must be a finite number of seconds >= 0"):
        EngineLoop(FakeEngine(), queue_timeout=seconds)
    with pytest.raises(ValueError, match=r"shutdown_grace_s=.* is invalid: must be a finite number of seconds >= 0"):
        create_app(EngineLoop(FakeEngine()), shutdown_grace_s=seconds)
