"""Samplers whose acceptance runs on the host, one block at a time.

Some rules need more than a threshold per row: edit decoding compares proposals with the tokens already decoded,
DMax fills masks as a left-to-right run, a researcher's rule may rank a block's positions. `HostSampler` does the
shared part once for the whole step (proposals for every row on the device: the top-1, or a draw for requests at
``temperature > 0``; then one copy to the host) and asks `HostSampler.block_writes` what each block writes, on
plain lists. Such steps never sample inside a CUDA graph, unless the sampler also has a device version of its rule
(edit decoding: `diffulex.strategy.edit.sampler.EditSampler.greedy_result`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from diffulex.layers.dispatch import triton_available
from diffulex.sampler.rows import PendingWrites, RowLayout, draw
from diffulex.sampler.token_sampling import propose_greedy
from diffulex.strategy.request import Request, SampleTarget


class HostSamplerSettings(Protocol):
    vocab_limit: int  # ids at or above this are never proposed
    mask_token_id: int
    base_seed: int  # seed of requests that bring none


class _HostLayout(RowLayout):
    """A row layout that never takes the greedy graph path."""

    @property
    def greedy(self) -> bool:
        return False


class HostSampler:
    """Proposals for every row at once, then `block_writes` per block (override it)."""

    def __init__(self, settings: HostSamplerSettings) -> None:
        self.settings = settings

    def block_writes(
        self, req: Request, target: SampleTarget, tokens: list[int], conf: list[float], logits: torch.Tensor
    ) -> list[tuple[int, int]]:
        """The ``(position, token)`` pairs block ``target`` writes this step, from its rows' proposals ``tokens``
        and their probabilities ``conf`` (``logits``: its rows, for rules that read more than the top-1)."""
        raise NotImplementedError

    def prepare_logits(self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]) -> torch.Tensor:
        """The logits the proposals are taken from (a rule may first change them); these ones by default."""
        return logits

    def row_layout(self, work: list[tuple[Request, list[SampleTarget]]]) -> RowLayout:
        return _HostLayout.of(work, force_every_block=True)

    def warm_up(self, device: torch.device, dtype: torch.dtype, vocab_size: int, max_rows: int) -> None:
        """Compile the top-1 kernel for every row count up to `max_rows` (CUDA), so that no step pays a compile."""
        if not triton_available():
            return
        from diffulex.kernels.top1 import warm_up as warm_up_top1

        s = self.settings
        warm_up_top1(device, vocab_size, dtype, s.vocab_limit, s.mask_token_id, max_rows)

    def __call__(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]
    ) -> dict[int, list[tuple[int, int]]]:
        return self.launch(logits, work).result()

    def launch(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]], layout: RowLayout | None = None
    ) -> PendingWrites:
        """``logits`` has one row per target position, in the order of ``work``; the writes are computed at once
        (the caller waits for nothing more)."""
        logits = self.prepare_logits(logits, work)
        tokens, conf = self._propose(logits, work)
        writes: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for req, targets in work:
            req_writes = writes.setdefault(req.req_id, [])
            for target in targets:
                rows = slice(row, row + len(target.positions))
                req_writes.extend(self.block_writes(req, target, tokens[rows], conf[rows], logits[rows]))
                row = rows.stop
        return PendingWrites(writes)

    def _propose(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]
    ) -> tuple[list[int], list[float]]:
        """Every row's proposal and its probability: the top-1 (`propose_greedy`, the Triton kernel on CUDA), or
        a draw for requests at ``temperature > 0``; one copy to the host."""
        s = self.settings
        tokens, conf = propose_greedy(logits, s.vocab_limit, s.mask_token_id)
        row = 0
        for req, targets in work:
            n = sum(len(t.positions) for t in targets)
            if not req.sampling_params.greedy and n:
                rows = slice(row, row + n)
                tokens[rows], conf[rows] = draw(logits[rows], req, s.vocab_limit, s.mask_token_id, s.base_seed)
            row += n
        return tokens.tolist(), conf.tolist()
