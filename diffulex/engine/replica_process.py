"""One data-parallel replica's process: its engine, and the loop that takes adds and aborts between steps and sends
back what every step did.

The same loop runs in a local process (``distributed_executor_backend="mp"``, over a pipe) and in a Ray actor
(``"ray"``, over a socket): `diffulex.engine.data_parallel` talks to both through the same messages.
"""

from __future__ import annotations

import dataclasses
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from diffulex.config import Config
from diffulex.engine.engine_load import EngineLoad
from diffulex.engine.request_update import RequestUpdate
from diffulex.strategy.request import DecodeSettings


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


def _for_parent(update: RequestUpdate, req_id: int) -> RequestUpdate:
    """The update under the parent's request id, its answers copied out of the request's token list."""
    trajectory = update.trajectory
    if trajectory is not None:
        trajectory = dataclasses.replace(trajectory, req_id=req_id)
    return RequestUpdate(
        req_id, update.record, update.finished, list(update.committed_token_ids), list(update.answer_token_ids),
        trajectory,
    )  # fmt: skip


def serve_replica(model: str, kwargs: dict[str, Any], conn: Connection) -> None:
    """A replica's process: build the engine, then take adds and aborts between steps and step while busy.

    Messages from the parent: ``("add", id, token_ids, params)``, ``("abort", id)``, ``("close", None)``. To it:
    ``("ready", ReplicaInfo)`` or ``("error", traceback)`` once; then ``("updates", updates, load, stepped)`` after
    every step (and after commands taken while idle), ``("rejected", id, message)``, ``("dead", traceback)`` when
    the engine breaks, ``("closed", None)``.
    """
    from diffulex.engine.engine import DiffulexEngine

    try:
        engine = DiffulexEngine(Config.from_kwargs(model, **kwargs))
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
    try:
        while True:
            messages = [] if not engine.is_finished() else [conn.recv()]  # idle: wait for work
            while conn.poll():
                messages.append(conn.recv())
            for kind, *payload in messages:
                if kind == "close":
                    engine.exit()
                    conn.send(("closed", None))
                    return
                if kind == "add":
                    rid, ids, params = payload
                    try:
                        local = engine.add_request(ids, params)
                    except ValueError as err:
                        conn.send(("rejected", rid, str(err)))
                        continue
                    parent_id[local], engine_id[rid] = rid, local
                elif kind == "abort":
                    local = engine_id.pop(payload[0], None)
                    if local is not None:
                        parent_id.pop(local, None)
                        engine.abort_request(local)
            if engine.is_finished():
                conn.send(("updates", [], engine.load(), False))
                continue
            out = []
            for update in engine.step():
                rid = parent_id.get(update.req_id)
                if rid is None:
                    continue  # aborted by the parent
                out.append(_for_parent(update, rid))
                if update.finished:
                    del parent_id[update.req_id], engine_id[rid]
            conn.send(("updates", out, engine.load(), True))
    except (EOFError, BrokenPipeError, OSError):
        return  # the parent is gone
    except Exception:  # noqa: BLE001  (the engine broke: the parent fails this replica's requests)
        conn.send(("dead", traceback.format_exc()))
