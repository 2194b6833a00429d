"""One data-parallel replica's process: its engine, and the loop that takes adds and aborts between steps and sends
back what every step did.

The same loop runs in a local process (``distributed_executor_backend="mp"``, over a pipe) and in a Ray actor
(``"ray"``, over a socket): `diffulex.engine.data_parallel` talks to both through the same messages.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from diffulex.config import Config
from diffulex.engine.engine_load import EngineLoad
from diffulex.engine.request_update import Interest, RequestUpdate
from diffulex.engine.stop_signals import leave_stop_signals_to_the_parent
from diffulex.strategy.request import DecodeSettings, StepRecord


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica reports once its engine is built."""

    device: str
    dtype: str
    mask_token_id: int
    vocab_limit: int
    num_pages: int
    page_size: int
    settings: DecodeSettings  # the engine-wide decoding constants, the same on every replica
    load: EngineLoad


@dataclass(frozen=True, slots=True)
class StepTotals:
    """What one step did over its whole batch, for the server's metrics: a replica sends only the updates its
    parent reads, so these cannot be summed from them there."""

    step_time: float  # wall time of the step, seconds
    num_tokens: int  # mask positions filled
    batch_size: int  # requests that took part

    @classmethod
    def of(cls, updates: list[RequestUpdate]) -> StepTotals:
        records = [u.record for u in updates if u.record is not None]
        return cls(records[-1].step_time if records else 0.0, sum(r.num_new_tokens for r in records), len(records))


def _record_message(record: StepRecord | None) -> Any:
    """A step record as a plain tuple (cheaper to pickle than the dataclass); a record of another type as itself."""
    if type(record) is not StepRecord:
        return record
    return (record.step, record.query_len, record.num_new_tokens, record.running_block_ids,
            record.running_token_ids, record.step_time, record.running_start)


@dataclass(slots=True)
class _Reader:
    """What the parent has of one request, and what it reads of it."""

    interest: Interest = "steps"
    trajectory_steps: bool = True
    answer: int = 0  # answer tokens it has
    committed: int = 0  # committed tokens as of the last update sent
    nfe: int = 0  # the request's forwards so far, sent or not


class UpdateEncoder:
    """A replica's side of the per-step messages: a tuple per request whose reader has something new, carrying only
    what its answer grew by.

    Sending each running request's whole answer every step costs O(answer length) per request and step in
    copying and pickling (at 64 requests of a few hundred tokens, about as much host time as the step itself on a
    slow CPU). Decoded positions never change again (the engine's `RequestUpdate` relies on the same), so the
    parent's copy of an answer is grown by the new tokens alone; if an answer ever got shorter it is sent whole.
    And a request is sent only when what its reader reads changed (its `Interest`): a text stream's when its
    committed tokens grow (a block commits every few steps), a whole answer's at its end; so at 128 streams the
    parent unpickles and rebuilds about a quarter of the updates, and the step records only of live views.
    """

    def __init__(self) -> None:
        self._readers: dict[int, _Reader] = {}  # the parent's request id -> what it has and reads

    def add(self, rid: int, trajectory_steps: bool = True, interest: Interest = "steps") -> None:
        """Track a new request: its updates go when ``interest`` says; ``trajectory_steps=False``: its final
        trajectory goes without `Trajectory.steps`.

        A trajectory holds one `StepRecord` per forward: a few hundred per answer, most of what a finished request
        would send, and at a batch that finishes together megabytes in one message that the parent unpickles while
        this engine waits on the full pipe. A parent that reads none of them (the HTTP server) says so here."""
        self._readers[rid] = _Reader(interest, trajectory_steps)

    def encode(self, update: RequestUpdate, rid: int) -> tuple[Any, ...] | None:
        """None when the request's reader reads nothing new, else ``(rid, record, body, nfe)``: the record only for
        a reader of every step; the body the trajectory of a finished request, else ``(start, tokens, committed)``,
        the answer from ``start`` on and how many of its tokens are committed; ``nfe`` its forwards so far."""
        reader = self._readers.get(rid) or self._readers.setdefault(rid, _Reader())
        reader.nfe += update.record is not None
        if update.finished:
            del self._readers[rid]
            trajectory = update.trajectory
            if trajectory is not None:
                steps = trajectory.steps if reader.trajectory_steps else []
                trajectory = dataclasses.replace(trajectory, req_id=rid, steps=steps)
            return rid, _record_message(update.record), trajectory, reader.nfe
        if reader.interest != "steps":
            if reader.interest == "end" or update.num_committed == reader.committed:
                return None
        reader.committed = update.num_committed
        length = update.num_answer
        start = reader.answer if length >= reader.answer else 0
        reader.answer = length
        record = _record_message(update.record) if reader.interest == "steps" else None
        return rid, record, (start, update.answer_tokens_from(start), update.num_committed), reader.nfe

    def forget(self, rid: int) -> None:
        self._readers.pop(rid, None)


class UpdateDecoder:
    """The parent's side: rebuilds each request's `RequestUpdate` from `UpdateEncoder`'s messages."""

    def __init__(self) -> None:
        self._answers: dict[int, list[int]] = {}  # request id -> its answer so far (only appended to)

    def decode(self, message: tuple[Any, ...]) -> RequestUpdate:
        rid, record, body, nfe = message
        if isinstance(record, tuple):
            record = StepRecord(*record)
        if not isinstance(body, tuple):  # finished: its trajectory (None only from an engine that reports none)
            self._answers.pop(rid, None)
            answer = body.token_ids if body is not None else []
            update = RequestUpdate.of_answer(rid, record, answer, len(answer), len(answer), body)
            update.finished = True
        else:
            start, tokens, committed = body
            answer = self._answers.get(rid)
            if answer is None or start < len(answer):
                # a new list: updates already handed out read the old one up to their own ends
                answer = self._answers[rid] = ([] if answer is None else answer[:start])
            answer.extend(tokens)
            update = RequestUpdate.of_answer(rid, record, answer, committed, len(answer))
        update.nfe = nfe
        return update

    def forget(self, rid: int) -> None:
        self._answers.pop(rid, None)


# How long a closing replica waits for its last messages to be written.
SENDER_FLUSH_TIMEOUT_S = 30.0


class MessageSender:
    """A replica's messages to its parent, written to the pipe by a thread of their own.

    A pipe holds about 64 KiB. A parent that reads late (its own Python busy with 64-128 streams) would otherwise
    stop this engine in the middle of a step until it caught up. Here the engine only pickles a message (at once,
    so that later steps cannot change what it says) and queues the bytes; the thread writes them in order, the GIL
    released while it waits on the pipe.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._write, name="diffulex-replica-sender", daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        """Queue ``message``; raises BrokenPipeError once a write has failed (the parent is gone)."""
        if self._broken is not None:
            raise BrokenPipeError("the parent's end of the pipe is closed") from self._broken
        self._queue.put(ForkingPickler.dumps(message))

    def _write(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError as err:
                self._broken = err
                return

    def close(self) -> None:
        """Write what is queued, then end the thread (waiting at most `SENDER_FLUSH_TIMEOUT_S` for a parent that
        reads nothing more)."""
        self._queue.put(None)
        self._thread.join(SENDER_FLUSH_TIMEOUT_S)


def build_replica_engine(model: str, kwargs: dict[str, Any]) -> Any:
    """A replica's engine: an ordinary `DiffulexEngine` of the given engine fields."""
    from diffulex.engine.engine import DiffulexEngine

    return DiffulexEngine(Config.from_kwargs(model, **kwargs))


def serve_replica(
    model: str, kwargs: dict[str, Any], conn: Connection,
    build_engine: Callable[[str, dict[str, Any]], Any] = build_replica_engine,
) -> None:
    """A replica's process: build the engine, then take adds and aborts between steps and step while busy.

    ``build_engine`` (picklable: it crosses to the process) lets a harness run a modified engine behind the same
    protocol, e.g. one whose forward stands in for a GPU (``bench/server_step_rate.py``).

    Messages from the parent: ``("add", id, token_ids, params, trajectory_steps, interest)`` (see
    `UpdateEncoder.add`), ``("abort", id)``, ``("close", None)``. To it: ``("ready", ReplicaInfo)`` or ``("error",
    traceback)`` once; then ``("updates", messages, load, totals)`` (`UpdateEncoder` messages, the step's
    `StepTotals`) after every step (and after commands taken while idle, totals None), ``("rejected", id,
    message)``, ``("dead", traceback)`` when the engine breaks, ``("closed", None)``.
"""
    # the parent decides when this process ends (its "close", or the end of the pipe): `stop_signals`
    leave_stop_signals_to_the_parent()
    try:
        engine = build_engine(model, kwargs)
    except Exception:  # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(("error", traceback.format_exc()))
        return
    kv = engine.scheduler.kv_cache
    conn.send(("ready", ReplicaInfo(
        str(engine.device), str(engine.dtype).removeprefix("torch."), engine.mask_token_id, engine.vocab_limit,
        kv.num_pages, engine.config.page_size, engine.settings, engine.load(),
    )))  # fmt: skip
    parent_id: dict[int, int] = {}  # engine req_id -> the parent's id
    engine_id: dict[int, int] = {}
    encoder = UpdateEncoder()
    sender = MessageSender(conn)
    try:
        while True:
            messages = [] if not engine.is_finished() else [conn.recv()]  # idle: wait for work
            while conn.poll():
                messages.append(conn.recv())
            for kind, *payload in messages:
                if kind == "close":
                    engine.exit()
                    sender.send(("closed", None))
                    return
                if kind == "add":
                    rid, ids, params, trajectory_steps, interest = payload
                    try:
                        local = engine.add_request(ids, params)
                    except ValueError as err:
                        sender.send(("rejected", rid, str(err)))
                        continue
                    parent_id[local], engine_id[rid] = rid, local
                    encoder.add(rid, trajectory_steps, interest)
                elif kind == "abort":
                    local = engine_id.pop(payload[0], None)
                    if local is not None:
                        parent_id.pop(local, None)
                        encoder.forget(payload[0])
                        engine.abort_request(local)
            if engine.is_finished():
                sender.send(("updates", [], engine.load(), None))
                continue
            out = []
            updates = engine.step()
            for update in updates:
                rid = parent_id.get(update.req_id)
                if rid is None:
                    continue  # aborted by the parent
                if (message := encoder.encode(update, rid)) is not None:
                    out.append(message)
                if update.finished:
                    del parent_id[update.req_id], engine_id[rid]
            sender.send(("updates", out, engine.load(), StepTotals.of(updates)))
    except (EOFError, BrokenPipeError, OSError):
        return  # the parent is gone
    except Exception:  # noqa: BLE001  (the engine broke: the parent fails this replica's requests)
        sender.send(("dead", traceback.format_exc()))
    finally:
        sender.close()
