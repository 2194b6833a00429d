"""CUDA graphs for decode-shaped steps: one captured forward per request-count bucket, replayed with padding.

A decode step of block diffusion has a bounded shape: each request contributes at most its running set
(``buffer_size`` blocks, plus one row for a shifted family), so a forward over ``R`` requests never has more than
``R * max_query_len`` rows. For each bucket ``R`` in `request_buckets` the model forward is captured once over
static buffers of that capacity; a step with ``r <= R`` requests, each with at most ``max_query_len`` rows, is
replayed by copying its inputs into the buffers and padding the rest:

* padded requests get zero query rows (``cu_seqlens_q`` repeats its last value), so attention skips them;
* padded rows get token 0 at position 0 and slot -1 (nothing stored); their hidden states are never read;
* the attention kernels see the bucket's fixed launch bounds (``max_query_len`` rows per request, keys up to
  ``max_model_len``), so one launch shape serves every step that fits.

Prefill chunks, rebuilds after preemption and anything larger run eagerly. The LM head and the sampler stay
outside the graph: the number of rows they need changes every step.

All integer inputs travel in one pinned host buffer and one copy per step, so replaying costs a handful of host
operations whatever the batch size. At batch 1 the host work between the previous step's result and this
launch is GPU idle time, and every CUDA call there costs microseconds (10-60 us each right after a device wait on
the H100 host measured), so the copy is captured into each graph as its first node: a step makes exactly one
CUDA call, the replay. The staging buffer is reused without an event: the caller synchronizes with the device at
the end of every replayed step (`ModelRunner.run`), so the previous copy out of it has always finished.

With micro-batches (``staging_buffers > 1``, `diffulex.engine.engine`) a step is launched while the previous
one may still wait in the stream, so one buffer would be overwritten before its copy ran: each micro-batch then
fills its own host buffer and the copy is issued before the replay instead of inside it. A buffer is filled
again only after its micro-batch's previous step has returned its result, so that copy has run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from diffulex.attention import PagedAttentionMetadata
from diffulex.engine.step_inputs import StepInputs

logger = logging.getLogger("diffulex")

# Buckets below 16 requests double; from there they grow by this step (the original's scheme, which keeps the
# padding waste under 16 requests while capturing few graphs).
BUCKET_STRIDE = 16
# The most requests one captured graph serves; larger batches run eagerly.
MAX_GRAPH_REQUESTS = 512

Forward = Callable[[torch.Tensor, torch.Tensor, PagedAttentionMetadata], torch.Tensor]


def request_buckets(max_requests: int) -> list[int]:
    """``1, 2, 4, 8, 16, 32, 48, ...`` up to and including ``max_requests``."""
    small = [b for b in (1, 2, 4, 8) if b < max_requests]
    large = list(range(BUCKET_STRIDE, max_requests, BUCKET_STRIDE))
    return sorted(set(small + large + [max_requests]))


@dataclass(frozen=True)
class GraphShape:
    """The capacity every captured graph is built for."""

    max_requests: int
    max_query_len: int  # rows per request: the running set (plus the recomputed row of a shifted family)
    max_pages: int  # page-table width: pages of one request at max_model_len
    max_kv_len: int  # max_model_len: the longest key range attention may meet
    block_size: int
    page_size: int
    prefix_full: bool

    @property
    def max_tokens(self) -> int:
        return self.max_requests * self.max_query_len


class DecodeGraphs:
    """Static input buffers, the metadata views over them, and one graph per request bucket.

    With ``capture=False`` (no CUDA) the same padded buffers are run through the eager forward instead of a
    graph: that path exercises the padding rules on the CPU, where tests can compare it with unpadded steps.
    """

    def __init__(
        self, shape: GraphShape, forward: Forward, device: torch.device, capture: bool, staging_buffers: int = 1
    ) -> None:
        self.shape = shape
        self.forward = forward
        self.device = device
        self.capture_graphs = capture and device.type == "cuda"
        self.buckets = request_buckets(shape.max_requests)
        R, T, P = shape.max_requests, shape.max_tokens, shape.max_pages
        pin = device.type == "cuda"
        # One byte buffer, staged on the host and mirrored on the device, holding two typed sections:
        # tokens (int64): [input_ids | positions | slot_mapping], each T long;
        # layout (int32): [cu_seqlens_q (R + 1) | context_lens (R) | prefix_lens (R) | page_tables (R * P)].
        self._head_len = 3 * R + 1
        token_bytes = 3 * T * 8
        total_bytes = token_bytes + (self._head_len + R * P) * 4
        hosts = [torch.zeros(total_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(staging_buffers)]
        staging = torch.zeros(total_bytes, dtype=torch.uint8, device=device)
        self._tokens_np = [h.numpy()[:token_bytes].view(np.int64) for h in hosts]
        self._layout_np = [h.numpy()[token_bytes:].view(np.int32) for h in hosts]
        self._upload_in_graph = staging_buffers == 1
        self._tokens = staging[:token_bytes].view(torch.int64)
        self._layout = staging[token_bytes:].view(torch.int32)
        # per bucket, the prefix of the buffer its step uses: every token row, the layout up to its page tables
        used = {b: token_bytes + (self._head_len + b * P) * 4 for b in self.buckets}
        self._copy_pairs = {b: [(staging[: used[b]], h[: used[b]]) for h in hosts] for b in self.buckets}
        self._metas = {b: self._metadata(b) for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    # ----- views ---------------------------------------------------------------------------------------------

    def _token_views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = self.shape.max_tokens
        t = self._tokens
        return t[:num_tokens], t[T : T + num_tokens], t[2 * T : 2 * T + num_tokens]

    def _metadata(self, bucket: int) -> PagedAttentionMetadata:
        s, R = self.shape, self.shape.max_requests
        lay = self._layout
        _, _, slots = self._token_views(bucket * s.max_query_len)
        tables = lay[self._head_len : self._head_len + bucket * s.max_pages].view(bucket, s.max_pages)
        return PagedAttentionMetadata(
            cu_seqlens_q=lay[: bucket + 1],
            context_lens=lay[R + 1 : R + 1 + bucket],
            prefix_lens=lay[2 * R + 1 : 2 * R + 1 + bucket],
            page_tables=tables,
            slot_mapping=slots,
            block_size=s.block_size,
            page_size=s.page_size,
            prefix_full=s.prefix_full,
            query_lens_cpu=[s.max_query_len] * bucket,
            context_lens_cpu=[0] * bucket,
            prefix_lens_cpu=[0] * bucket,
            max_query_len=s.max_query_len,
            max_kv_len=s.max_kv_len,
        )

    # ----- filling -------------------------------------------------------------------------------------------

    def bucket_for(self, step: StepInputs) -> int | None:
        """The smallest bucket that holds the step, or None when it must run eagerly."""
        s = self.shape
        r = step.num_requests
        if r == 0 or r > s.max_requests or step.max_query_len > s.max_query_len or step.max_pages > s.max_pages:
            return None
        if self.capture_graphs and not self._graphs:
            return None
        return next(b for b in self.buckets if b >= r)

    def _fill(self, step: StepInputs, bucket: int, buffer: int = 0) -> None:
        s, R, T = self.shape, self.shape.max_requests, self.shape.max_tokens
        t, r = step.num_tokens, step.num_requests
        n = bucket * s.max_query_len
        tok = self._tokens_np[buffer]
        tok[:t] = step.input_ids
        tok[t:n] = 0
        tok[T : T + t] = step.positions
        tok[T + t : T + n] = 0
        tok[2 * T : 2 * T + t] = step.slot_mapping
        tok[2 * T + t : 2 * T + n] = -1
        lay = self._layout_np[buffer]
        lay[: r + 1] = step.cu_seqlens_q
        lay[r + 1 : bucket + 1] = t
        lay[R + 1 : R + 1 + r] = step.context_lens
        lay[R + 1 + r : R + 1 + bucket] = 0
        lay[2 * R + 1 : 2 * R + 1 + r] = step.prefix_lens
        lay[2 * R + 1 + r : 2 * R + 1 + bucket] = 0
        tables = lay[self._head_len : self._head_len + bucket * s.max_pages].reshape(bucket, s.max_pages)
        tables.fill(-1)
        for i, table in enumerate(step.page_tables):
            tables[i, : len(table)] = table
        if not self.capture_graphs:  # a captured graph copies the staging buffer in itself (see `_upload`)
            self._upload(bucket, buffer)
            # the eager fallback reads the host lists of the metadata
            meta = self._metas[bucket]
            pad = bucket - r
            meta.query_lens_cpu = step.query_lens + [0] * pad
            meta.context_lens_cpu = step.context_lens + [0] * pad
            meta.prefix_lens_cpu = step.prefix_lens + [0] * pad

    def _upload(self, bucket: int, buffer: int = 0) -> None:
        """Copy the bucket's part of a host staging buffer to the device (one copy, queued on the stream)."""
        device_part, host_part = self._copy_pairs[bucket][buffer]
        device_part.copy_(host_part, non_blocking=True)

    def run(self, step: StepInputs, bucket: int, buffer: int = 0) -> torch.Tensor:
        """Hidden states ``[step.num_tokens, hidden]`` of the step, computed in the bucket's padded shape, its
        inputs staged in host buffer `buffer` (one per micro-batch)."""
        self._fill(step, bucket, buffer)
        if self.capture_graphs:
            if not self._upload_in_graph:
                self._upload(bucket, buffer)
            self._graphs[bucket].replay()
            hidden = self._outputs[bucket]
        else:
            ids, positions, _ = self._token_views(bucket * self.shape.max_query_len)
            hidden = self.forward(ids, positions, self._metas[bucket])
        return hidden[: step.num_tokens]

    # ----- capture -------------------------------------------------------------------------------------------

    def _fill_capture_batch(self, bucket: int) -> None:
        """A valid placeholder batch: every request has a full query, no cache, stores nothing."""
        s = self.shape
        q = s.max_query_len
        step = StepInputs(
            input_ids=[0] * (bucket * q),
            positions=[i % q for i in range(bucket * q)],
            slot_mapping=[-1] * (bucket * q),
            cu_seqlens_q=[i * q for i in range(bucket + 1)],
            query_lens=[q] * bucket,
            context_lens=[0] * bucket,
            prefix_lens=[0] * bucket,
            page_tables=[[] for _ in range(bucket)],
        )
        self._fill(step, bucket)
        if self.capture_graphs:
            self._upload(bucket)

    @torch.inference_mode()
    def capture(self, warmup_runs: int = 2) -> None:
        """Capture every bucket, largest first, all sharing one memory pool.

        Every bucket is warmed up before the first capture: a compiled forward may still compile or autotune
        on its first call with a new shape, and neither is allowed while a stream is capturing.
        """
        if not self.capture_graphs:
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for bucket in reversed(self.buckets):
                self._fill_capture_batch(bucket)
                ids, positions, _ = self._token_views(bucket * self.shape.max_query_len)
                for _ in range(warmup_runs):
                    self.forward(ids, positions, self._metas[bucket])
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = None
        for bucket in reversed(self.buckets):
            self._fill_capture_batch(bucket)
            ids, positions, _ = self._token_views(bucket * self.shape.max_query_len)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                if self._upload_in_graph:  # part of the graph: a replay is then the only CUDA call of a step
                    self._upload(bucket)
                self._outputs[bucket] = self.forward(ids, positions, self._metas[bucket])
            pool = graph.pool()
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (requests %s, %d rows each)",
            len(self._graphs), self.buckets, self.shape.max_query_len,
        )
