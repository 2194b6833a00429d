"""What every sampler shares: a step's row layout, its writes on their way to the host, and drawing at a temperature.

A step's logits have one row per position to predict, request after request and block after block. `RowLayout`
says where each row goes (built in one pass over the step's work, sent to the device in one copy), `PendingWrites`
carries the accepted ``(position, token)`` pairs back, and `draw` samples one request's rows from its own seeded
generator. The strategies' samplers (`diffulex.strategy.multi_bd.sampler`, `diffulex.sampler.host`) build on them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import compress

import torch

from diffulex.errors import RequestFailure
from diffulex.sampler.token_sampling import ban_tokens, sample, step_generator
from diffulex.strategy.request import Request, SampleTarget


@dataclass
class SamplerSettings:
    vocab_limit: int  # ids at or above this are padding rows of the embedding, never proposed
    mask_token_id: int
    accept_threshold: float
    base_seed: int  # seed for requests that do not bring their own


def draw(
    logits: torch.Tensor, req: Request, vocab_limit: int, mask_token_id: int, base_seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's rows at ``temperature > 0``: a draw from the generator of its seed (``base_seed + req_id``
    when it brings none) and step, so that a request draws the same tokens whatever it is batched with."""
    sp = req.sampling_params
    seed = sp.seed if sp.seed is not None else base_seed + req.req_id
    g = step_generator(seed, req.nfe, logits.device)
    try:
        return sample(ban_tokens(logits, vocab_limit, mask_token_id), sp.temperature, sp.top_k, sp.top_p, g)
    except RuntimeError as err:  # e.g. a model that produced non-finite logits: this request cannot draw
        raise RequestFailure([req.req_id], f"sampling failed for request {req.req_id}: {err}") from err


@dataclass
class PendingWrites:
    """A step's accepted writes on their way to the host (`ConfidenceSampler.launch`)."""

    writes: dict[int, list[tuple[int, int]]]  # req_id -> [] for every request of the step, filled by `result`
    owners: list[int] | None = None  # row -> req_id
    positions: list[int] | None = None  # row -> position it predicts
    # [2, rows]: accepted flag, token (host memory once `ready`); a sampler may add rows of its own below them
    # (`new_result`'s ``fields``)
    accepted_tokens: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None  # recorded after the step's last device work; None: nothing to wait for

    def result(self) -> dict[int, list[tuple[int, int]]]:
        """Wait for the device and return the accepted ``(position, token)`` pairs per request id."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.accepted_tokens is None:
            return self.writes
        accepted, token_list = self.accepted_tokens[:2].tolist()
        self.read_rows(accepted, token_list)
        owners, positions, writes = self.owners, self.positions, self.writes
        for row in compress(range(len(positions)), accepted):
            writes[owners[row]].append((positions[row], token_list[row]))
        self.accepted_tokens = None  # a second call returns the same writes
        return writes

    def read_rows(self, accepted: list[int], tokens: list[int]) -> None:
        """What a sampler's host side reads of the result besides the writes, once it is in host lists (edit
        decoding: each block's verdict); nothing here."""


@dataclass
class RowLayout:
    """Where each logits row goes: host lists built in one pass over ``work``; the device half is sent in one copy
    (`to_device`), or staged with a replayed graph's inputs."""

    positions: list[int]  # row -> position it predicts
    owners: list[int]  # row -> req_id
    segments: list[int]  # row -> index of its block among all blocks of the step
    force: list[int]  # block -> 1 if it may force its best row
    starts: list[int]  # block -> its first row; one more entry, the number of rows
    sampled: list[tuple[Request, int, int]]  # requests with temperature > 0 and their row range [lo, hi)
    max_block_rows: int = 0
    req_ids: list[int] = field(default_factory=list)  # every request of the step, with or without rows

    @classmethod
    def of(cls, work: list[tuple[Request, list[SampleTarget]]], force_every_block: bool) -> RowLayout:
        layout = cls([], [], [], [], [], [])
        positions, owners, segments, force = layout.positions, layout.owners, layout.segments, layout.force
        starts = layout.starts
        for req, targets in work:
            lo = len(positions)
            for target in targets:
                n = len(target.positions)
                starts.append(len(positions))
                positions.extend(target.positions)
                segments.extend([len(force)] * n)
                force.append(1 if force_every_block or target.force_allowed else 0)
                layout.max_block_rows = max(layout.max_block_rows, n)
            hi = len(positions)
            owners.extend([req.req_id] * (hi - lo))
            if not req.sampling_params.greedy and hi > lo:
                layout.sampled.append((req, lo, hi))
        starts.append(len(positions))
        layout.req_ids = [req.req_id for req, _ in work]
        return layout

    @property
    def greedy(self) -> bool:
        """Whether every row takes its top-1 (no request draws at ``temperature > 0``)."""
        return not self.sampled

    def opened(self, req_ids: set[int], block_size: int) -> RowLayout:
        """The layout once the requests ``req_ids`` moved on to their next block (`diffulex.engine.continuation.
        BlockOpening`): their rows predict the positions one block further on."""
        owners = zip(self.positions, self.owners, strict=True)
        positions = [p + block_size if owner in req_ids else p for p, owner in owners]
        return dataclasses.replace(self, positions=positions)

    def continued(self) -> RowLayout:
        """The layout a continuation of this step's result is read with (`diffulex.engine.continuation`): the
        same rows (a sampler whose host side reads more of the step than its rows gives its own)."""
        return self

    def pending(
        self, accepted_tokens: torch.Tensor | None = None, ready: torch.cuda.Event | None = None
    ) -> PendingWrites:
        """The step's `PendingWrites` once its ``[2, rows]`` (accepted flag, token) result is on its way."""
        writes: dict[int, list[tuple[int, int]]] = {req_id: [] for req_id in self.req_ids}
        if accepted_tokens is None:
            return PendingWrites(writes, ready=ready)
        return PendingWrites(writes, self.owners, self.positions, accepted_tokens, ready)

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(segment [N], force [S], starts [S + 1])`` (int64) on ``device``, from one host buffer and one copy.

        Each section starts on a 16-byte boundary (an even number of int64s before it): Triton specializes a
        kernel on its pointers' alignment, so sections that moved with the row count's parity would compile the
        acceptance kernel anew in the middle of serving (measured: a 0.27 s step).
        """
        n, s = len(self.segments), len(self.force)
        n_pad, s_pad = n + n % 2, s + s % 2
        host = torch.tensor(
            self.segments + [0] * (n_pad - n) + self.force + [0] * (s_pad - s) + self.starts,
            dtype=torch.int64,
            pin_memory=device.type == "cuda",
        )
        packed = host.to(device, non_blocking=True)
        return packed[:n], packed[n_pad : n_pad + s], packed[n_pad + s_pad :]


def new_result(rows: int, device: torch.device, fields: int = 2) -> torch.Tensor:
    """The ``[fields, rows]`` int64 result (accepted flag, token, then what else a sampler's host side reads of
    the step, `Sampler.result_fields`) that the top-1 and the acceptance write into row by row: assembling it from
    separate tensors took a fill, two conversions and a stack, four launches of about a microsecond each on the
    critical path of every decode step (H100)."""
    return torch.empty((fields, rows), dtype=torch.int64, device=device)
