"""Where the served engine runs: in a process of its own, or on a thread of the server process.

Python lets one thread at a time run Python code. On a thread of the server process the engine's host work
(scheduling, inputs, the sampler's results) waits for the GIL behind everything the server does for 64-128 open
streams, and each of a step's many GIL-free waits on the GPU ends with another wait for the GIL: the engine steps
slower under load than alone. In a process of its own it shares nothing with the server. That process is the
data-parallel replica (`diffulex.engine.data_parallel`) with one replica: the server adds and aborts requests over
a pipe and reads each step's updates from it, carrying only what each answer grew by (`UpdateEncoder`).

``auto`` (the default) takes the process where it can: one replica of one rank on the ``mp`` backend. An engine of
several tensor- or expert-parallel ranks stays on a thread (a replica process is daemonic and cannot start its
own rank workers; its workers are processes already); data parallelism runs replica processes anyway.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

logger = logging.getLogger("diffulex.server")

EnginePlacement = Literal["auto", "process", "thread"]
ENGINE_PLACEMENTS = ("auto", "process", "thread")


def engine_process_allowed(config: Any) -> str | None:
    """Why the engine of ``config`` cannot run as one replica process, or None when it can."""
    from diffulex.engine.tensor_parallel import engine_world_size  # (torch: imported once an engine is built)

    if config.data_parallel_size > 1:
        return "data parallelism runs its replicas as processes already"
    if engine_world_size(config) > 1:
        return "an engine of several ranks starts its rank workers from the server process"
    if config.distributed_executor_backend != "mp":
        return f"distributed_executor_backend={config.distributed_executor_backend!r} places its own processes"
    return None


def build_served_engine(model: str, fields: dict[str, Any], placement: EnginePlacement = "auto") -> Any:
    """The engine the server drives: a one-replica `DataParallelEngine` (its own process) or the engine itself."""
    if placement not in ENGINE_PLACEMENTS:
        raise ValueError(f"engine_placement={placement!r} is invalid: must be one of {', '.join(ENGINE_PLACEMENTS)}")
    from diffulex import Diffulex
    from diffulex.config import Config
    from diffulex.engine.data_parallel import DataParallelEngine

    config = Config.from_kwargs(model, **fields)
    if config.data_parallel_size > 1:  # the server reads no step records of a finished request's trajectory
        return DataParallelEngine(model, fields, config, trajectory_steps=False)
    if placement == "thread":
        return Diffulex(model, **fields)
    reason = engine_process_allowed(config)
    if reason is not None:
        if placement == "process":
            raise ValueError(f"engine_placement='process' is invalid here: {reason}; use 'auto' or 'thread'")
        logger.info("engine on a thread of the server process: %s", reason)
        return Diffulex(model, **fields)
    logger.info("engine in a process of its own")
    return DataParallelEngine(model, fields, config, trajectory_steps=False)
