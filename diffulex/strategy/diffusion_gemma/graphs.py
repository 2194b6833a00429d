"""CUDA graphs for DiffusionGemma's denoising steps: the decoder forward over a fixed bucket of canvases.

A step's decoder pass has the same shapes whatever the canvases (``bucket x canvas_length`` rows); what changes
is held in static buffers the graph reads: the canvas tokens, the self-conditioning inputs (zeros for a canvas's
first step: the self-conditioning MLP of zeros adds exactly zero), and the layout of contexts (lengths, page
tables, positions: `paged.CanvasLayout`). Canvases beyond the batch are padding with no context; their rows are
computed and never read. The LM head and the canvas rule run after the replay, per request, as in an eager step.

The same static path runs without capture (``capture=False``): on the CPU it is the eager forward over the
bucket's buffers, which is how the tests show that a graph's tokens are an eager step's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from diffulex.strategy.diffusion_gemma.paged import CanvasLayout

logger = logging.getLogger("diffulex")

# Batch sizes the decoder step is captured for; a batch takes the smallest bucket that holds it, and a batch
# larger than the last runs eagerly.
DEFAULT_GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32)

# (canvas ids [B, C], layout, self-conditioning inputs [B, C, hidden]) -> final hidden states [B, C, hidden]
DecoderForward = Callable[[torch.Tensor, CanvasLayout, torch.Tensor], torch.Tensor]


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``batch`` canvases, None if none does."""
    return next((b for b in sorted(buckets) if b >= batch), None)


class CanvasGraph:
    """One bucket's decoder step: its static inputs and, once captured, the graph that replays it."""

    def __init__(
        self, bucket: int, canvas_length: int, hidden_size: int, page_table_width: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.bucket = bucket
        self.canvas_ids = torch.zeros(bucket, canvas_length, dtype=torch.long, device=device)
        self.soft = torch.zeros(bucket, canvas_length, hidden_size, dtype=dtype, device=device)
        self.layout = CanvasLayout.empty(bucket, canvas_length, page_table_width, device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # the captured forward's output buffer
        # the contexts and page tables the layout holds: a step over the same ones (a continuation's, or the next
        # step of canvases that encoded nothing) leaves it as it is, and copies nothing from the host, which waits
        # for the device
        self._layout_key: tuple | None = None

    def fill(
        self, canvas_ids: torch.Tensor, soft: torch.Tensor | None, contexts: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> None:  # fmt: skip
        batch = canvas_ids.shape[0]
        if batch > self.bucket:
            raise ValueError(f"{batch} canvases do not fit the graph bucket of {self.bucket}")
        self.canvas_ids[:batch].copy_(canvas_ids)
        self.canvas_ids[batch:].zero_()
        if soft is None:
            self.soft.zero_()
        else:
            self.soft[:batch].copy_(soft)
            self.soft[batch:].zero_()
        key = (tuple(contexts), tuple(tuple(table) for table in tables))
        if key != self._layout_key:
            self.layout.fill(contexts, tables)
            self._layout_key = key

    def capture(self, forward: DecoderForward, pool: object | None) -> None:
        """Run the forward once on a side stream (kernels compiled, library handles made), then capture it."""
        t0 = time.perf_counter()
        device = self.canvas_ids.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward(self.canvas_ids, self.layout, self.soft)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.hidden = forward(self.canvas_ids, self.layout, self.soft)
        logger.info("DiffusionGemma: decoder step of %d canvases captured in %.1f s", self.bucket,
                    time.perf_counter() - t0)  # fmt: skip

    def run(self, forward: DecoderForward) -> torch.Tensor:
        """The bucket's hidden states ``[bucket, C, hidden]`` for the filled inputs: the graph replayed, or (not
        captured) the static forward run directly."""
        if self.graph is None:
            return forward(self.canvas_ids, self.layout, self.soft)
        self.graph.replay()
        assert self.hidden is not None
        return self.hidden
