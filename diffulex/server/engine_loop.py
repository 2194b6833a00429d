"""One background thread that owns the engine and batches every in-flight request continuously.

The engine is not thread-safe, so exactly one thread touches it. HTTP handlers talk to that thread through a
command queue (add, abort, stop) and get results back through per-request asyncio queues ("sinks") that the
thread fills with one ``loop.call_soon_threadsafe`` per step. A request gets an emission only when something it
reads changed (its `Interest`): a text stream when its committed tokens grow, a non-streaming answer at the end,
only the denoising view every step. With a block committed every few steps this spares the event loop most of its
per-step wakeups at 64-128 streams, host time it would otherwise take from the engine. An engine in replica
processes (`DataParallelEngine`) is told each request's `Interest` and sends only those updates, each with its NFE
so far, and each step's totals apart for the metrics.

Between two steps the thread takes every queued command, so requests join and leave the batch at step
granularity; it blocks only while the engine has nothing to do. An add carries token ids, tokenized by the
handler: nothing whose cost grows with one client's input runs on this thread.

Admission control lives on the asyncio side: at most ``max_num_reqs + max_waiting`` requests are in flight; past
that a submission is refused (HTTP 429) or waits for a free slot, as configured; one larger than that bound can
never run and is refused as a bad request. This bounds memory no matter how many clients connect.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from diffulex.engine.data_parallel import DataParallelEngine
from diffulex.engine.request_update import INTERESTS, Interest, RequestUpdate
from diffulex.errors import EngineDeadError
from diffulex.sampling_params import SamplingParams
from diffulex.server.limits import SECONDS_RULE, is_seconds
from diffulex.server.metrics import ServerMetrics

logger = logging.getLogger("diffulex.server")

QueuePolicy = Literal["reject", "wait"]
# While idle the thread still reads the engine's load this often: an engine in another process (a replica)
# reports the pages an abort freed after the abort was sent, and /health should show it.
IDLE_LOAD_REFRESH_S = 0.2


class QueueFullError(Exception):
    """The server holds as many requests as it may; the client should retry later (HTTP 429)."""


class RequestTooLargeError(ValueError):
    """The request asks for more completions than the server can ever hold at once (HTTP 400: retrying is futile)."""


class EngineUnavailableError(Exception):
    """The engine is shutting down or has failed (HTTP 503)."""


@dataclass
class GenerationInput:
    """One completion to run: its prompt, tokenized by the handler (never on the engine thread), and its parameters."""

    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class Submitted:
    """A request accepted by the engine: its server id and its prompt as the engine saw it."""

    rid: str
    index: int
    prompt_token_ids: list[int]


@dataclass
class Emission:
    """One message from the engine thread to a request: a step update, or the end without a trajectory."""

    rid: str
    index: int  # the choice index within the HTTP request that submitted it
    update: RequestUpdate | None = None
    error: str | None = None  # "aborted" or an engine failure; set only on the last emission
    steps: int = 0  # engine steps the request has taken part in so far (its NFE), emitted or not

    @property
    def final(self) -> bool:
        return self.error is not None or (self.update is not None and self.update.finished)


@dataclass
class _Tracked:
    rid: str
    index: int
    sink: asyncio.Queue[Emission]
    prompt_len: int
    admitted_at: float
    interest: Interest = "steps"
    steps: int = 0
    committed: int = 0  # committed answer tokens as of its last emission


@dataclass
class _Add:
    inputs: list[GenerationInput]
    rids: list[str]
    indices: list[int]
    sink: asyncio.Queue[Emission]
    interest: Interest = "steps"
    future: concurrent.futures.Future[list[Submitted]] = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    rids: list[str]


@dataclass
class _Stop:
    pass


class EngineLoop:
    """Runs ``engine.step()`` on a dedicated thread while any request is in flight."""

    def __init__(
        self,
        engine: Any,
        *,
        max_waiting: int = 256,
        queue_policy: QueuePolicy = "reject",
        queue_timeout: float = 30.0,
        metrics: ServerMetrics | None = None,
    ) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting} is invalid: must be >= 0")
        if queue_policy not in ("reject", "wait"):
            raise ValueError(f"queue_policy={queue_policy!r} is invalid: must be 'reject' or 'wait'")
        if not is_seconds(queue_timeout):
            raise ValueError(f"queue_timeout={queue_timeout!r} is invalid: {SECONDS_RULE}")
        self.engine = engine
        # Replicas send a request's update only when what its handler reads changed (`DataParallelEngine.add_request`)
        # and each step's totals apart; an engine on this thread returns every update, totals summed from them.
        self._replicated = isinstance(engine, DataParallelEngine)
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.mask_token_id: int = engine.mask_token_id
        self.vocab_limit: int = engine.vocab_limit
        self.block_size: int = engine.settings.block_size  # the span of a request's blocks (what block ids count)
        self.max_model_len: int = engine.config.max_model_len
        self.capacity = engine.config.max_num_reqs + max_waiting
        self.queue_policy = queue_policy
        self.queue_timeout = queue_timeout
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.Queue[_Add | _Abort | _Stop] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Engine-thread state.
        self._tracked: dict[int, _Tracked] = {}  # engine req_id -> request
        self._engine_id: dict[str, int] = {}  # server rid -> engine req_id
        # Asyncio-side state.
        self._in_flight = 0
        self._slot_freed: asyncio.Event | None = None
        self._draining = False
        self.failure: str | None = None  # set when the engine raised; the loop stops serving
        self._rid_counter = itertools.count()
        # Taken around "is the thread still taking commands?" and the put of an add, so that no add is queued
        # after the thread's last look at the queue (it would wait forever).
        self._accepting_lock = threading.Lock()
        self._accepting = True

    # ----- lifetime ---------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; results are delivered on ``loop`` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._slot_freed = asyncio.Event()
        self._refresh_state()
        self._thread = threading.Thread(target=self._run, name="diffulex-engine-loop", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def draining(self) -> bool:
        """True once shutdown has begun or the engine has failed: new requests are refused."""
        return self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def num_tracked(self) -> int:
        """Requests the engine thread is tracking (exact only while it is idle; for tests and diagnostics)."""
        return len(self._tracked)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Refuse new requests, let in-flight ones finish for up to ``grace_s``, abort the rest, release the engine."""
        self._draining = True
        deadline = time.monotonic() + max(grace_s, 0.0)
        while self._in_flight > 0 and self.running and time.monotonic() < deadline:
            assert self._slot_freed is not None
            self._slot_freed.clear()
            try:
                await asyncio.wait_for(self._slot_freed.wait(), timeout=min(0.5, max(deadline - time.monotonic(), 0)))
            except TimeoutError:
                pass
        if self._in_flight:
            logger.warning("shutdown: aborting %d request(s) still in flight", self._in_flight)
        await asyncio.to_thread(self.stop)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight and end the thread (blocking; safe to call twice)."""
        self._draining = True
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("engine thread did not stop within %.0f s", timeout)

    # ----- called from the asyncio loop -------------------------------------------------------------------

    def new_rid(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}{next(self._rid_counter):x}"

    async def submit(
        self, inputs: Sequence[GenerationInput], sink: asyncio.Queue[Emission], rid_prefix: str = "req",
        interest: Interest = "steps",
    ) -> list[Submitted]:
        """Queue ``inputs`` as one unit (all accepted or none); their emissions go to ``sink`` when ``interest``
        says (every step, when committed tokens grow, or only the last).

        Raises QueueFullError (429), EngineUnavailableError (503), or ValueError for input the engine rejects
        or a request larger than the server's capacity (400). If the caller is cancelled while waiting, the
        requests are aborted as soon as they exist.
        """
        if interest not in INTERESTS:
            raise ValueError(f"interest={interest!r} is invalid: must be one of {', '.join(INTERESTS)}")
        if self._draining or not self.running:
            raise EngineUnavailableError(self.failure or "the server is shutting down")
        await self._reserve(len(inputs))
        rids = [self.new_rid(rid_prefix) for _ in inputs]
        command = _Add(list(inputs), rids, list(range(len(inputs))), sink, interest)
        with self._accepting_lock:
            accepting = self._accepting and not self._draining
            if accepting:
                self._commands.put(command)
        if not accepting:
            self._release(len(inputs))
            raise EngineUnavailableError(self.failure or "the server is shutting down")
        try:
            return await asyncio.wrap_future(command.future)
        except asyncio.CancelledError:
            # The client went away before the engine answered. Cancelling the future stops the add if the engine
            # thread has not taken it yet; otherwise abort the requests as soon as they exist.
            if command.future.cancelled():
                self._release(len(inputs))
            else:
                command.future.add_done_callback(lambda f: f.exception() is None and self.abort(rids))
            raise
        except BaseException:
            self._release(len(inputs))
            raise

    async def _reserve(self, count: int) -> None:
        if count > self.capacity:
            raise RequestTooLargeError(
                f"a request of {count} completions can never run here: the server holds at most {self.capacity} "
                "requests at once"
            )
        if self._in_flight + count <= self.capacity:
            self._in_flight += count
            return
        if self.queue_policy == "reject":
            raise QueueFullError(f"the server is at capacity ({self.capacity} requests in flight); retry later")
        deadline = time.monotonic() + self.queue_timeout
        assert self._slot_freed is not None
        while self._in_flight + count > self.capacity:
            remaining = deadline - time.monotonic()
            if self._draining:
                raise EngineUnavailableError(self.failure or "the server is shutting down")
            if remaining <= 0:
                raise QueueFullError(f"no capacity became free within {self.queue_timeout:g} s; retry later")
            self._slot_freed.clear()
            try:
                await asyncio.wait_for(self._slot_freed.wait(), timeout=remaining)
            except TimeoutError:
                pass
        self._in_flight += count

    def _release(self, count: int) -> None:
        self._in_flight -= count
        if self._slot_freed is not None:
            self._slot_freed.set()

    def abort(self, rids: Iterable[str]) -> None:
        """Abort requests (finished or unknown ones are ignored). Thread-safe and non-blocking."""
        rids = list(rids)
        if rids and self.running:
            self._commands.put(_Abort(rids))

    def _deliver(self, emissions: list[tuple[asyncio.Queue[Emission], Emission]]) -> None:
        """Runs on the asyncio loop: hand each emission to its sink and free the slots of finished requests."""
        finished = 0
        for sink, emission in emissions:
            sink.put_nowait(emission)
            finished += emission.final
        if finished:
            self._release(finished)

    # ----- the engine thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        stopping = False
        try:
            while not stopping:
                idle = engine.is_finished()
                for command in self._take_commands(block=idle):
                    if isinstance(command, _Stop):
                        stopping = True
                    elif isinstance(command, _Add):
                        self._add(command)
                    else:
                        self._abort(command.rids)
                if stopping or engine.is_finished():
                    self._refresh_state()
                else:
                    self._step()
                replicas = self.metrics.replicas
                if replicas and not any(r.alive for r in replicas):
                    # an engine in replica processes whose last one has died (their requests have been answered):
                    # fail now, not at the next request, so that the server exits and a supervisor restarts it
                    raise EngineDeadError("every engine replica process has died")
        except Exception as exc:  # the engine failed: fail every request, stop serving
            logger.exception("engine loop failed")
            self.failure = f"engine failure: {exc!r}"
            self._draining = True
        finally:
            self._end_all(self.failure or "aborted")
            try:
                engine.exit()
            except Exception:  # pragma: no cover  (nothing more to do at this point)
                logger.exception("engine.exit() failed")
            self._refresh_state()
            # No add is queued from now on; those already queued are answered here so no caller waits forever.
            with self._accepting_lock:
                self._accepting = False
            self._drain_after_stop()

    def _take_commands(self, block: bool) -> list[_Add | _Abort | _Stop]:
        commands: list[_Add | _Abort | _Stop] = []
        if block:
            try:
                commands.append(self._commands.get(timeout=IDLE_LOAD_REFRESH_S))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _drain_after_stop(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineUnavailableError(self.failure or "the server is shutting down"))

    def _add(self, command: _Add) -> None:
        engine = self.engine
        if not command.future.set_running_or_notify_cancel():
            return  # the submitter was cancelled before we got here
        added: list[tuple[int, Submitted]] = []
        try:
            for inp, rid, index in zip(command.inputs, command.rids, command.indices, strict=True):
                if self._replicated:
                    req_id = engine.add_request(inp.prompt_token_ids, inp.params, command.interest)
                else:
                    req_id = engine.add_request(inp.prompt_token_ids, inp.params)
                added.append((req_id, Submitted(rid, index, inp.prompt_token_ids)))
        except EngineDeadError as err:  # no replica left to run it: the engine has failed
            for req_id, _ in added:
                engine.abort_request(req_id)
            command.future.set_exception(EngineUnavailableError(str(err)))
            raise
        except Exception as err:
            for req_id, _ in added:
                engine.abort_request(req_id)
            command.future.set_exception(err if isinstance(err, ValueError) else ValueError(str(err)))
            return
        now = time.monotonic()
        for req_id, sub in added:
            self._tracked[req_id] = _Tracked(sub.rid, sub.index, command.sink, len(sub.prompt_token_ids), now,
                                             command.interest)
            self._engine_id[sub.rid] = req_id
            self.metrics.observe_admitted(len(sub.prompt_token_ids))
        command.future.set_result([sub for _, sub in added])

    def _abort(self, rids: list[str]) -> None:
        out = []
        for rid in rids:
            req_id = self._engine_id.pop(rid, None)
            if req_id is None:
                continue  # finished already, or never admitted
            self.engine.abort_request(req_id)
            tracked = self._tracked.pop(req_id)
            self.metrics.observe_finished("aborted", 0, time.monotonic() - tracked.admitted_at)
            out.append((tracked.sink, Emission(tracked.rid, tracked.index, error="aborted")))
        self._post(out)

    def _end_all(self, reason: str) -> None:
        """Abort every tracked request and tell its handler why (at shutdown or after an engine failure)."""
        out = []
        for req_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(req_id)
            except Exception:  # the engine may be broken; the emission below still ends the request
                logger.exception("abort of request %s failed", tracked.rid)
            out.append((tracked.sink, Emission(tracked.rid, tracked.index, error=reason)))
        self._tracked.clear()
        self._engine_id.clear()
        self._post(out)

    def _step(self) -> None:
        updates = self.engine.step()
        out = []
        tokens = 0
        step_time = 0.0
        now = time.monotonic()
        for update in updates:
            if update.record is not None:
                tokens += update.record.num_new_tokens
                step_time = update.record.step_time
            tracked = self._tracked.get(update.req_id)
            if tracked is None:
                continue
            tracked.steps = update.nfe if update.nfe is not None else tracked.steps + (update.record is not None)
            if not update.finished and tracked.interest != "steps":
                if tracked.interest == "end" or update.num_committed == tracked.committed:
                    continue  # nothing this request's handler reads has changed
                tracked.committed = update.num_committed
            out.append((tracked.sink, Emission(tracked.rid, tracked.index, update=update, steps=tracked.steps)))
            if update.finished:
                del self._tracked[update.req_id]
                self._engine_id.pop(tracked.rid, None)
                traj = update.trajectory
                self.metrics.observe_finished(
                    traj.completion_reason or "unknown", traj.num_generated_tokens, now - tracked.admitted_at
                )
        if self._replicated:
            for totals in self.engine.take_step_totals():
                self.metrics.observe_step(totals.step_time, totals.num_tokens, totals.batch_size)
        elif updates:
            self.metrics.observe_step(step_time, tokens, len(updates))
        self._refresh_state()
        self._post(out)

    def _post(self, emissions: list[tuple[asyncio.Queue[Emission], Emission]]) -> None:
        if not emissions or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, emissions)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _refresh_state(self) -> None:
        self.metrics.set_state(self.engine.load())

    def state(self) -> dict[str, Any]:
        """What /health reports (read from the metrics snapshot, never from the engine: wrong thread)."""
        m = self.metrics
        state: dict[str, Any] = {
            "running": m.running,
            "waiting": m.waiting,
            "in_flight": self._in_flight,
            "capacity": self.capacity,
            "kv_pages_used": m.kv_pages_used,
            "kv_pages_total": m.kv_pages_total,
        }
        if m.replicas:  # data-parallel replicas: each one's figures, and whether it is alive
            state["replicas"] = [
                {"replica": rank, "alive": r.alive, "running": r.running, "waiting": r.waiting,
                 "kv_pages_used": r.kv_pages_used, "kv_pages_total": r.kv_pages_total}
                for rank, r in enumerate(m.replicas)
            ]  # fmt: skip
        return state
