"""Data parallelism: ``data_parallel_size`` independent engine replicas, one per device, each in its own process.

A replica is an ordinary `DiffulexEngine` with ``data_parallel_size=1`` on its own GPU (``device_ids``, else
``device_start + rank``; on a machine without CUDA every replica runs on the CPU). `generate` deals the prompts out
round-robin, the replicas decode their shares at the same time, and the trajectories come back in prompt order.
Replicas share nothing, so no collective communication is needed; the processes are started with ``spawn`` (CUDA
cannot be forked). Offline ``generate`` only (the benchmark harness included, which reads ``config``, ``tokenizer``,
``device`` and ``dtype`` too): the HTTP server drives one engine step by step and refuses it.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from diffulex.config import Config
from diffulex.engine.generation_inputs import generation_inputs
from diffulex.outputs import GenerationOutputs, Trajectory
from diffulex.sampling_params import SamplingParams
from diffulex.tokenizer import load_tokenizer
from diffulex.validation import invalid_value


def replica_devices(config: Config) -> list[int | None]:
    """The CUDA device of each replica (None: the CPU), checked against the devices this machine has."""
    dp = config.data_parallel_size
    if not torch.cuda.is_available():
        return [None] * dp
    devices = list(config.device_ids) if config.device_ids else [config.device_start + r for r in range(dp)]
    if len(devices) < dp:
        raise invalid_value("device_ids", config.device_ids, f"must name one device per replica ({dp})")
    count = torch.cuda.device_count()
    if any(d >= count for d in devices[:dp]):
        raise invalid_value(
            "data_parallel_size", dp, f"needs devices {devices[:dp]}, but this machine has {count} CUDA device(s)"
        )
    return devices[:dp]


def _serve(model: str, kwargs: dict[str, Any], conn: Connection) -> None:
    """A replica's process: build the engine, then answer ``generate`` and ``close`` messages."""
    from diffulex.engine.engine import DiffulexEngine

    try:
        engine = DiffulexEngine(Config.from_kwargs(model, **kwargs))
    except Exception:  # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", (str(engine.device), str(engine.dtype).removeprefix("torch."))))
    while True:
        command, payload = conn.recv()
        if command == "close":
            engine.exit()
            conn.send(("closed", None))
            return
        try:
            prompts, params, prompt_options = payload
            conn.send(("ok", engine.generate(prompts, params, use_tqdm=False, **prompt_options)))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class DataParallelEngine:
    """``data_parallel_size`` replicas behind one ``generate``."""

    def __init__(self, model: str, kwargs: dict[str, Any], config: Config) -> None:
        self.config = config
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for device in replica_devices(config):
            replica = {**kwargs, "data_parallel_size": 1}
            if device is not None:
                replica["device_ids"] = [device]
            parent, child = context.Pipe()
            proc = context.Process(target=_serve, args=(model, replica, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            ready = [self._receive(rank, conn) for rank, conn in enumerate(self._conns)]
        except Exception:
            self.exit()
            raise
        self.devices = [torch.device(device) for device, _ in ready]
        self.device = self.devices[0]  # what reports name (the replicas' devices are `devices`)
        self.dtype = getattr(torch, ready[0][1])
        self.tokenizer = load_tokenizer(config.tokenizer_path or config.model)

    @staticmethod
    def _receive(rank: int, conn: Connection) -> Any:
        try:
            status, payload = conn.recv()
        except EOFError:
            raise RuntimeError(f"data-parallel replica {rank} exited without answering") from None
        if status == "error":
            raise RuntimeError(f"data-parallel replica {rank} failed:\n{payload}")
        return payload

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        apply_chat_template: bool = True,
        parse_special_tokens: bool = False,
    ) -> GenerationOutputs:
        """`DiffulexEngine.generate` over the replicas: prompt ``i`` goes to replica ``i % data_parallel_size``."""
        prompts, params = generation_inputs(prompts, sampling_params)
        prompt_options = {"apply_chat_template": apply_chat_template, "parse_special_tokens": parse_special_tokens}
        t0 = time.perf_counter()
        dp = len(self._conns)
        shares = [list(range(rank, len(prompts), dp)) for rank in range(dp)]
        for conn, share in zip(self._conns, shares, strict=True):
            conn.send(("generate", ([prompts[i] for i in share], [params[i] for i in share], prompt_options)))
        results: list[Trajectory | None] = [None] * len(prompts)
        steps = 0
        bar = None
        if use_tqdm and prompts:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc=f"Generating ({dp} replicas)", unit="req", dynamic_ncols=True)
        # every replica's answer is read before any error is raised, so that none is left in a pipe for the next call
        answers = []
        for rank, conn in enumerate(self._conns):
            try:
                answers.append(self._receive(rank, conn))
            except RuntimeError as err:
                answers.append(err)
            if bar is not None:
                bar.update(len(shares[rank]))
        failed = [a for a in answers if isinstance(a, RuntimeError)]
        if failed:
            if bar is not None:
                bar.close()
            raise failed[0]
        for out, share in zip(answers, shares, strict=True):
            steps += out.num_engine_steps
            for i, trajectory in zip(share, out.trajectories, strict=True):
                trajectory.index = i
                results[i] = trajectory
        if bar is not None:
            bar.close()
        return GenerationOutputs([t for t in results if t is not None], time.perf_counter() - t0, steps)

    def exit(self) -> None:
        """Close every replica. Safe to call twice."""
        for conn in self._conns:
            try:
                conn.send(("close", None))
                conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.exit()
