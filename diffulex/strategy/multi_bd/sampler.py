"""The confidence rule of multi-block decoding: accept the confident positions of each block, force the best one
where the block may force.

A block takes every position whose confidence exceeds ``accept_threshold``; if none does and the block may force
(no previous block, or its previous block is semi-complete: `SampleTarget.force_allowed`), it takes its most
confident position, which guarantees progress. A family whose authors' decoder commits a token in every block each
step (`Family.force_every_block`, Stable-DiffCoder) forces in every block. For the Dream-style families whose
decoders phrase the rule as "if there is no previous block or it is semi-complete: the confident ones, else the
best one; otherwise the confident ones", that is the same rule; their logit shift is the runner's business (it
hands the sampler the row that predicts each position).
"""

from __future__ import annotations

import torch

from diffulex.layers.dispatch import triton_available
from diffulex.sampler.acceptance import accept_segments
from diffulex.sampler.rows import PendingWrites, RowLayout, SamplerSettings, draw, new_result
from diffulex.sampler.token_sampling import propose_greedy
from diffulex.strategy.request import Request, SampleTarget


class ConfidenceSampler:
    """Logits at position p predict the token at p; accept confident positions, force one when allowed.

    One call handles the whole batch with a fixed number of transfers, whatever its size: a pass over ``work``
    that appends ints builds the row layout (position, request and block of every row, each block's force flag)
    and sends it to the device in one copy; tokens and confidences for all rows, then acceptance for all
    blocks (`accept_segments`: one Triton launch on CUDA), run there; one copy brings back the accepted mask with
    the tokens.
    Only rows of requests with ``temperature > 0`` are handled per request, each with its own seeded generator.
    """

    def __init__(self, settings: SamplerSettings, force_every_block: bool = False) -> None:
        self.settings = settings
        self.force_every_block = force_every_block

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
        result = new_result(logits.shape[0], logits.device)
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
        result = new_result(source_rows.shape[0], logits.device)
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
