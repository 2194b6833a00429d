"""A DiffusionGemma step's outcome on its way to the host: every canvas's argmax, settled flag and mean entropy
leave the device in one copy per kind after the step's last launch, and the host waits once, when the engine
applies the step (as the block strategies' `PendingWrites`). Until then a request holds nothing of the step:
its outcome (`CanvasRequest.proposed`) is resolved only here, for the requests the step was launched for and
that lost nothing since (a preemption drops it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diffulex.errors import RequestFailure
from diffulex.sampler.rows import PendingWrites
from diffulex.strategy.diffusion_gemma.canvas import CanvasSteps
from diffulex.strategy.diffusion_gemma.request import CanvasRequest


@dataclass
class PendingCanvases(PendingWrites):
    batch: list[CanvasRequest] = field(default_factory=list)
    steps: list[CanvasSteps] = field(default_factory=list)  # the groups of the step, in the batch's order
    preemptions: list[int] = field(default_factory=list)  # each request's count at launch
    outcome: torch.Tensor | None = None  # [B, C + 2] int64: argmax, settled, drawable (host memory once ready)
    entropies: torch.Tensor | None = None  # [B] float32 mean entropies (host memory once ready)

    @classmethod
    def launch(cls, batch: list[CanvasRequest], steps: list[CanvasSteps]) -> PendingCanvases:
        """Queue the copies of the step's outcome behind its launches."""
        outcome, entropies, ready = copy_outcome(steps)
        writes: dict[int, list[tuple[int, int]]] = {req.req_id: [] for req in batch}
        return cls(writes, ready=ready, batch=batch, steps=steps, preemptions=[r.num_preemptions for r in batch],
                   outcome=outcome, entropies=entropies)  # fmt: skip

    def result(self) -> dict[int, list[tuple[int, int]]]:
        """Wait for the device once, then give each request its outcome and the writes of its new argmax.

        A canvas whose distribution could not be drawn from (non-finite logits) fails its request alone: the
        others of the step are left as they were and compute the same step again."""
        if self.outcome is None:
            return self.writes
        if self.ready is not None:
            self.ready.synchronize()
        rows, entropies = self.outcome.tolist(), self.entropies.tolist()
        failed = [req.req_id for req, row in zip(self.batch, rows, strict=True) if not row[-1]]
        if failed:
            raise RequestFailure(failed, "denoising its canvas failed: its logits give no distribution to draw from")
        canvases = [(group, b) for group in self.steps for b in range(len(group.states))]
        for req, row, mean, (group, b), count in zip(self.batch, rows, entropies, canvases, self.preemptions,
                                                     strict=True):  # fmt: skip
            if req.num_preemptions != count or not req.running:  # the step was dropped for it
                continue
            req.proposed = group.resolve(b, bool(row[-2]), mean)
            self.writes[req.req_id] = list(enumerate(row[:-2], req.running[0].start))
        self.outcome = self.entropies = None  # a second call returns the same writes
        return self.writes


def copy_outcome(steps: list[CanvasSteps]) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
    """The step's ``[B, C + 2]`` (argmax, settled, drawable) and ``[B]`` mean entropies on their way to the host
    (non-blocking into pinned memory on a GPU), and the event to wait for (None: already there)."""
    argmax = torch.cat([s.argmax for s in steps])
    flags = torch.stack([torch.cat([s.settled for s in steps]), torch.cat([s.drawable for s in steps])], dim=1)
    outcome = torch.cat([argmax, flags.to(argmax.dtype)], dim=1)
    entropies = torch.cat([s.mean_entropy for s in steps])
    if outcome.device.type != "cuda":
        return outcome, entropies, None
    outcome, entropies = _to_host(outcome), _to_host(entropies)
    ready = torch.cuda.Event()
    ready.record()
    return outcome, entropies, ready


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
