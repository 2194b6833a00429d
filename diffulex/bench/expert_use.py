"""Which experts each mixture-of-experts layer's router selected, forward by forward: the count the MoE floor is
taken on (`diffulex.bench.roofline.step_bytes`), in place of the uniform-routing estimate.

The floor of a step that reads only the experts its rows select depends on how many distinct experts that is, and
routing is far from uniform (random weights route a few experts to most rows; a trained router has its own skew),
so the estimate ``E x (1 - (1 - k / E) ** T)`` can overstate the bytes the step must read. The recorder measures
it instead: a forward pre-hook on every `SparseMoE` routes the layer's input again with the layer's own router
(the same function of the same input, so the same choice) and marks the experts of this rank it selected, in a
``[held experts]`` bool tensor left on the device; nothing is read back until `ExpertUseRecorder.counts`.

Hooks run only in eager forwards: a CUDA graph replays the kernels captured without them. Recording inside the
graphs would add a kernel per MoE layer to every timed step, so the count is taken instead on an untimed eager
re-run of the timed requests (`without_graphs`, used by `diffulex.bench.throughput.measure_decode`): the same
prompts, greedy, the same step structure. With the recorder closed no hook is registered: the layers run exactly
as without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class ExpertUseRecorder:
    """Per MoE layer, the experts each forward selected, recorded while the recorder is open (``with``)."""

    def __init__(self, model: nn.Module) -> None:
        from diffulex.layers.moe import SparseMoE

        self.layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self._selected: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self._rows: list[int] = []  # rows of each forward (read at the first MoE layer)
        self._handles: list[Any] = []

    def __enter__(self) -> ExpertUseRecorder:
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._hook(index)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int):
        def record(layer: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            _, experts = layer.gate.route(x)
            selected = torch.zeros(layer.num_experts, dtype=torch.bool, device=experts.device)
            selected[experts.reshape(-1)] = True
            owned = layer.experts.owned  # under expert parallelism a rank reads only the experts it holds
            self._selected[index].append(selected[owned.start : owned.stop])
            if index == 0:
                self._rows.append(int(x.shape[0]))

        return record

    @property
    def forwards(self) -> int:
        """Forwards recorded so far (every forward passes every MoE layer)."""
        return len(self._selected[0]) if self.layers else 0

    @property
    def rows(self) -> list[int]:
        """Rows of each recorded forward."""
        return list(self._rows)

    def counts(self) -> list[list[int]]:
        """``[forward][layer]``: distinct experts (of this rank) each layer's rows selected in each forward; one
        read from the device for all of them."""
        if not self.layers or not self.forwards:
            return []
        if len({len(selected) for selected in self._selected}) != 1:
            raise RuntimeError("the MoE layers recorded different numbers of forwards: a forward skipped a layer")
        per_layer = torch.stack([torch.stack(selected).sum(dim=-1) for selected in self._selected])
        return per_layer.T.tolist()


@contextlib.contextmanager
def without_graphs(runner: Any) -> Iterator[None]:
    """Run the engine's steps through the eager forward while open (the decode and prefill graphs put aside, then
    restored), so that forward hooks see every step. The last launch is forgotten first: a continuation replays
    graphs, and none may follow a step launched before."""
    names = [n for n in ("graphs", "short_graphs", "prefill_graphs") if getattr(runner, n, None) is not None]
    saved = {n: getattr(runner, n) for n in names}
    forget = getattr(runner, "forget_launches", None)
    if forget is not None:
        forget()
    for name in names:
        setattr(runner, name, None)
    try:
        yield
    finally:
        if forget is not None:
            forget()
        for name, value in saved.items():
            setattr(runner, name, value)
