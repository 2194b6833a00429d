"""The confidence-threshold sampler used by SDAR and other non-shifted block-diffusion families."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress

import torch

from diffulex.engine.request import Request, SampleTarget
from diffulex.errors import RequestFailure
from diffulex.layers.dispatch import triton_available
from diffulex.registry import AutoSampler
from diffulex.sampler.acceptance import accept_segments
from diffulex.sampler.token_sampling import ban_tokens, propose_greedy, sample, step_generator


@dataclass
class SamplerSettings:
    vocab_limit: int  # ids at or above this are padding rows of the embedding, never proposed
    mask_token_id: int
    accept_threshold: float
    base_seed: int  # seed for requests that do not bring their own


@AutoSampler.register("sdar")
class ConfidenceSampler:
    """Logits at position p predict the token at p; accept confident positions, force one when allowed.

    One call handles the whole batch with a fixed number of transfers, whatever its size: a pass over ``work``
    that appends ints builds the row layout (position, request and block of every row, each block's force flag)
    and sends it to the device in one copy; tokens and confidences for all rows, then acceptance for all
    blocks (`accept_segments`: one Triton launch on CUDA), run there; one copy brings back the accepted mask with
    the tokens.
    Only rows of requests with ``temperature > 0`` are handled per request, each with its own seeded generator.
    """

    force_every_block = False  # families that commit at least one token per step in every block set this

    def __init__(self, settings: SamplerSettings) -> None:
        self.settings = settings

    def __call__(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]]
    ) -> dict[int, list[tuple[int, int]]]:
        """``logits`` has one row per target position, in the order of ``work``; returns writes per request.

        The logits belong to the sampler from here on: banned ids may be overwritten in place.
        """
        return self.launch(logits, work).result()

    def launch(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]], layout: RowLayout | None = None
    ) -> PendingWrites:
        """`__call__` without the wait: the device work is queued and its result copy started; the returned
        `PendingWrites` waits for it when asked, so the host may prepare other work meanwhile. ``layout`` is
        `row_layout` of ``work`` when the caller has already built it."""
        s = self.settings
        layout = layout if layout is not None else self.row_layout(work)
        if not layout.positions:
            return layout.pending()
        segment, force, starts = layout.to_device(logits.device)
        result = _new_result(logits.shape[0], logits.device)
        tokens, conf = propose_greedy(logits, s.vocab_limit, s.mask_token_id, tokens_out=result[1])
        for req, lo, hi in layout.sampled:
            tokens[lo:hi], conf[lo:hi] = draw(logits[lo:hi], req, s.vocab_limit, s.mask_token_id, s.base_seed)
        accept_segments(conf, segment, force, starts, s.accept_threshold, layout.max_block_rows, out=result[0])
        ready = None
        if result.is_cuda:
            host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            host.copy_(result, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            result = host
        return layout.pending(result, ready)

    def row_layout(self, work: list[tuple[Request, list[SampleTarget]]]) -> RowLayout:
        """Where each logits row of a step goes, and which requests draw instead of taking the top-1."""
        return RowLayout.of(work, self.force_every_block)

    def greedy_result(
        self,
        logits: torch.Tensor,
        source_rows: torch.Tensor,
        segment: torch.Tensor,
        force: torch.Tensor,
        starts: torch.Tensor,
        max_block_rows: int,
    ) -> torch.Tensor:
        """A step whose requests all decode greedily, on the device alone: ``[2, N]`` (accepted flag, token) for
        ``logits[source_rows]``, with `RowLayout`'s ``segment``, ``force`` and ``starts``.

        Every shape is fixed by its arguments' shapes and nothing is read back, so a CUDA graph can capture the
        call (`diffulex.engine.cuda_graph`): ``source_rows`` may end in negative padding rows, which no segment of
        ``starts`` covers; their entries are undefined. ``segment`` gives them a segment of their own that may not
        force, which keeps the PyTorch acceptance (which reads ``segment``) from mixing them into real blocks.
        """
        s = self.settings
        result = _new_result(source_rows.shape[0], logits.device)
        _, conf = propose_greedy(logits, s.vocab_limit, s.mask_token_id, source_rows, tokens_out=result[1])
        accept_segments(conf, segment, force, starts, s.accept_threshold, max_block_rows, out=result[0])
        return result

    def warm_up(self, device: torch.device, dtype: torch.dtype, vocab_size: int, max_rows: int) -> None:
        """Compile the top-1 and acceptance kernels for every row count up to `max_rows` (CUDA), so that no step
        pays a compile; `dtype` and `vocab_size` are those of the LM head's logits."""
        if not triton_available():  # the torch path compiles nothing
            return
        from diffulex.kernels.acceptance import warm_up as warm_up_acceptance
        from diffulex.kernels.top1 import warm_up as warm_up_top1

        s = self.settings
        warm_up_top1(device, vocab_size, dtype, s.vocab_limit, s.mask_token_id, max_rows)
        warm_up_acceptance(device, s.accept_threshold, max_rows)



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
    accepted_tokens: torch.Tensor | None = None  # [2, rows]: accepted flag, token (host memory once `ready`)
    ready: torch.cuda.Event | None = None  # recorded after the step's last device work; None: nothing to wait for

    def result(self) -> dict[int, list[tuple[int, int]]]:
        """Wait for the device and return the accepted ``(position, token)`` pairs per request id."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.accepted_tokens is None:
            return self.writes
        accepted, token_list = self.accepted_tokens.tolist()
        owners, positions, writes = self.owners, self.positions, self.writes
        for row in compress(range(len(positions)), accepted):
            writes[owners[row]].append((positions[row], token_list[row]))
        self.accepted_tokens = None  # a second call returns the same writes
        return writes


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


def _new_result(rows: int, device: torch.device) -> torch.Tensor:
    """The ``[2, rows]`` int64 result (accepted flag, token) that the top-1 and the acceptance write into row by
    row: assembling it from separate tensors took a fill, two conversions and a stack, four launches of about a
    microsecond each on the critical path of every decode step (H100)."""
    return torch.empty((2, rows), dtype=torch.int64, device=device)
