"""Data parallelism: ``data_parallel_size`` independent engine replicas, one per device, each in its own process.

Where the processes run is ``distributed_executor_backend``: ``"mp"`` (the default) starts them on this host;
``"ray"`` starts them as Ray actors in one placement group of a Ray cluster (`diffulex.engine.ray_placement`), so
that they span hosts. Both speak the same protocol over a ``multiprocessing`` connection (a pipe, or a socket to
the actor), so everything below holds for both.

A replica is an ordinary `DiffulexEngine` with ``data_parallel_size=1`` on its own GPU (``device_ids``, else
``device_start + rank``; on a machine without CUDA every replica runs on the CPU) that steps on its own while it
has requests and sends back what each step did. `DataParallelEngine` has the engine's step interface: `add_request`
checks and encodes the prompt here (a bad one is refused before any replica sees it) and hands it to the replica
with the fewest requests, `step` returns the updates the replicas have sent since the last call, `abort_request`,
`is_finished` and `load` (every replica's figures). So the HTTP server's engine loop drives N replicas the way it
drives one, and `generate` is the engine's own offline loop (`diffulex.engine.offline`).

A replica that dies (its process killed, its engine broken) fails the requests it held: they finish with completion
reason ``"error"`` and a message naming the replica; the others keep serving and take the new requests. Only when
every replica is gone does `step` raise `EngineDeadError`. Replicas share nothing, so no collective communication
is needed; the processes are started with ``spawn`` (CUDA cannot be forked).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import itertools
import multiprocessing as mp
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from diffulex.config import Config
from diffulex.engine.engine_load import EngineLoad
from diffulex.engine.generation_inputs import check_prompt
from diffulex.engine.offline import generate_offline
from diffulex.engine.replica_process import (
    ReplicaInfo,
    StepTotals,
    UpdateDecoder,
    build_replica_engine,
    serve_replica,
)
from diffulex.engine.request_update import INTERESTS, Interest, RequestUpdate
from diffulex.errors import EngineClosedError, EngineDeadError
from diffulex.outputs import GenerationOutputs, Trajectory
from diffulex.prompts import Prompt, encode_prompt
from diffulex.sampling_params import SamplingParams
from diffulex.strategy.request import CompletionReason
from diffulex.tokenizer import load_tokenizer
from diffulex.validation import check_int, invalid_value


def _exit_if_alive(engine: weakref.ref[DataParallelEngine]) -> None:
    alive = engine()
    if alive is not None:
        alive.exit()


def replica_master_port(config: Config, rank: int) -> int:
    """The port replica `rank`'s tensor-parallel ranks meet at: ``master_port + rank``, so that replicas on one host
    do not meet at the same port."""
    port = config.master_port + rank
    if port > 65535:
        raise invalid_value("master_port", config.master_port,
                            f"must leave room for one port per replica (master_port + {config.data_parallel_size - 1} "
                            "<= 65535)")
    return port


def replica_devices(config: Config) -> list[int | None]:
    """The CUDA device of each replica (None: the CPU), checked against the devices this machine has."""
    dp = config.data_parallel_size
    if not torch.cuda.is_available():
        return [None] * dp
    devices = list(config.device_ids) or list(range(config.device_start, config.device_start + dp))
    if len(devices) < dp:
        raise invalid_value("device_ids", config.device_ids, f"must name one device per replica ({dp})")
    count = torch.cuda.device_count()
    if any(d >= count for d in devices[:dp]):
        raise invalid_value(
            "data_parallel_size", dp, f"needs devices {devices[:dp]}, but this machine has {count} CUDA device(s)"
        )
    return devices[:dp]


# Step totals kept for `take_step_totals` (an offline caller takes none).
MAX_KEPT_STEP_TOTALS = 4096
# How long a replica may take to exit once closed before it is killed.
REPLICA_EXIT_TIMEOUT_S = 30


@dataclass
class _Replica:
    rank: int
    conn: Connection
    process: Any
    info: ReplicaInfo | None = None
    load: EngineLoad = field(default_factory=lambda: EngineLoad(0, 0, 0, 0))
    alive: bool = True
    held: set[int] = field(default_factory=set)  # ids of the requests it runs


def _check_replicas_can_start(config: Config) -> None:
    """Refuse, before any process starts, replicas of several ranks on the ``mp`` backend: a local replica is a
    daemonic process, which may not start the worker processes of its tensor- or expert-parallel ranks."""
    from diffulex.engine.tensor_parallel import engine_world_size
    from diffulex.engine.tensor_parallel_check import parallel_fields

    if config.distributed_executor_backend != "mp" or engine_world_size(config) == 1:
        return
    raise ValueError(
        f"{parallel_fields(config)} is invalid with data_parallel_size={config.data_parallel_size} and "
        "distributed_executor_backend='mp': a local data-parallel replica may not start the workers of its ranks; "
        "use distributed_executor_backend='ray', whose replicas start their tensor-parallel workers"
    )


class DataParallelEngine:
    """``data_parallel_size`` replicas behind the engine's step interface and one ``generate``."""

    def __init__(
        self, model: str, kwargs: dict[str, Any], config: Config,
        build_engine: Callable[[str, dict[str, Any]], Any] = build_replica_engine, trajectory_steps: bool = True,
    ) -> None:
        """``trajectory_steps=False``: finished trajectories come back without their step records
        (`Trajectory.steps` empty), for a caller that reads none of them, such as the HTTP server; see
        `UpdateEncoder.add` for what they cost."""
        _check_replicas_can_start(config)
        self.config = config
        self.trajectory_steps = trajectory_steps
        self._build_engine = build_engine  # what each local replica process runs (`serve_replica`)
        self._replicas: list[_Replica] = []
        self._placement = None
        # The interpreter's own exit terminates daemonic children and then waits for them; a replica ignores SIGTERM
        # (`diffulex.engine.stop_signals`), so a script that never called `exit()` is closed here first.
        self._exit_at_interpreter_exit = functools.partial(_exit_if_alive, weakref.ref(self))
        atexit.register(self._exit_at_interpreter_exit)
        # A replica is one engine with its own devices; it runs its tensor-parallel ranks (if any) on its host.
        replica_kwargs = {**kwargs, "data_parallel_size": 1, "distributed_executor_backend": "mp"}
        try:
            if config.distributed_executor_backend == "ray":
                self._start_on_ray(model, replica_kwargs)
            else:
                self._start_local(model, replica_kwargs)
            for replica in self._replicas:
                replica.info = self._ready(replica)
                replica.load = replica.info.load
        except Exception:
            self.exit()
            raise
        first = self._replicas[0].info
        assert first is not None
        self.devices = [torch.device(r.info.device) for r in self._replicas if r.info is not None]
        self.device = self.devices[0]  # what reports name (the replicas' devices are `devices`)
        self.dtype = getattr(torch, first.dtype)
        self.mask_token_id, self.vocab_limit, self.settings = first.mask_token_id, first.vocab_limit, first.settings
        self.tokenizer = load_tokenizer(config.tokenizer_path or config.model)
        self._ids = itertools.count()
        self._owner: dict[int, _Replica] = {}  # request id -> the replica running it
        self._prompts: dict[int, list[int]] = {}
        self._early: list[RequestUpdate] = []  # updates known before the next step (replica deaths)
        self._decoder = UpdateDecoder()
        # of the replicas' steps since the last `take_step_totals` (the newest ones, for a caller that never takes them)
        self._step_totals: deque[StepTotals] = deque(maxlen=MAX_KEPT_STEP_TOTALS)
        self._num_steps = 0
        self._closed = False
        self._generate_lock = threading.Lock()
        # What this process holds by now (torch, the tokenizer, ...) lives as long as the replicas: out of the
        # collector's reach, as `DiffulexEngine` puts its build, or every full collection rescans it. In the HTTP
        # server's process those were pauses of up to 180 ms at 128 streams (about 1 ms per engine step), during
        # which no stream got a chunk and no step's updates were read.
        gc.collect()
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # once per process, however many engines
        atexit.register(gc.unfreeze)  # let interpreter shutdown free them

    def _own_kwargs(self, kwargs: dict[str, Any], rank: int) -> dict[str, Any]:
        """Replica ``rank``'s engine fields: the shared ones, with a profiler ``run_id`` of its own (the replicas
        would otherwise write their traces over each other's)."""
        own = dict(kwargs)
        profiler = self.config.profiler_config
        if profiler.enabled and profiler.run_id is not None:
            own["profiler_config"] = dataclasses.replace(profiler, run_id=f"{profiler.run_id}-replica{rank}")
        return own

    def _start_local(self, model: str, kwargs: dict[str, Any]) -> None:
        context = mp.get_context("spawn")
        for rank, device in enumerate(replica_devices(self.config)):
            replica = self._own_kwargs(kwargs, rank)
            if device is not None:
                replica["device_ids"] = [device]
            parent, child = context.Pipe()
            process = context.Process(target=serve_replica, args=(model, replica, child, self._build_engine),
                                      daemon=True)
            process.start()
            child.close()  # the replica holds its end; ours closed, its exit reads as EOF here
            self._replicas.append(_Replica(rank, parent, process))

    def _start_on_ray(self, model: str, kwargs: dict[str, Any]) -> None:
        from diffulex.engine.ray_placement import RayPlacement

        self._placement = placement = RayPlacement(self.config)
        for rank, bundle in enumerate(placement.bundles):
            # Ray makes the bundle's GPUs this actor's only visible devices, numbered from 0.
            replica = self._own_kwargs(kwargs, rank)
            if "GPU" in bundle:
                replica["device_ids"] = list(range(int(bundle["GPU"])))
            # a replica of several ranks: they meet on its host, maybe beside another replica's
            if max(self.config.tensor_parallel_size, self.config.expert_parallel_size) > 1:
                replica["master_port"] = replica_master_port(self.config, rank)
            conn, process = placement.start(rank, model, replica)
            self._replicas.append(_Replica(rank, conn, process))

    @staticmethod
    def _ready(replica: _Replica) -> ReplicaInfo:
        try:
            status, payload = replica.conn.recv()
        except EOFError:
            raise RuntimeError(f"data-parallel replica {replica.rank} exited without answering") from None
        if status == "error":
            raise RuntimeError(f"data-parallel replica {replica.rank} failed:\n{payload}")
        return payload

    # ----- the engine's step interface ------------------------------------------------------------------------

    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, interest: Interest = "steps",
    ) -> int:
        """Check and encode the prompt, then queue it on the replica holding the fewest requests; returns its id.
        Raises ValueError for bad input (no replica sees it) and EngineDeadError when no replica is left.

        ``interest`` is what the caller reads of this request's updates: `step` then returns them only when that
        changed (every step; when its committed tokens grow, without step records; only the last), each with its
        NFE so far (`RequestUpdate.nfe`), and `take_step_totals` what every step did."""
        self._check_open()
        if interest not in INTERESTS:
            raise ValueError(f"interest={interest!r} is invalid: must be one of {', '.join(INTERESTS)}")
        check_prompt(prompt)
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params={sp!r} is invalid: must be a SamplingParams")
        max_len = self.config.max_model_len
        ids = encode_prompt(
            self.tokenizer, prompt, mask_token_id=self.mask_token_id, vocab_size=self.vocab_limit, max_model_len=max_len
        )
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens is invalid: must be shorter than max_model_len={max_len} so that at "
                "least one token can be generated"
            )
        alive = [r for r in self._replicas if r.alive]
        if not alive:
            raise EngineDeadError("every data-parallel replica has died")
        replica = min(alive, key=lambda r: (len(r.held), r.rank))
        info = replica.info
        assert info is not None
        needed = -(-min(len(ids) + sp.max_tokens, max_len) // info.page_size)
        if needed > info.num_pages:
            raise ValueError(
                f"request needs up to {needed} KV pages but a replica's pool has {info.num_pages}; raise num_pages "
                "or lower max_tokens"
            )
        req_id = next(self._ids)
        try:
            replica.conn.send(("add", req_id, ids, sp, self.trajectory_steps, interest))
        except (BrokenPipeError, OSError):
            self._lose(replica, "its process is gone")
            return self.add_request(ids, sp, interest)
        replica.held.add(req_id)
        self._owner[req_id] = replica
        self._prompts[req_id] = ids
        return req_id

    def abort_request(self, req_id: int) -> bool:
        """Stop a request now; False if it is unknown or finished."""
        check_int("req_id", req_id)
        replica = self._owner.pop(req_id, None)
        if replica is None:
            return False
        replica.held.discard(req_id)
        self._prompts.pop(req_id, None)
        self._decoder.forget(req_id)
        try:
            replica.conn.send(("abort", req_id))
        except (BrokenPipeError, OSError):
            pass
        return True

    def is_finished(self) -> bool:
        return not self._owner and not self._early

    def step(self) -> list[RequestUpdate]:
        """The updates the replicas have sent since the last call, waiting for the first one if there is none."""
        self._check_open()
        out, self._early = self._early, []
        busy = [r for r in self._replicas if r.alive and r.held]
        if out or not busy:
            return out
        ready = wait([r.conn for r in busy])
        for replica in busy:
            if replica.conn not in ready:
                continue
            while replica.alive and replica.conn.poll():
                out.extend(self._receive(replica))
        if not any(r.alive for r in self._replicas):
            out.extend(self._early)
            self._early = []
            if self._owner:
                raise EngineDeadError("every data-parallel replica has died")
        out.extend(self._early)
        self._early = []
        return out

    def _receive(self, replica: _Replica) -> list[RequestUpdate]:
        try:
            kind, *payload = replica.conn.recv()
        except (EOFError, OSError):
            self._lose(replica, "its process exited")
            return []
        if kind == "updates":
            updates, replica.load, totals = payload
            if totals is not None:
                self._num_steps += 1
                self._step_totals.append(totals)
            out = []
            for message in updates:
                if self._owner.get(message[0]) is not replica:
                    continue  # aborted here meanwhile
                update = self._decoder.decode(message)
                out.append(update)
                if update.finished:
                    self._finish(update.req_id)
            return out
        if kind == "rejected":
            req_id, message = payload
            return [self._failed(req_id, f"rejected by data-parallel replica {replica.rank}: {message}")]
        if kind == "dead":
            self._lose(replica, f"its engine failed:\n{payload[0]}")
        return []

    def _finish(self, req_id: int) -> None:
        replica = self._owner.pop(req_id, None)
        if replica is not None:
            replica.held.discard(req_id)
        self._prompts.pop(req_id, None)
        self._decoder.forget(req_id)

    def _failed(self, req_id: int, message: str) -> RequestUpdate:
        """The final update of a request that ends with an error instead of an answer."""
        prompt = self._prompts.get(req_id, [])
        self._finish(req_id)
        trajectory = Trajectory(0, req_id, prompt, [], "", CompletionReason.ERROR.value, 0, error=message)
        return RequestUpdate(req_id, None, True, [], [], trajectory)

    def _lose(self, replica: _Replica, why: str) -> None:
        """A replica is gone: its requests end with an error (reported at the next `step`), it takes no more."""
        if not replica.alive:
            return
        replica.alive = False
        # its last report would stay on /health and /metrics for good: a dead replica runs and holds nothing
        replica.load = dataclasses.replace(replica.load, running=0, waiting=0, kv_pages_used=0, alive=False)
        message = f"data-parallel replica {replica.rank} died ({why})"
        self._early.extend(self._failed(req_id, message) for req_id in sorted(replica.held))
        replica.held.clear()

    def take_step_totals(self) -> list[StepTotals]:
        """What each replica step read since the last call did over its whole batch (for metrics: `step` returns
        only the updates their callers read)."""
        totals = list(self._step_totals)
        self._step_totals.clear()
        return totals

    @property
    def replica_pids(self) -> list[int]:
        """The process id of each replica, in rank order (for operators and fault-injection tests)."""
        return [r.process.pid for r in self._replicas]

    @property
    def num_steps(self) -> int:
        """Steps run so far, summed over the replicas."""
        return self._num_steps

    def load(self) -> EngineLoad:
        """Every replica's last reported figures (a dead one marked), and their sum over the living ones.

        Reads what the replicas have sent meanwhile first (updates are kept for the next `step`), so that an idle
        caller sees the pages an abort freed."""
        for replica in self._replicas:
            while replica.alive and replica.conn.poll():
                self._early.extend(self._receive(replica))
        return EngineLoad.total([dataclasses.replace(r.load, alive=r.alive) for r in self._replicas])

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        apply_chat_template: bool = True,
        parse_special_tokens: bool = False,
    ) -> GenerationOutputs:
        """`DiffulexEngine.generate` over the replicas: each prompt runs on the replica with the fewest requests
        when it is queued; the trajectories come back in prompt order."""
        self._check_open()
        with self._generate_lock:  # one call at a time: each steps the engine for its own prompts
            return generate_offline(
                self, prompts, sampling_params, use_tqdm, apply_chat_template=apply_chat_template,
                parse_special_tokens=parse_special_tokens,
            )  # fmt: skip

    # ----- lifetime --------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine has been shut down (exit() was called)")

    def exit(self) -> None:
        """Close every replica. Safe to call twice."""
        for replica in self._replicas:
            try:
                replica.conn.send(("close", None))
                while replica.conn.recv()[0] != "closed":
                    pass
            except (BrokenPipeError, EOFError, OSError):
                pass
        for replica in self._replicas:
            replica.process.join(timeout=REPLICA_EXIT_TIMEOUT_S)
            if replica.process.is_alive():
                replica.process.kill()
        if self._placement is not None:
            self._placement.close()
            self._placement = None
        self._replicas, self._owner, self._prompts = [], {}, {}
        self._closed = True
        atexit.unregister(self._exit_at_interpreter_exit)

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.exit()
