"""What an engine holds right now: the figures the server reports (/health, /metrics) and routes by."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineLoad:
    running: int  # requests in the running set
    waiting: int  # requests queued, not running yet
    kv_pages_used: int
    kv_pages_total: int
    alive: bool = True  # False once the engine stopped serving (exit, a dead device, a dead replica process)
    # one entry per data-parallel replica, in rank order (empty for a single engine)
    replicas: tuple[EngineLoad, ...] = ()
    steps: int = 0  # steps applied since the engine was built
    # of those, continued on the device (`diffulex.engine.continuation`): their host work overlapped the GPU's
    continued_steps: int = 0
    # the steps launched by the host although continuations were on, by reason (`ContinuationRefusal` values)
    refused_continuations: Mapping[str, int] = field(default_factory=dict)
    # continuations the host found it would not have launched: computed on the device, never applied
    dropped_continuations: int = 0
    # seconds the host waited for the device's step results; the rest of its time it worked (scheduling, collecting a
    # step's inputs, applying results) while the device ran or idled: against the wall time, how device-bound it is
    device_wait_s: float = 0.0

    @classmethod
    def total(cls, replicas: list[EngineLoad]) -> EngineLoad:
        """The sum over the replicas that are alive, with every replica's own figures kept."""
        alive = [r for r in replicas if r.alive]
        refused: Counter[str] = Counter()
        for replica in replicas:
            refused.update(replica.refused_continuations)
        return cls(
            sum(r.running for r in alive), sum(r.waiting for r in alive), sum(r.kv_pages_used for r in alive),
            sum(r.kv_pages_total for r in alive), bool(alive), tuple(replicas),
            sum(r.steps for r in replicas), sum(r.continued_steps for r in replicas), dict(refused),
            sum(r.dropped_continuations for r in replicas), sum(r.device_wait_s for r in replicas),
        )  # fmt: skip
