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

With ``key_tails`` (`GraphShape`) each request's key end travels with the layout too, so steps whose requests
attend to cached keys after their rows (Fast-dLLM v2's sub-block refinement) replay the same graphs as steps
that do not; a padded request's key end is 0 (none past its rows). With a ``row_capacity`` below
``max_query_len`` a bucket of ``R`` requests holds ``R * row_capacity`` rows, however they are shared: a step fits
when its rows do (each request still within ``max_query_len``, the attention kernels' bound), which serves a
strategy whose requests mostly compute fewer rows than the widest one (`Strategy.short_step_rows`).

A step that carries a prompt (a new request's uncached prefix, a prefill chunk, a rebuild after preemption) does
not fit as a whole: its store-only prompt rows replay the prefill graphs first (`diffulex.engine.prefill_graphs`,
sets of this class for one request or a group of prompts), and the rest of the step, reading that prefix from the
cache, replays here. Anything larger runs eagerly.

DMax's soft inputs (token merge) are static inputs too (`diffulex.engine.static_soft_inputs`): a fixed-size record
per row, staged and copied with the rest of the step's inputs, which the captured forward merges itself; a
continuation's records are written by its sampler's advance instead (`DMaxSampler.continuation_advance`).

A step whose requests all decode greedily also replays a second graph per bucket, the sampling graph: the LM
head over every row of the bucket (the rows to sample change every step, so the graph computes logits for all
of them; at decode sizes the weight read dominates either way), the top-1 of the rows to sample (their indices
travel with the step's inputs, padded with -1), the acceptance of every block (padded with empty blocks) and the
``[2, rows]`` result stored into pinned host memory by a kernel (`diffulex.kernels.host_publish`; one sampling
graph per staging buffer, each storing into that buffer's home; without triton, a copy instead, which costs the
GPU several microseconds more per step). That replaces a dozen host-side launches and small
copies per step, whose host cost did not shrink with the batch (about 0.6 ms on an H100 host), by one
graph launch. A step with a request that draws at ``temperature > 0`` (a seeded generator per request) runs the
eager sampler after the forward graph instead. For most buckets the sampling graph is a graph of its own, which
reads the forward graph's output, so those steps need no second capture of the forward; buckets of at most
`FUSED_STEP_MAX_ROWS` rows capture the forward into each sampling graph as well (`DecodeGraphs.fuses_forward`),
because at batch 1 the idle gap between two graph launches and the LM head's late start cost more than the
extra capture.

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

Continuation steps (`diffulex.engine.continuation`, ``async_scheduling``): with an ``advance`` function the
sampling graph ends by turning the device buffers into the next step's inputs (accepted tokens in place,
decoded rows retired, the K/V store of finished blocks turned on), and `replay_continuation` replays both graphs
on them without staging anything. The engine then has two steps in flight, so these graphs also use two host
staging buffers (the copy in is not part of the graph, and each step's result goes to its own home).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from diffulex.attention import PagedAttentionMetadata
from diffulex.engine.continuation import NO_ANSWER_END, BlockOpening
from diffulex.engine.static_soft_inputs import StaticSoftInputs
from diffulex.engine.step_inputs import StepInputs
from diffulex.layers.dispatch import triton_available
from diffulex.strategy.page_table import page_array

logger = logging.getLogger("diffulex")

# Buckets below 16 requests double; from there they grow by this step (the original's scheme, which keeps the
# padding waste under 16 requests while capturing few graphs).
BUCKET_STRIDE = 16
# The most requests one captured graph serves; larger batches run eagerly.
MAX_GRAPH_REQUESTS = 512
# Buckets of at most this many rows capture their forward into each sampling graph (`DecodeGraphs.fuses_forward`):
# steps of one or a few requests, whose step is short enough that the gap between two graph launches shows.
FUSED_STEP_MAX_ROWS = 16

# (input ids [T], positions [T], metadata, readers [T]: the rows whose hidden states anyone reads, -1 for none;
# None: all) -> hidden [T, H]: the model's forward (`diffulex.models.dense.run_decoder` says what readers allow);
# with soft inputs it also takes ``merge=`` their `StaticTokenMerge`
Forward = Callable[[torch.Tensor, torch.Tensor, PagedAttentionMetadata, torch.Tensor | None], torch.Tensor]
# (hidden [T, H], source rows [T], segment [T], force [S + 1], starts [S + 1]) -> [F, T] int64 accepted flag and
# token per sampled row, and what else the sampler adds (F `result_fields`, 2 unless it adds rows): `ModelRunner.
# greedy_sample`, the LM head then `ConfidenceSampler.greedy_result`
GreedySample = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (input ids [T], source rows [T], slot mapping [T], result [F, T], starts [S + 1], blocks [3, S], segment [T],
# force [S + 1]) -> None, editing the inputs in place into the next step's: `diffulex.engine.continuation.
# advance_inputs` (the first three; with ``opening=`` a `BlockOpening` of the step's layout, where the graphs open
# blocks), or a sampler's own (edit decoding's also moves each block's entry in ``force``)
Advance = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    None,
]


def _host_publisher(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """`diffulex.kernels.host_publish.publish_to_host` when triton is there and a probe store into pinned memory
    lands, else None: the sampling graphs then copy their
    result home. The probe guards setups whose pinned memory a kernel cannot address: a failed store there would
    otherwise fail the graph capture, and with it the engine."""
    if not triton_available():
        return None
    from diffulex.kernels import host_publish
    from diffulex.kernels.parallel_compile import in_dry_pass

    expected = [7, -3]
    try:
        home = torch.zeros(len(expected), dtype=torch.int64, pin_memory=device.type == "cuda")
        host_publish.publish_to_host(torch.tensor(expected, dtype=torch.int64, device=device), home)
        if in_dry_pass():  # the store was only recorded (`diffulex.kernels.parallel_compile`): nothing to read back
            return host_publish.publish_to_host
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        landed = home.tolist() == expected
    except Exception as exc:  # noqa: BLE001 - whatever the reason, the copy is the safe way home
        logger.warning("storing step results into pinned memory from a kernel failed (%s); copying them instead", exc)
        return None
    if not landed:
        logger.warning("a kernel's store into pinned memory did not land; step results are copied instead")
        return None
    return host_publish.publish_to_host


def graph_requests(max_num_reqs: int) -> int:
    """The most requests the decode graphs of an engine of ``max_num_reqs`` hold (`MAX_GRAPH_REQUESTS` at most)."""
    return min(max_num_reqs, MAX_GRAPH_REQUESTS)


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
    # each request's key end is staged and handed to attention (`PagedAttentionMetadata.key_lens`), for strategies
    # whose requests attend to cached keys after their rows; off, the kernels compile no loop for such keys
    key_tails: bool = False
    # rows a bucket holds per request, on average over its requests (0: max_query_len, every request's full width):
    # narrower graphs for steps whose requests mostly compute fewer rows than the widest one may
    row_capacity: int = 0
    # the attention's split-KV settings where the graph's shape must decide them (`PagedAttentionMetadata`): the
    # chunk graphs, whose one long request's context is split although the grid fills the GPU. None: the kernel's
    num_splits: int | None = None
    min_split_keys: int | None = None
    # rows every bucket holds whatever its request count (0: its requests times `rows_per_request`): the prefill
    # graphs' groups of prompts, one bucket each, whose rows the prompts share however long each is
    total_rows: int = 0

    @property
    def rows_per_request(self) -> int:
        return self.row_capacity or self.max_query_len

    def bucket_rows(self, bucket: int) -> int:
        """Rows a bucket's buffers hold (its forward computes them all)."""
        return self.total_rows or bucket * self.rows_per_request

    @property
    def max_tokens(self) -> int:
        return self.bucket_rows(self.max_requests)

    def max_segments(self, requests: int) -> int:
        """Blocks that many requests may sample: each request's running set (at most its rows over a block), and no
        more blocks than the bucket has rows."""
        blocks = requests * -(-self.max_query_len // self.block_size)
        return min(blocks, self.total_rows) if self.total_rows else blocks


@dataclass(frozen=True)
class SampledRows:
    """The device half of a greedy step's sampling (`diffulex.sampler.rows.RowLayout` plus the logits row of
    each sampled row), staged with the step's inputs. Plain lists, so the graphs need not know the sampler."""

    rows: list[int]  # logits row of each sampled row, in the sampler's order
    segments: list[int]  # sampled row -> its block
    force: list[int]  # block -> 1 if it may force its best row
    starts: list[int]  # block -> its first sampled row; then the number of sampled rows
    # block -> (its first input row, one past its last, the cache slot of its first row or -1 without a page, its
    # gate): what a continuation step stores once the block is decoded, and the block before it in its request
    # that it moves on with (-1: none) (`diffulex.engine.continuation`)
    blocks: list[tuple[int, int, int, int]]


class DecodeGraphs:
    """Static input buffers, the metadata views over them, and one graph per request bucket.

    With ``capture=False`` (no CUDA) the same padded buffers are run through the eager forward instead of a
    graph: that path exercises the padding rules on the CPU, where tests can compare it with unpadded steps.
    """

    def __init__(
        self,
        shape: GraphShape,
        forward: Forward,
        device: torch.device,
        capture: bool,
        staging_buffers: int = 1,
        greedy_sample: GreedySample | None = None,
        advance: Advance | None = None,
        soft_inputs: StaticSoftInputs | None = None,
        snapshot_uploads: bool = False,
        result_fields: int = 2,
        opens_blocks_with: int | None = None,
        buckets: list[int] | None = None,  # default: `request_buckets` of the shape's requests
    ) -> None:
        if advance is not None and (greedy_sample is None or staging_buffers < 2):
            raise ValueError("continuation steps need a sampling graph and two staging buffers")
        # DMax's token merge, staged with the step's inputs (a continuation's advance writes its own records)
        self.soft_inputs = soft_inputs
        self.result_fields = result_fields  # rows of a sampling graph's result (`GreedySample`)
        # the mask id a continuation opens a request's next block with (`BlockOpening`); None: it opens none
        self.opens_blocks_with = opens_blocks_with
        self.shape = shape
        self.forward = forward
        self.greedy_sample = greedy_sample
        self.advance = advance
        self.device = device
        self.capture_graphs = capture and device.type == "cuda"
        self.buckets = buckets if buckets is not None else request_buckets(shape.max_requests)
        R, T, P, S = shape.max_requests, shape.max_tokens, shape.max_pages, shape.max_segments(shape.max_requests)
        pin = device.type == "cuda"
        # One byte buffer, staged on the host and mirrored on the device, holding two typed sections:
        # tokens (int64): [input_ids | positions | slot_mapping | sample rows | segments] (each T long),
        #                 then [starts | force | block first rows | block end rows | block slots | block gates]
        #                 (each S + 1 long: one more segment, for padded rows);
        # layout (int32): [cu_seqlens_q (R + 1) | context_lens (R) | prefix_lens (R) | key_lens (R) |
        #                 answer_ends (R) | page_tables (R * P)].
        # Int64 sections start at even offsets: 16-byte aligned, as the kernels' compiled variants assume.
        self._head_len = 5 * R + 1
        self._row_stride = T + T % 2
        self._segment_stride = S + 1 + (S + 1) % 2
        token_bytes = (5 * self._row_stride + 6 * self._segment_stride) * 8
        total_bytes = token_bytes + (self._head_len + R * P) * 4
        hosts = [torch.zeros(total_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(staging_buffers)]
        staging = torch.zeros(total_bytes, dtype=torch.uint8, device=device)
        self._tokens_np = [h.numpy()[:token_bytes].view(np.int64) for h in hosts]
        self._layout_np = [h.numpy()[token_bytes:].view(np.int32) for h in hosts]
        # with ``snapshot_uploads`` a bucket may be replayed several times in one step (`diffulex.engine.
        # prefill_graphs`): each replay copies in from a pinned snapshot of the host buffer, which the host allocator
        # keeps until that copy has run, so that filling the buffer again cannot change a copy still queued
        self._snapshot_uploads = snapshot_uploads
        self._upload_in_graph = staging_buffers == 1 and not snapshot_uploads
        self.pool = None  # the memory pool of the captured graphs (`capture`), which other graphs may share
        self._tokens = staging[:token_bytes].view(torch.int64)
        self._layout = staging[token_bytes:].view(torch.int32)
        # per bucket, the prefix of the buffer its step uses: every token row, the layout up to its page tables
        used = {b: token_bytes + (self._head_len + b * P) * 4 for b in self.buckets}
        self._copy_pairs = {b: [(staging[: used[b]], h[: used[b]]) for h in hosts] for b in self.buckets}
        self._metas = {b: self._metadata(b) for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        # the sampling graphs (`greedy_sample`): device results per bucket, host results per staging buffer. Where
        # a kernel can store into pinned memory, each staging buffer gets a sampling graph of its own that ends by
        # storing its result there (`publish_to_host`); else one graph per bucket, whose result is copied.
        self._sample_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._sample_outputs: dict[int, torch.Tensor] = {}
        self._sample_hidden: dict[int, list[torch.Tensor]] = {}  # the forward output each sampling graph reads
        self._results_host = [
            torch.zeros(result_fields * T, dtype=torch.int64, pin_memory=pin) for _ in range(staging_buffers)
        ]
        self._publish = _host_publisher(device) if self.capture_graphs and greedy_sample is not None else None
        self.num_replays = 0  # steps served by captured graphs (read by benchmarks; never read here)

    def fuses_forward(self, bucket: int) -> bool:
        """Whether a bucket's sampling graphs hold its forward too, so that a greedy step is one graph launch.

        Two graph launches in a row leave the GPU idle between them (3-4 us on an H100), and the LM head cannot
        start under the final norm (programmatic dependent launch works within a graph): at batch 1 that is
        worth a second capture of the forward per staging buffer. Larger buckets keep one forward graph, which
        their sampling graphs read."""
        return self.samples and self.shape.bucket_rows(bucket) <= FUSED_STEP_MAX_ROWS

    @property
    def samples(self) -> bool:
        """Whether greedy steps are sampled by the sampling graphs (`run` with ``sampled``)."""
        return self.greedy_sample is not None

    # ----- views ---------------------------------------------------------------------------------------------

    def _row_section(self, tokens: torch.Tensor | np.ndarray, index: int, length: int):
        """The first ``length`` entries of int64 row section ``index`` (0 ids, 1 positions, 2 slots, 3 sample rows,
        4 segments) of a device or host token buffer."""
        start = index * self._row_stride
        return tokens[start : start + length]

    def _segment_section(self, tokens: torch.Tensor | np.ndarray, index: int, length: int):
        """The first ``length`` entries of segment section ``index`` (0 starts, 1 force, 2 block first rows,
        3 block end rows, 4 block slots, 5 block gates)."""
        start = 5 * self._row_stride + index * self._segment_stride
        return tokens[start : start + length]

    def _token_views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self._row_section(self._tokens, i, num_tokens) for i in range(3))

    def input_ids(self, num_tokens: int) -> torch.Tensor:
        """The device input ids of a bucket of ``num_tokens`` rows (what its graphs read)."""
        return self._row_section(self._tokens, 0, num_tokens)

    def _block_view(self, bucket: int) -> torch.Tensor:
        """``[4, s]``: each block's first input row, end input row, first slot and gate (sections 2-5, one stride
        apart)."""
        start = 5 * self._row_stride + 2 * self._segment_stride
        blocks = self._tokens[start : start + 4 * self._segment_stride].view(4, self._segment_stride)
        return blocks[:, : self.shape.max_segments(bucket)]

    def _sampling_views(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows [n], segments [n], force [s + 1], starts [s + 1])`` of a bucket of ``n`` rows and at most ``s``
        sampled blocks, plus one more block, empty and never forcing, that padded rows belong to."""
        n = self.shape.bucket_rows(bucket)
        s = self.shape.max_segments(bucket)
        t = self._tokens
        return (
            self._row_section(t, 3, n),
            self._row_section(t, 4, n),
            self._segment_section(t, 1, s + 1),
            self._segment_section(t, 0, s + 1),
        )

    def _metadata(self, bucket: int) -> PagedAttentionMetadata:
        s, R = self.shape, self.shape.max_requests
        lay = self._layout
        _, _, slots = self._token_views(s.bucket_rows(bucket))
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
            key_lens=lay[3 * R + 1 : 3 * R + 1 + bucket] if s.key_tails else None,
            num_splits=s.num_splits,
            min_split_keys=s.min_split_keys,
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
        return next((b for b in self.buckets if b >= r and s.bucket_rows(b) >= step.num_tokens), None)

    def _fill(self, step: StepInputs, bucket: int, buffer: int = 0, sampled: SampledRows | None = None) -> None:
        s, R = self.shape, self.shape.max_requests
        t, r = step.num_tokens, step.num_requests
        n = s.bucket_rows(bucket)
        tok = self._tokens_np[buffer]
        for index, values, pad in ((0, step.input_ids, 0), (1, step.positions, 0), (2, step.slot_mapping, -1)):
            section = self._row_section(tok, index, n)
            section[:t] = values
            section[t:] = pad
        if sampled is not None:
            self._fill_sampled(sampled, bucket, tok)
        # the rows to sample, padded with -1: the sampling graph's, and the forward's readers (`_forward`), also
        # where the eager sampler reads them
        rows = sampled.rows if sampled is not None else step.sample_rows
        section = self._row_section(tok, 3, n)
        section[: len(rows)] = rows
        section[len(rows) :] = -1
        lay = self._layout_np[buffer]
        lay[: r + 1] = step.cu_seqlens_q
        lay[r + 1 : bucket + 1] = t
        lay[R + 1 : R + 1 + r] = step.context_lens
        lay[R + 1 + r : R + 1 + bucket] = 0
        lay[2 * R + 1 : 2 * R + 1 + r] = step.prefix_lens
        lay[2 * R + 1 + r : 2 * R + 1 + bucket] = 0
        if s.key_tails:  # a request without a key end (none past its rows) and a padded one: 0, i.e. none
            lay[3 * R + 1 : 3 * R + 1 + len(step.key_lens)] = step.key_lens
            lay[3 * R + 1 + len(step.key_lens) : 3 * R + 1 + bucket] = 0
        if self.opens_blocks_with is not None:  # what an opening may sample; a hand-built step's requests: no end
            lay[4 * R + 1 : 4 * R + 1 + len(step.answer_ends)] = step.answer_ends
            lay[4 * R + 1 + len(step.answer_ends) : 4 * R + 1 + bucket] = NO_ANSWER_END
        tables = lay[self._head_len : self._head_len + bucket * s.max_pages].reshape(bucket, s.max_pages)
        tables.fill(-1)
        for i, table in enumerate(step.page_tables):
            tables[i, : len(table)] = page_array(table)  # at memory speed (`diffulex.strategy.page_table`)
        if self.soft_inputs is not None:
            self.soft_inputs.stage(step.soft_rows, n, buffer)
        if not self.capture_graphs:  # a captured graph copies the staging buffer in itself (see `_upload`)
            self._upload(bucket, buffer)
            # the eager fallback reads the host lists of the metadata
            meta = self._metas[bucket]
            pad = bucket - r
            meta.query_lens_cpu = step.query_lens + [0] * pad
            meta.context_lens_cpu = step.context_lens + [0] * pad
            meta.prefix_lens_cpu = step.prefix_lens + [0] * pad
            if s.key_tails:
                meta.key_lens_cpu = step.key_lens + [0] * (bucket - len(step.key_lens))

    def _fill_sampled(self, sampled: SampledRows, bucket: int, tok: np.ndarray) -> None:
        """Stage the sampled rows' blocks, padded to the bucket (`_fill` stages the rows themselves): padded rows
        belong to the extra block; padded blocks are empty and never force."""
        n, num_blocks = len(sampled.rows), len(sampled.force)
        rows_cap, blocks_cap = self.shape.bucket_rows(bucket), self.shape.max_segments(bucket)
        if n > rows_cap or num_blocks > blocks_cap:
            raise ValueError(f"{n} rows in {num_blocks} blocks do not fit bucket {bucket}'s sampling graph")
        segments = self._row_section(tok, 4, rows_cap)
        segments[:n] = sampled.segments
        segments[n:] = blocks_cap
        starts = self._segment_section(tok, 0, blocks_cap + 1)
        starts[: num_blocks + 1] = sampled.starts
        starts[num_blocks + 1 :] = n
        force = self._segment_section(tok, 1, blocks_cap + 1)
        force[:num_blocks] = sampled.force
        force[num_blocks:] = 0
        if len(sampled.blocks) != num_blocks:
            raise ValueError(f"{len(sampled.blocks)} block row ranges for {num_blocks} sampled blocks")
        columns = list(zip(*sampled.blocks, strict=True)) or [(), (), (), ()]
        for index, values, pad in zip((2, 3, 4, 5), columns, (0, 0, -1, -1), strict=True):
            section = self._segment_section(tok, index, blocks_cap + 1)
            section[:num_blocks] = values
            section[num_blocks:] = pad

    def _result_home(self, bucket: int, buffer: int) -> torch.Tensor:
        """The pinned ``[result_fields, rows]`` host tensor a bucket's sampling result is copied to: contiguous,
        because a copy into a strided host view would pass through pageable memory (not allowed in a graph, and
        synchronous)."""
        rows, fields = self.shape.bucket_rows(bucket), self.result_fields
        return self._results_host[buffer][: fields * rows].view(fields, rows)

    def _upload(self, bucket: int, buffer: int = 0) -> None:
        """Copy the bucket's part of a host staging buffer to the device (one copy, queued on the stream)."""
        device_part, host_part = self._copy_pairs[bucket][buffer]
        if self._snapshot_uploads and host_part.is_pinned():
            host_part = torch.empty(host_part.shape, dtype=host_part.dtype, pin_memory=True).copy_(host_part)
        device_part.copy_(host_part, non_blocking=True)
        if self.soft_inputs is not None:
            self.soft_inputs.upload(self.shape.bucket_rows(bucket), buffer)

    def run(
        self, step: StepInputs, bucket: int, buffer: int = 0, sampled: SampledRows | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's hidden states ``[step.num_tokens, hidden]``, computed in the bucket's padded shape, its inputs
        staged in host buffer `buffer` (one per micro-batch); with ``sampled`` (greedy steps, `samples` only) also
        the sampling graph's ``[2, rows]`` accepted flags and tokens, in pinned host memory once the stream has
        run (in device memory on the uncaptured path), else None."""
        if sampled is not None and not self.samples:
            raise ValueError("these decode graphs were built without a sampling graph")
        self._fill(step, bucket, buffer, sampled)
        sample = sampled is not None
        if self.capture_graphs and not self._upload_in_graph:
            self._upload(bucket, buffer)
        hidden, result = self._execute(bucket, buffer, sample)
        return hidden[: step.num_tokens], result[:, : len(sampled.rows)] if sample else None

    def replay_continuation(self, bucket: int, buffer: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the bucket's graphs again on the device buffers as the last step's sampling graph advanced them
        (`diffulex.engine.continuation`): nothing is staged. Returns the padded hidden states and the first
        ``num_rows`` sampled rows' ``[2, rows]`` result, in host buffer `buffer`'s pinned home once the stream has
        run (in device memory on the uncaptured path)."""
        if self.advance is None:
            raise ValueError("these decode graphs were built without continuation steps")
        hidden, result = self._execute(bucket, buffer, sample=True)
        return hidden, result[:, :num_rows]

    def _execute(self, bucket: int, buffer: int, sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket's forward graph, then with ``sample`` its sampling graph and the copy of its result to host
        buffer `buffer`'s home (for a bucket of `fuses_forward`, one graph doing both); uncaptured, the same work
        run eagerly."""
        if not self.capture_graphs:
            return self._run_uncaptured(bucket, sample)
        self.num_replays += 1
        if not sample:
            self._graphs[bucket].replay()
            return self._outputs[bucket], None
        index = buffer if self._publish is not None else 0
        if not self.fuses_forward(bucket):
            self._graphs[bucket].replay()
        self._sample_graphs[bucket][index].replay()
        host = self._result_home(bucket, buffer)
        if self._publish is None and not self._upload_in_graph:  # the captured copy targets buffer 0's home
            host.copy_(self._sample_outputs[bucket], non_blocking=True)
        return self._sample_hidden[bucket][index], host

    def _run_uncaptured(self, bucket: int, sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the bucket's graphs do, run eagerly on the same buffers (no CUDA, or before capture)."""
        if self.opens_blocks_with is not None and not self.capture_graphs:
            # the eager attention reads the host list, which an opening moves (a captured graph reads the tensor)
            meta = self._metas[bucket]
            meta.context_lens_cpu = meta.context_lens.tolist()
        hidden = self._forward(bucket)
        return hidden, self._sample(hidden, bucket) if sample else None

    def _forward(self, bucket: int) -> torch.Tensor:
        """The forward over the bucket's buffers. Its readers are the staged rows to sample (section 3), which a
        continuation's advance retires as they are decoded: a step that samples no row (it only stores a
        finished block) lets the last layer skip what only the LM head would read."""
        n = self.shape.bucket_rows(bucket)
        ids, positions, _ = self._token_views(n)
        readers = self._row_section(self._tokens, 3, n)
        if self.soft_inputs is not None:
            return self.forward(ids, positions, self._metas[bucket], readers, merge=self.soft_inputs.merge(n))
        return self.forward(ids, positions, self._metas[bucket], readers)

    def _sample(self, hidden: torch.Tensor, bucket: int) -> torch.Tensor:
        """The sampling graph's work: the greedy result, then (with continuations) the next step's inputs."""
        views = self._sampling_views(bucket)
        result = self.greedy_sample(hidden, *views)
        if self.advance is not None:
            rows, segment, force, starts = views
            ids, positions, slots = self._token_views(self.shape.bucket_rows(bucket))
            blocks = self._block_view(bucket)
            if self.opens_blocks_with is None:
                self.advance(ids, rows, slots, result, starts, blocks, segment, force)
            else:
                meta, s = self._metas[bucket], self.shape
                R = s.max_requests
                ends = self._layout[4 * R + 1 : 4 * R + 1 + meta.context_lens.shape[0]]
                opening = BlockOpening(positions, meta.cu_seqlens_q, meta.context_lens, meta.page_tables, s.page_size,
                                       s.block_size, self.opens_blocks_with, answer_ends=ends)  # fmt: skip
                self.advance(ids, rows, slots, result, starts, blocks, segment, force, opening=opening)
        return result

    # ----- capture -------------------------------------------------------------------------------------------

    def _fill_capture_batch(self, bucket: int) -> None:
        """A valid placeholder batch: the bucket's rows shared evenly by its requests, no cache, stores nothing,
        samples every row (into blocks that are all empty)."""
        total = self.shape.bucket_rows(bucket)
        lens = [total // bucket + (i < total % bucket) for i in range(bucket)]
        step = StepInputs(
            input_ids=[0] * total,
            positions=[position for n in lens for position in range(n)],
            slot_mapping=[-1] * total,
            cu_seqlens_q=[0, *itertools.accumulate(lens)],
            query_lens=lens,
            context_lens=[0] * bucket,
            prefix_lens=[0] * bucket,
            page_tables=[[] for _ in range(bucket)],
        )
        sampled = None
        if self.samples:
            blocks = self.shape.max_segments(bucket)
            rows = list(range(total))
            no_rows = [(0, 0, -1, -1)] * blocks
            sampled = SampledRows(rows, [blocks] * len(rows), [0] * blocks, [0] * (blocks + 1), no_rows)
        self._fill(step, bucket, sampled=sampled)
        if self.capture_graphs:
            self._upload(bucket)

    @torch.inference_mode()
    def warm_up(self, runs: int = 1) -> None:
        """Run every bucket's work `runs` times, largest first, eagerly on its placeholder batch (`capture` does this
        before its first capture; a build's dry pass runs it alone, to record the kernel variants the capture will
        need: `diffulex.kernels.parallel_compile`). On CUDA on a side stream, as a capture runs."""
        if not self.capture_graphs:
            for bucket in reversed(self.buckets):
                self._fill_capture_batch(bucket)
                for _ in range(runs):
                    self._run_uncaptured(bucket, sample=self.samples)
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for bucket in reversed(self.buckets):
                self._fill_capture_batch(bucket)
                for _ in range(runs):
                    _, result = self._run_uncaptured(bucket, sample=self.samples)
                    if result is not None and self._publish is not None:  # its variant for this size, compiled
                        self._publish(result, self._result_home(bucket, 0))
        torch.cuda.current_stream(self.device).wait_stream(side)

    @torch.inference_mode()
    def capture(self, warmup_runs: int = 2, pool=None, log: bool = True) -> None:
        """Capture every bucket, largest first, all sharing one memory pool (``pool``, another set's `pool`, where
        their replays never overlap: one stream runs them in turn): its forward graph, then its sampling graphs
        (which read the forward graph's output, or run a forward of their own: `fuses_forward`). ``log``: say what
        was captured (a caller capturing many one-bucket sets says it once itself).

        Every bucket is warmed up before the first capture: a compiled forward may still compile or autotune
        on its first call with a new shape, and neither is allowed while a stream is capturing.
        """
        if not self.capture_graphs:
            return
        self.warm_up(warmup_runs)
        torch.cuda.synchronize(self.device)
        for bucket in reversed(self.buckets):
            self._fill_capture_batch(bucket)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                if self._upload_in_graph:  # part of the graph: a replay is then the only CUDA call of a step
                    self._upload(bucket)
                self._outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self._graphs[bucket] = graph
            if self.samples:
                self._capture_sampling(bucket, pool)
        torch.cuda.synchronize(self.device)
        self.pool = pool
        if not log:
            return
        logger.info(
            "captured %d decode CUDA graphs (requests %s, %d rows each)%s",
            len(self._graphs), self.buckets, self.shape.rows_per_request,
            ", each with a greedy sampling graph" if self.samples else "",
        )

    def _capture_sampling(self, bucket: int, pool) -> None:
        """The bucket's sampling graphs (one per staging buffer where a kernel stores the result home, else one),
        each holding the forward as well where `fuses_forward` says so."""
        fused = self.fuses_forward(bucket)
        graphs, hiddens = [], []
        for buffer in range(len(self._results_host) if self._publish is not None else 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                if not fused:
                    hidden = self._outputs[bucket]
                else:
                    if self._upload_in_graph:
                        self._upload(bucket)
                    hidden = self._forward(bucket)
                result = self._sample(hidden, bucket)
                if self._publish is not None:
                    self._publish(result, self._result_home(bucket, buffer))
                elif self._upload_in_graph:  # with one staging buffer the copy home is part of the graph too
                    self._result_home(bucket, 0).copy_(result, non_blocking=True)
            graphs.append(graph)
            hiddens.append(hidden)
        self._sample_graphs[bucket] = graphs
        self._sample_hidden[bucket] = hiddens
        self._sample_outputs[bucket] = result
