"""Turns a batch of requests into one forward: flat inputs, attention metadata, logits, sampled writes.

The runner owns the model, the KV cache tensors and the sampler. For every request it computes the query
range chosen by the request (uncached committed blocks, then the running set, unless the request's strategy
chooses otherwise), asks the cache to store the K/V of the blocks the request stores (committed ones), and runs
the LM head only on the rows the sampler needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from diffulex.attention import Attention, PagedAttentionMetadata
from diffulex.attention.layer import triton_supports_head_dim
from diffulex.engine.continuation import BlockGates, BlockOpening, advance_inputs
from diffulex.engine.cuda_graph import DecodeGraphs, GraphShape, SampledRows, graph_requests
from diffulex.engine.prefill_graphs import (
    GROUP_MAX_CONTEXT_KEYS,
    MIN_DECODERS_PER_SPLIT_PROMPT,
    PrefillGraphs,
    chunk_graph_shape,
    group_prompts,
    has_straggling_context,
    straggler_graph_shape,
)
from diffulex.engine.static_soft_inputs import StaticSoftInputs
from diffulex.engine.step_broadcast import MessageKind, StepMessage
from diffulex.engine.step_inputs import StepInputs
from diffulex.engine.step_rows import StepRows
from diffulex.layers.linear import SKINNY_MAX_ROWS
from diffulex.layers.token_merge import TokenMerge, TokenMergeSettings
from diffulex.sampler.rows import PendingWrites, RowLayout
from diffulex.strategy.page_table import page_array
from diffulex.strategy.request import Request, SampleTarget

if TYPE_CHECKING:
    from diffulex.engine.tensor_parallel import TensorParallelWorkers


@dataclass
class RunnerSettings:
    block_size: int
    page_size: int
    prefix_full: bool  # d2f: prompt rows attend to the whole prompt
    device: torch.device
    kv_dtype: torch.dtype
    attn_impl: str = "naive"  # "triton"/"triton_grouped" use the Triton kernels on CUDA
    token_merge: TokenMergeSettings | None = None  # DMax's soft inputs (static graph inputs on the graph path)
    samples_in_graph: bool = True  # the sampler has a greedy step a graph can capture (`Strategy.samples_in_graph`)
    key_tails: bool = False  # requests may attend to cached keys after their rows (`Strategy.attends_past_rows`)
    mask_token_id: int = -1  # the mask id (what a continuation opens a request's next block with)
    # decoded positions of a block from which the block after it may force (`diffulex.strategy.request.
    # decoded_for_progress`): what a continuation's advance moves a block's force flag on with (`BlockGates`)
    decoded_to_force: int = 0
    # decoded positions of the newest running block from which the next joins (``add_block_threshold`` as a count):
    # whether a continuation that moves a request's blocks on opens one (`BlockOpening.decoded_to_join`)
    decoded_to_join: int = 0


@dataclass
class SplitStep:
    """A step as the graphs run it: the store-only prefixes of its requests, alone or in groups, each part with its
    prefill bucket's rows, replayed in this order, then the rest of the batch (possibly no request) for the decode
    graphs (`ModelRunner.collect_split`)."""

    prefills: list[tuple[StepInputs, int]] = field(default_factory=list)
    rest: StepInputs = field(default_factory=StepInputs)


def _has_prompt_prefix(req: Request, first_row: int) -> bool:
    """Whether the request's rows this step, from ``first_row`` (its `Request.query_range` start), begin with
    store-only prompt rows (`Request.store_only_end`)."""
    prefix_end = req.store_only_end()
    return prefix_end is not None and prefix_end > first_row


def _carries_prompt(batch: list[Request], ranges: list[tuple[int, int]]) -> bool:
    """Whether a step (its requests' `Request.query_range` in ``ranges``) carries store-only prompt rows."""
    return any(_has_prompt_prefix(req, start) for req, (start, _) in zip(batch, ranges, strict=True))


# The runner's decode-shaped graph sets by the name a tensor-parallel message gives them (`StepMessage.graph_set`).
GRAPH_SETS = ("decode", "short", "chunk", "straggler")


@dataclass(frozen=True)
class _StepPlan:
    """How one step runs: its prefill replays in order, then ``step`` on ``graphs`` at ``bucket`` (None for no decode
    replay: the prefills are the whole step, or without prefills the step is eager)."""

    prefills: list[tuple[StepInputs, int]]
    step: StepInputs
    graphs: DecodeGraphs | None
    bucket: int | None


@dataclass(frozen=True)
class _ReplayedStep:
    """The last step replayed with graph sampling: what `ModelRunner.launch_continuation` replays again."""

    graphs: DecodeGraphs  # the full graphs or the short ones
    bucket: int
    layout: RowLayout
    storable: bool  # every block a continuation may store once it is decoded has its page
    staged_pages: dict[int, int]  # req_id -> pages of its page table staged on the device (what an opening reads)
    sampled_rows: Counter[int]  # req_id -> its rows in the layout (a whole block's can open the next one)
    # req_id -> the first position of its rows in the replayed forward (a prompt prefix run in a prefill graph of
    # its own before it is not among them)
    row_starts: dict[int, int]


class ModelRunner:
    def __init__(self, settings: RunnerSettings, model: nn.Module, sampler) -> None:
        self.settings = settings
        self.model = model
        self.sampler = sampler
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not self.attention_layers:
            raise ValueError(f"{type(model).__name__} has no Attention layers to bind a KV cache to")
        self.num_pages = 0
        # rank 0 of a tensor-parallel group: the workers each step's inputs are broadcast to (`follow_step`)
        self.workers: TensorParallelWorkers | None = None
        # a launch failed after its message went to the workers: they may wait in a collective rank 0 never reaches
        self.out_of_step = False
        self.forward = model.forward
        self.graph_forward = model.forward  # what CUDA graphs capture (compiled by `compile_forward`)
        self.graphs: DecodeGraphs | None = None
        self._graph_logits_shift = 0  # 1 where the graphs' sampled rows predict the position after them
        self.short_graphs: DecodeGraphs | None = None  # narrower graphs for a strategy's short steps
        self.prefill_graphs: PrefillGraphs | None = None  # a step's store-only prompt rows, by request or group
        self.chunk_graphs: DecodeGraphs | None = None  # a short prompt chunk and the decoders in one forward
        self.straggler_graphs: DecodeGraphs | None = None  # decode steps among which one context stands out
        self._replayed: _ReplayedStep | None = None
        # steps launched so far (continuations included), and those of them through the eager forward: what share of
        # the steps a benchmark times ran on the graph path (on the CPU's uncaptured static path, which left it)
        self.launched_steps = 0
        self.eager_steps = 0

    # ----- KV cache ---------------------------------------------------------------------------------------

    def page_bytes(self) -> int:
        """Bytes one page takes across all layers (K and V)."""
        itemsize = torch.empty((), dtype=self.settings.kv_dtype).element_size()
        per_layer = sum(2 * a.num_kv_heads * a.head_dim for a in self.attention_layers)
        return per_layer * self.settings.page_size * itemsize

    def allocate_kv_cache(self, num_pages: int) -> None:
        s = self.settings
        for layer in self.attention_layers:
            shape = (num_pages, s.page_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = _zeros(shape, s.kv_dtype, s.device)
            layer.v_cache = _zeros(shape, s.kv_dtype, s.device)
            # a head the Triton kernels cannot tile (tiny test models) takes the PyTorch path; same result
            layer.attn_impl = s.attn_impl if triton_supports_head_dim(layer.head_dim) else "naive"
        self.num_pages = num_pages

    def release_kv_cache(self) -> None:
        """Drop the cache tensors and the graphs captured over them."""
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = None
        self.graphs = self.short_graphs = None
        self.prefill_graphs = self.chunk_graphs = self.straggler_graphs = None
        self._replayed = None
        self.num_pages = 0

    def compile_forward(self, mode: str) -> None:
        """Compile the forward the CUDA graphs capture; eager steps keep the plain forward.

        Only graph capture uses the compiled callable, so its launch bounds never change and it compiles once.
        Inductor's own graphs are switched off (``reduce-overhead`` becomes ``default``, ``max-autotune`` its
        no-cudagraphs variant): graphs inside a graph capture are not allowed. Attention is an opaque custom op.
        """
        mode = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}.get(mode, mode)
        self.graph_forward = torch.compile(self.model.forward, mode=mode, dynamic=True, fullgraph=False)

    # ----- one step ---------------------------------------------------------------------------------------

    def enable_decode_graphs(
        self,
        max_requests: int,
        max_query_len: int,
        max_model_len: int,
        capture: bool,
        staging_buffers: int = 1,
        continuations: bool = False,
        logits_shift: bool = False,
        key_tails: bool = False,
        short_rows_per_request: int | None = None,
        short_buckets: Sequence[int] = (),
        max_prefill_rows: int = 0,
        max_chunk_rows: int = 0,
        straggler_graphs: bool = False,
        warm_up_only: bool = False,
    ) -> None:
        """Serve decode-shaped steps from padded static buffers, captured as CUDA graphs when ``capture``; one
        host staging buffer per step that may be in flight (one per micro-batch; two with continuations). Greedy
        steps also sample inside a graph (`greedy_sample`); with ``continuations`` their sampling graph also
        prepares the next step's inputs, so that `launch_continuation` can queue it before this step's result is
        read; ``logits_shift`` says where a sampled row's token goes (the row after it, for shifted families);
        ``key_tails`` stages each request's key end, so that steps attending past their rows replay too;
        ``short_rows_per_request`` (below ``max_query_len``, with ``short_buckets``: `GraphPolicy.decide` passes
        neither otherwise) adds a second set of graphs whose buckets hold that many
        rows per request on average (each request up to ``max_query_len``), which a step replays where it fits them
        with fewer rows than in the full set (and continues as the full set does), captured for the request buckets
        ``short_buckets``; ``max_prefill_rows``
        (0: none) adds the prefill graphs, whose replays compute a step's store-only prompt rows of up to that many
        rows per request before the rest of the step replays the decode graphs, or a lone request's whole step (up
        to ``max_query_len`` rows more) (`diffulex.engine.prefill_graphs`);
        ``max_chunk_rows`` (0: none) adds the chunk graphs, whose requests have up to that many rows: a step with a
        prompt whose rows fit them (beside prefill graphs: where its rows could have been split off) replays them
        instead; ``straggler_graphs`` adds graphs of the decode shape whose attention splits long contexts, which a
        decode step among which one context stands out replays (and continues on, as on the decode graphs).

        With ``warm_up_only`` the graphs are built as for a capture, their buckets' forwards run once each, as
        before a capture, and the runner is left with the graphs it had: what a build's dry pass runs to record the
        kernel variants the capture will need (`diffulex.kernels.parallel_compile`).

        Call after `allocate_kv_cache`: the graphs bind the cache tensors they were captured with.
        """
        s = self.settings
        kept = (self.graphs, self.short_graphs, self.prefill_graphs, self.chunk_graphs, self.straggler_graphs,
                self._graph_logits_shift)  # fmt: skip
        shape = GraphShape(
            max_requests=graph_requests(max_requests),
            max_query_len=max_query_len,
            max_pages=-(-max_model_len // s.page_size),
            max_kv_len=max_model_len,
            block_size=s.block_size,
            page_size=s.page_size,
            prefix_full=s.prefix_full,
            key_tails=key_tails,
        )
        greedy_sample = self.greedy_sample if s.samples_in_graph else None
        soft_inputs = None
        if s.token_merge is not None:
            soft_inputs = StaticSoftInputs(s.token_merge, shape.max_tokens, s.device, staging_buffers)
        advance = None
        # a continuation opens a request's next block itself (`BlockOpening`) where its advance is the plain one and
        # requests attend to no keys after their rows
        opens_blocks_with = None
        if continuations and greedy_sample is not None:
            own_advance = getattr(self.sampler, "continuation_advance", None)  # a sampler whose rule needs its own
            if own_advance is not None:  # it also writes the continuation's soft inputs, where there are any
                soft_records = soft_inputs.merge if soft_inputs is not None else None
                advance = own_advance(shift=int(logits_shift), soft_records=soft_records)
            elif soft_inputs is not None:
                raise ValueError("continuation steps with soft inputs need a sampler that writes the next step's")
            else:
                advance = partial(_plain_advance, shift=int(logits_shift), max_rows=max_query_len,
                                  block_size=s.block_size, decoded_to_force=s.decoded_to_force,
                                  decoded_to_join=s.decoded_to_join)  # fmt: skip
                if not key_tails:
                    opens_blocks_with = s.mask_token_id
        result_fields = getattr(self.sampler, "result_fields", 2)
        self.graphs = DecodeGraphs(
            shape, self.graph_forward, s.device, capture, staging_buffers, greedy_sample, advance, soft_inputs,
            result_fields=result_fields, opens_blocks_with=opens_blocks_with,
        )
        self.short_graphs = None
        if short_rows_per_request is not None:  # the policy passes it only where the set is narrower and has buckets
            # its buckets may hold more requests than the full graphs' (`graph_policy._short_buckets`)
            short_shape = dataclasses.replace(shape, row_capacity=short_rows_per_request,
                                              max_requests=max(shape.max_requests, max(short_buckets)))  # fmt: skip
            self.short_graphs = DecodeGraphs(
                short_shape, self.graph_forward, s.device, capture, staging_buffers, greedy_sample, advance,
                result_fields=result_fields, opens_blocks_with=opens_blocks_with, buckets=list(short_buckets),
            )
        self.prefill_graphs = self.chunk_graphs = self.straggler_graphs = None
        if max_prefill_rows > 0 and not s.prefix_full:
            self.prefill_graphs = PrefillGraphs(
                min(max_prefill_rows, max_model_len), max_query_len, shape.max_pages, max_model_len, s.block_size,
                s.page_size, self.graph_forward, s.device, capture,
            )  # fmt: skip
        # soft inputs ride only in the decode graphs, and a sampler that reads the step's inputs reads theirs
        plain_inputs = s.token_merge is None and not getattr(self.sampler, "greedy_reads_inputs", False)
        if max_chunk_rows > 0 and plain_inputs:
            self.chunk_graphs = DecodeGraphs(
                chunk_graph_shape(shape, max_chunk_rows), self.graph_forward, s.device, capture, staging_buffers,
                greedy_sample, advance, result_fields=result_fields, opens_blocks_with=opens_blocks_with,
            )
        if straggler_graphs and plain_inputs:
            self.straggler_graphs = DecodeGraphs(
                straggler_graph_shape(shape), self.graph_forward, s.device, capture, staging_buffers, greedy_sample,
                advance, result_fields=result_fields, opens_blocks_with=opens_blocks_with,
            )
        self._replayed = None
        self._graph_logits_shift = int(logits_shift)
        if warm_up_only:
            for graphs in (self.graphs, self.short_graphs, self.prefill_graphs, self.chunk_graphs,
                           self.straggler_graphs):  # fmt: skip
                if graphs is not None:
                    graphs.warm_up()
            (self.graphs, self.short_graphs, self.prefill_graphs, self.chunk_graphs, self.straggler_graphs,
             self._graph_logits_shift) = kept  # fmt: skip
            return
        self.graphs.capture()
        if self.short_graphs is not None:
            self.short_graphs.capture()
        if self.prefill_graphs is not None:  # replayed before the decode graphs, never beside them: one pool
            self.prefill_graphs.capture(pool=self.graphs.pool)
        if self.chunk_graphs is not None:
            self.chunk_graphs.capture()
        if self.straggler_graphs is not None:
            self.straggler_graphs.capture()

    def greedy_sample(
        self,
        hidden: torch.Tensor,
        source_rows: torch.Tensor,
        segment: torch.Tensor,
        force: torch.Tensor,
        starts: torch.Tensor,
    ) -> torch.Tensor:
        """What a decode graph's sampling graph captures: the LM head over every row of the padded step (which
        rows are sampled changes every step; the graph's shapes may not), then the sampler's greedy step on the
        rows to sample. Returns ``[2, rows]`` accepted flags and tokens (and the rows the sampler adds, its
        ``result_fields``).

        The LM head is told which rows are sampled (``source_rows``): a continuation step that only stores a
        decoded block samples none, and then its LM head streams no weights (`LMHead.forward`)."""
        logits = self.model.compute_logits(hidden, source_rows)
        block_rows = self.settings.block_size
        if getattr(self.sampler, "greedy_reads_inputs", False):
            current = self._sampled_input_tokens(source_rows)
            return self.sampler.greedy_result(logits, source_rows, segment, force, starts, block_rows, current)
        return self.sampler.greedy_result(logits, source_rows, segment, force, starts, block_rows)

    def _sampled_input_tokens(self, source_rows: torch.Tensor) -> torch.Tensor:
        """The token each sampled row's position holds in the graphs' static inputs (the row after it, for a
        shifted family): what a rule that rewrites tokens (edit decoding) compares its proposals with."""
        input_ids = self.graphs.input_ids(source_rows.shape[0])
        return input_ids[(source_rows + self._graph_logits_shift).clamp(0, input_ids.shape[0] - 1)]

    @torch.inference_mode()
    def run(self, batch: list[Request]) -> dict[int, list[tuple[int, int]]]:
        """Forward the batch and sample; returns the accepted ``(position, token)`` writes per request id."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: list[Request], micro_batch: int = 0) -> PendingWrites:
        """`run` without waiting for the device: queues the forward, the LM head and the sampler, and returns
        their result as `PendingWrites`. `micro_batch` picks the graphs' staging buffer (`enable_decode_graphs`)."""
        self.out_of_step = False
        pending = self._launch(batch, micro_batch)
        self.out_of_step = False
        self.launched_steps += 1
        return pending

    def _plan(self, batch: list[Request]) -> _StepPlan:
        """How the batch runs: whole on the chunk graphs where it carries prompt rows they hold (one forward) and
        splitting them off would not let the next step be continued (`_split_lets_successor_continue`), on
        the straggler graphs where one context stands out (`has_straggling_context`: their attention splits it);
        else its prefill replays (`collect_split`), then its step on the decode graphs, or (without prefills and a
        bucket) through the eager forward."""
        chunk, straggler = self.chunk_graphs, self.straggler_graphs
        ranges = [req.query_range() for req in batch] if chunk is not None or straggler is not None else []
        whole = None  # the batch collected as one step, once a plan needs it
        if (
            chunk is not None
            and _carries_prompt(batch, ranges)
            and not self._split_lets_successor_continue(batch, ranges)
            and all(end - start <= chunk.shape.max_query_len for start, end in ranges)
        ):
            whole = self.collect(batch)
            bucket = chunk.bucket_for(whole)
            if bucket is not None:  # the prompt's rows ride with the decoders': every weight read once
                return _StepPlan([], whole, chunk, bucket)
        straggles = straggler is not None and has_straggling_context([end for _, end in ranges])
        if straggles:
            whole = whole if whole is not None else self.collect(batch)
            bucket = self._straggler_bucket(whole)
            if bucket is not None:
                return _StepPlan([], whole, straggler, bucket)
        split = self.collect_split(batch) if self.graphs is not None else None
        if split is not None:
            if len(batch) == 1 and len(split.prefills) == 1 and split.rest.num_requests:
                whole = whole if whole is not None else self.collect(batch)
                lone = self._lone_prompt_plan(whole)
                if lone is not None:
                    return lone
            if split.prefills and not split.rest.num_requests:
                return _StepPlan(split.prefills, split.rest, None, None)
            # the rest of a step whose prompts split off: the decoders' step, on the straggler graphs where theirs is
            bucket = self._straggler_bucket(split.rest) if straggles and split.prefills else None
            graphs, bucket = (straggler, bucket) if bucket is not None else self._graphs_for(split.rest)
            if bucket is not None or not split.prefills:  # without prefills the rest is the whole step
                return _StepPlan(split.prefills, split.rest, graphs, bucket)
        step = whole if whole is not None else self.collect(batch)
        return _StepPlan([], step, *self._graphs_for(step))

    def _straggler_bucket(self, step: StepInputs) -> int | None:
        """The straggler graphs' bucket for ``step``, or None (it does not fit; keys past its rows where they stage no
        key ends)."""
        straggler = self.straggler_graphs
        return None if step.has_cached_tail and not straggler.shape.key_tails else straggler.bucket_for(step)

    def _split_lets_successor_continue(self, batch: list[Request], ranges: list[tuple[int, int]]) -> bool:
        """Whether the step after this one could be continued on the device if this one's prompt rows ran in prefill
        graphs of their own, which the chunk graphs would take whole: each prompt ends in this step (no chunk of a
        longer one follows) and every request samples greedily on graphs that continue. Ridden whole in a chunk graph,
        a prompt's rows are in the layout the device would replay, so its successor computes other rows and is the
        host's step (`diffulex.engine.continuation.ContinuationRefusal.PREFILL_IN_STEP`); split, each prompt reads
        the weights once more (about 0.8 ms at SDAR-1.7B on an H200) and the decode graph's successor is continued,
        where a step the host launches costs 1-10 ms of GPU idle at 16-128 requests: where the decoding requests
        number `MIN_DECODERS_PER_SPLIT_PROMPT` per prompt or more (docs/benchmarks.md, "Online serving with prompts
        apart from the decoders")."""
        graphs = self.graphs
        if graphs is None or graphs.advance is None or self.prefill_graphs is None:
            return False
        if not all(req.prefill_chunk_end is None and req.sampling_params.greedy for req in batch):
            return False
        prompts = sum(_has_prompt_prefix(req, start) for req, (start, _) in zip(batch, ranges, strict=True))
        return len(batch) - prompts >= MIN_DECODERS_PER_SPLIT_PROMPT * prompts

    def _lone_prompt_plan(self, whole: StepInputs) -> _StepPlan | None:
        """A request alone (``whole``: its step unsplit), its store-only prompt rows and the rows it samples from in
        one forward: the smallest prefill bucket that holds the whole step replayed over it, the sampled rows read
        from it and sampled after the replay.
        Split, the rows sampled from would replay a decode graph of their own, which reads every weight and the
        whole context again for a block's rows (a prefix-cache hit's first block after 32,000 cached positions:
        3.4 of the 14.7 ms its step took on an H100 at SDAR-1.7B). Each bucket holds a power of two of prompt rows
        and a running set's (`diffulex.engine.prefill_graphs.prefill_buckets`), so a prompt of a power of two fits
        its own; one past it takes the next bucket, twice as wide: its padded rows cost the matmuls less than that
        second forward costs (and attention nothing: no query tile holds only padded rows). Not where a key ends past
        the step's rows, which the prefill graphs do not stage."""
        rows = self.prefill_graphs.bucket_for(whole) if not whole.has_cached_tail else None
        return None if rows is None else _StepPlan([(whole, rows)], whole, None, None)

    def _launch(self, batch: list[Request], micro_batch: int) -> PendingWrites:
        plan = self._plan(batch)
        prefills, step, graphs, bucket = plan.prefills, plan.step, plan.graphs, plan.bucket
        layout = self.sampler.row_layout(step.work) if step.sample_rows else None
        self._replayed = None
        hidden = None
        if bucket is not None or prefills:
            sampled = None
            if bucket is not None and layout is not None and layout.greedy and graphs.samples:
                sample_rows, sample_blocks = step.sample_rows, step.sample_blocks
                if graphs.opens_blocks_with is not None:
                    layout, sample_rows, sample_blocks = self._whole_blocks(step, layout)
                sampled = SampledRows(sample_rows, layout.segments, layout.force, layout.starts, sample_blocks)
            graph_set = self._graph_set_name(graphs)
            self._announce(lambda: StepMessage.of_step(step, bucket, micro_batch, sampled, graph_set, prefills))
            for part, rows in prefills:  # before the decode graph, on the same stream: it reads their K/V
                hidden = self.prefill_graphs.run(part, rows)
            if bucket is not None:  # else the prefills were the whole step (sampled below, if it samples)
                hidden, result = graphs.run(step, bucket, micro_batch, sampled)
                if result is not None:
                    storable = all(base >= 0 for lo, hi, base, _ in sampled.blocks if hi > lo)
                    # what an opening needs to be foreseen (`opens_block_on_device`), where graphs open blocks
                    opens = graphs.opens_blocks_with is not None
                    staged = {req.req_id: len(req.page_table) for req in batch} if opens else {}
                    rows_of = Counter(layout.owners) if opens else Counter()
                    # where each request's rows start: what a continuation asks (`continues_rows`); none without one
                    starts = (
                        {req.req_id: start for (req, _), start in zip(step.work, step.context_lens, strict=True)}
                        if graphs.advance is not None else {}
                    )
                    self._replayed = _ReplayedStep(graphs, bucket, layout, storable, staged, rows_of, starts)
                    return self._pending(layout.pending(result, self._ready(hidden)), batch)
        else:
            self._announce(lambda: StepMessage.of_step(step, None, micro_batch, None))
            self.eager_steps += 1
            hidden = self._eager_forward(step)
        if step.sample_rows:
            logits = self._sample_logits(hidden, step.sample_rows)
            # the LM head's gather was the step's last collective: a request's own failure in the sampler (a draw
            # from non-finite logits, `RequestFailure`) fails that request alone, the ranks still in step
            self.out_of_step = False
            pending = self.sampler.launch(logits, step.work, layout)
        else:
            # Nothing to sample (the step only stores finished blocks): a replayed step's result still waits for
            # the forward, so that the step has always finished when its staging buffer is filled again
            # (`DecodeGraphs`).
            pending = PendingWrites({}, ready=self._ready(hidden) if bucket is not None or prefills else None)
        return self._pending(pending, batch)

    @property
    def graph_replays(self) -> int:
        """Steps (continuations included) that replayed captured CUDA graphs so far: a benchmark reads it around
        the steps it times to say whether they ran on the graphed path, instead of assuming it."""
        return sum(g.num_replays for g in self._decode_shaped_graphs() if g is not None)

    @property
    def prefill_replays(self) -> int:
        """Replays of captured prefill graphs so far (several in a step that carries several prompts)."""
        return self.prefill_graphs.num_replays if self.prefill_graphs is not None else 0

    def _graphs_for(self, step: StepInputs) -> tuple[DecodeGraphs | None, int | None]:
        """The graphs a step replays and its bucket there: of the full graphs and the short ones, those whose bucket
        computes fewer rows (the full ones on a tie); (None, None) for an eager step. Keys past a request's rows
        replay only in graphs that stage the key ends."""
        graphs = self.graphs
        if graphs is None or (step.has_cached_tail and not graphs.shape.key_tails):
            return None, None
        options = [(g, g.bucket_for(step)) for g in (graphs, self.short_graphs) if g is not None]
        options = [(g, b) for g, b in options if b is not None]
        if not options:
            return None, None
        return min(options, key=lambda option: option[0].shape.bucket_rows(option[1]))

    def _decode_shaped_graphs(self) -> tuple[DecodeGraphs | None, ...]:
        """The runner's `DecodeGraphs` sets, in the order of `GRAPH_SETS`."""
        return self.graphs, self.short_graphs, self.chunk_graphs, self.straggler_graphs

    def _graph_set(self, name: str) -> DecodeGraphs:
        """The graph set a tensor-parallel message names (`GRAPH_SETS`)."""
        graphs = dict(zip(GRAPH_SETS, self._decode_shaped_graphs(), strict=True))[name]
        if graphs is None:
            raise RuntimeError(f"rank 0 replayed the {name} graphs, which this rank did not build")
        return graphs

    def _graph_set_name(self, graphs: DecodeGraphs | None) -> str:
        """The name of one of the runner's graph sets (`GRAPH_SETS`; the decode graphs' for none)."""
        for name, candidate in zip(GRAPH_SETS, self._decode_shaped_graphs(), strict=True):
            if graphs is not None and graphs is candidate:
                return name
        return GRAPH_SETS[0]

    def forget_launches(self) -> None:
        """After a failed step: no launch may be continued (its device inputs are not what the host expects)."""
        self._replayed = None

    @property
    def can_continue(self) -> bool:
        """Whether the last launch may be followed by `launch_continuation`: it was replayed and sampled by the
        graphs, those prepare continuations, and each of its sampled blocks has the page it would be stored in.
        Whether its requests' next step really has the same rows is the engine's question
        (`diffulex.strategy.request.Request.next_step_has_same_rows`)."""
        replayed = self._replayed
        return replayed is not None and replayed.storable and replayed.graphs.advance is not None

    @property
    def missing_pages(self) -> bool:
        """Whether the last launch could be continued but for a block it may store that has no page: none could be
        lent (`diffulex.engine.kv_cache_manager.KVCacheManager.reserve_running_pages`)."""
        replayed = self._replayed
        return replayed is not None and not replayed.storable and replayed.graphs.advance is not None

    def continues_rows(self, req: Request) -> bool:
        """Whether a continuation of the last launch computes the rows ``req``'s next step starts from
        (`Request.next_query_range`): its rows in the replayed forward start there. A step that computed an
        admitted prompt's prefix in a prefill graph of its own did so; one that replayed the prefix with the block's
        rows (a chunk graph) did not: a continuation would compute the prefix again."""
        replayed = self._replayed
        return replayed is not None and bool(req.running) and (
            replayed.row_starts.get(req.req_id) == req.next_query_range()[0]
        )

    def opens_block_on_device(self, req: Request) -> bool:
        """Whether a continuation of the last launch can open ``req``'s next block itself (`BlockOpening`): its graphs
        open blocks, the launch's layout holds the request's running blocks whole (`_whole_blocks`) and the page of
        the block after them was staged with the launch that began the chain (the page table the device reads). A
        running set that drains needs no page, and its rows may end in placeholder blocks of earlier moves."""
        replayed = self._replayed
        if replayed is None or replayed.graphs.opens_blocks_with is None or not self.continues_rows(req):
            return False
        size, rows = self.settings.block_size, replayed.sampled_rows[req.req_id]
        if not req.block_joins_past_running_set():  # draining: no page needed; placeholder blocks may follow
            return len(req.running) > 1 and rows % size == 0 and rows >= len(req.running) * size
        if rows != len(req.running) * size:
            return False
        next_end = req.running[-1].end + size
        return -(-next_end // self.settings.page_size) <= replayed.staged_pages.get(req.req_id, 0)

    @torch.inference_mode()
    def launch_continuation(self, micro_batch: int, opened: Collection[int] = ()) -> PendingWrites:
        """Queue the step after the last one without staging anything: the same graphs on the inputs the last
        step's sampling graph advanced (`diffulex.engine.continuation`). Its result has the last step's row layout,
        one block further on for the requests in ``opened`` (ids of requests whose block the last step stored: the
        device opens their next block, `opens_block_on_device`); rows decoded since are never accepted.
        `micro_batch` picks the host home of the result."""
        if not self.can_continue:
            raise RuntimeError("the last launch cannot be continued on the device")
        replayed = self._replayed
        if opened:
            size = self.settings.block_size
            starts = {rid: start + size if rid in opened else start for rid, start in replayed.row_starts.items()}
            replayed = self._replayed = dataclasses.replace(
                replayed, layout=replayed.layout.opened(set(opened), size), row_starts=starts
            )
        num_rows = len(replayed.layout.positions)
        graph_set = self._graph_set_name(replayed.graphs)
        self._announce(lambda: StepMessage(MessageKind.CONTINUATION, bucket=replayed.bucket, micro_batch=micro_batch,
                                           num_rows=num_rows, graph_set=graph_set))  # fmt: skip
        hidden, result = replayed.graphs.replay_continuation(replayed.bucket, micro_batch, num_rows)
        self.out_of_step = False
        self.launched_steps += 1
        return replayed.layout.continued().pending(result, self._ready(hidden))

    @staticmethod
    def _ready(hidden: torch.Tensor) -> torch.cuda.Event | None:
        """An event after the work queued so far, for a result to wait on (None off CUDA: nothing is queued)."""
        if not hidden.is_cuda:
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready

    @staticmethod
    def _pending(pending: PendingWrites, batch: list[Request]) -> PendingWrites:
        """Every request of the batch gets an entry, also one with no rows to sample."""
        for req in batch:
            pending.writes.setdefault(req.req_id, [])
        return pending

    def _sample_logits(self, hidden: torch.Tensor, sample_rows: list[int]) -> torch.Tensor:
        """The logits of the rows to sample."""
        # pinned: a copy from pageable memory would first wait for the whole forward to finish, leaving the
        # LM head and sampler launches (~0.3 ms of host work at batch 1) to run while the GPU idles
        rows = torch.tensor(sample_rows, dtype=torch.long, pin_memory=hidden.is_cuda)
        row_index = rows.to(hidden.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, row_index))

    def _announce(self, message: Callable[[], StepMessage]) -> None:
        """On rank 0 of a tensor-parallel group, broadcast the step about to run to the workers (the message is
        built only then: a single-rank step makes none)."""
        if self.workers is not None:
            self.out_of_step = True  # until the launch has queued its collectives (`launch`); set before the send,
            self.workers.send(message())  # which an interrupt may leave half done (a long message: two broadcasts)

    @torch.inference_mode()
    def follow_step(self, message: StepMessage) -> torch.Tensor:
        """On a tensor-parallel worker: rank 0's step, as `launch` ran it, on this rank's shard: the forward, and
        the LM head where rank 0 computes logits (its gather is a collective; on the graph path the in-graph greedy
        sampler runs too). Nothing is sampled eagerly: rank 0 alone applies results. Returns the hidden states
        (their device work queued, not awaited)."""
        if message.kind is MessageKind.CONTINUATION:
            graphs = self._graph_set(message.graph_set)
            hidden, _ = graphs.replay_continuation(message.bucket, message.micro_batch, message.num_rows)
            return hidden
        step = message.step
        if message.kind is MessageKind.GRAPH:
            for part, rows in message.prefills:
                hidden = self.prefill_graphs.run(part, rows)
            if message.bucket is not None:
                graphs = self._graph_set(message.graph_set)
                hidden, result = graphs.run(step, message.bucket, message.micro_batch, message.sampled)
                if result is not None:
                    return hidden
        else:
            hidden = self._eager_forward(step)
        if step.sample_rows:
            self._sample_logits(hidden, step.sample_rows)
        return hidden

    def token_embedding(self) -> nn.Embedding:
        """The model's token embedding: as wide as the hidden states the LM head reads, with as many rows as the
        logits have columns (every family here ties the LM head to it or matches its shape)."""
        return next(m for m in self.model.modules() if isinstance(m, nn.Embedding))

    @torch.inference_mode()
    def warm_up_attention(self) -> None:
        """Compile now the paged-attention variants eager steps (prefill, eager decode) may launch: CUDA graphs
        compile theirs at capture, but a prompt's first step runs eagerly with shapes of its own. Once per distinct
        layer geometry; nothing on other backends or off CUDA (where Triton need not be installed: the kernels are
        imported only past that check)."""
        from diffulex.attention.layer import TRITON_IMPLS

        s = self.settings
        if s.device.type != "cuda" or s.attn_impl not in TRITON_IMPLS:
            return
        from diffulex.kernels import paged_attention

        done = set()
        for layer in self.attention_layers:
            if layer.k_cache is None or layer.v_cache is None or layer.attn_impl not in TRITON_IMPLS:
                continue
            geometry = (layer.num_heads, tuple(layer.k_cache.shape[1:]), layer.k_cache.dtype)
            if geometry not in done:
                done.add(geometry)
                paged_attention.warm_up(
                    layer.k_cache, layer.v_cache, layer.num_heads, s.block_size, s.prefix_full,
                    grouped=s.attn_impl == "triton_grouped", key_tails=s.key_tails,
                )

    @torch.inference_mode()
    def warm_up_sampling(self, max_rows: int, dtype: torch.dtype) -> None:
        """Compile now the kernels that run after the forward (LM head, sampler) for every row count a step can
        sample, up to `max_rows`: their variants depend on the row count, and a compile met while serving stalls
        that step for a few hundred milliseconds. CUDA only (nothing compiles elsewhere)."""
        device = self.settings.device
        if device.type != "cuda":
            return
        # every row count the skinny GEMM takes, then the largest
        hidden_size = self.token_embedding().embedding_dim
        for rows in sorted({*range(1, min(max_rows, SKINNY_MAX_ROWS) + 1), max_rows}):
            logits = self.model.compute_logits(torch.zeros(rows, hidden_size, dtype=dtype, device=device))
        self.sampler.warm_up(device, logits.dtype, logits.shape[-1], max_rows)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_model_len: int, num_sample_rows: int) -> None:
        """One forward of ``num_tokens`` prompt rows plus logits for ``num_sample_rows`` rows: the activation
        peak the memory planner reserves. The rows form requests of at most ``max_model_len`` positions, as a
        real step would (positions past the model's limit do not exist). Stores nothing in the cache."""
        step, flat = StepInputs(), StepRows(self.settings.page_size)
        for start in range(0, num_tokens, max_model_len):
            n = min(max_model_len, num_tokens - start)
            flat.add(np.zeros(n, dtype=np.int64), 0, [], [], -1)
            step.query_lens.append(n)
            step.context_lens.append(0)
            step.prefix_lens.append(n)
            step.page_tables.append([])
            step.cu_seqlens_q.append(flat.num_rows)
        hidden = self.forward(*self._eager_inputs(_with_rows(step, flat)))
        rows = hidden[: min(num_sample_rows, num_tokens)]
        logits = self.model.compute_logits(rows)
        torch.softmax(logits.float(), dim=-1).max(dim=-1)

    def _whole_blocks(
        self, step: StepInputs, layout: RowLayout
    ) -> tuple[RowLayout, list[int], list[tuple[int, int, int, int]]]:
        """The step's sampled rows with each request's running blocks whole, for graphs whose continuations open
        next blocks (`diffulex.engine.continuation.BlockOpening`): each running block that starts before the
        decoding limit gets a row for every position, its decoded ones, the prompt's (an answer's first block may
        hold the prompt's last positions) and those past the limit (an answer's last block may end before the block
        does) no candidates (logits row -1, as a continuation retires them),
        also a block with none left (stored by this step, or decoded after a block that is not); each gated by the
        block before it. So the continuation after the step that stores the leading block has whole blocks of rows
        to move on by one. Returns the layout, the logits rows and the blocks' rows, slots and gates; the step's own
        where the sampler's layout is not a plain one."""
        if type(layout) is not RowLayout:
            return layout, step.sample_rows, step.sample_blocks
        size, page = self.settings.block_size, self.settings.page_size
        out = RowLayout([], [], [], [], [], [], req_ids=layout.req_ids)
        rows, blocks = [], []
        segment = 0

        def add_block(req: Request, positions: list[int], logits_rows: list[int], force: int, block_rows) -> None:
            out.starts.append(len(out.positions))
            out.positions.extend(positions)
            out.owners.extend([req.req_id] * len(positions))
            out.segments.extend([len(out.force)] * len(positions))
            out.force.append(force)
            out.max_block_rows = max(out.max_block_rows, len(positions))
            rows.extend(logits_rows)
            blocks.append(block_rows)

        moved: dict[int, int] = {}  # the step's sampled blocks -> the layout's (a gate names one)
        for index, (req, targets) in enumerate(step.work):
            offset, start = step.cu_seqlens_q[index], step.context_lens[index]
            limit = req.decode_limit
            # every running block's rows in this step: not so for a prompt's chunk that ends before its answer's
            # first block, or a split step's rows after a store-only prefix that ends inside that block
            rows_end = start + step.cu_seqlens_q[index + 1] - offset
            whole = bool(req.running) and all(
                start <= block.start < limit and block.end <= rows_end and req.stores_when_decoded(block)
                for block in req.running
            )
            if whole:
                sampled = {target.block.index: segment + i for i, target in enumerate(targets)}
                gate = -1
                for block in req.running:
                    positions = list(range(block.start, block.end))
                    first_row = offset + block.start - start
                    own, force = {}, 1  # (a block with nothing to sample: its flag is never read)
                    if block.index in sampled:
                        number = sampled[block.index]
                        first, last = layout.starts[number], layout.starts[number + 1]
                        own = dict(zip(layout.positions[first:last], step.sample_rows[first:last], strict=True))
                        force = layout.force[number]
                    add_block(req, positions, [own.get(p, -1) for p in positions], force,
                              (first_row, first_row + size, _slot(req, block.start, page), gate))  # fmt: skip
                    gate = len(out.force) - 1
                segment += len(targets)
                continue
            for _ in targets:
                first, last = layout.starts[segment], layout.starts[segment + 1]
                lo, hi, base, gate = step.sample_blocks[segment]
                moved[segment] = len(out.force)
                add_block(req, layout.positions[first:last], step.sample_rows[first:last], layout.force[segment],
                          (lo, hi, base, moved.get(gate, -1)))  # fmt: skip
                segment += 1
        out.starts.append(len(out.positions))
        return out, rows, blocks

    def collect(self, batch: list[Request]) -> StepInputs:
        """Flatten the batch: every request's query range, its cache slots and the rows to sample."""
        step, rows = StepInputs(), StepRows(self.settings.page_size)
        for req in batch:
            start, end = req.query_range()
            self._add_rows(step, rows, req, start, end, start, req.sample_targets())
        return _with_rows(step, rows)

    def collect_split(self, batch: list[Request]) -> SplitStep | None:
        """The batch as prefill graphs and decode graphs run it (`diffulex.engine.prefill_graphs`): the requests'
        store-only prefixes as steps of their own, one request's or a group's (`_prompt_groups`), then the rest of
        every request as one step, where a request's rows start at the end of its prefix (a shifted family
        recomputes the row before, storing it again nowhere), the prefix then read from the cache. Without such
        prefixes the rest is `collect`'s step. None when a prefix does not fit a prefill bucket, or the runner has no
        prefill graphs: the step runs unsplit."""
        prefill = self.prefill_graphs
        if prefill is None or self.settings.prefix_full:  # prompt rows that see the whole prompt
            return None
        split, page_size = SplitStep(), self.settings.page_size
        rest_rows = StepRows(page_size)
        prefixes: list[tuple[Request, int, int]] = []  # (request, first row, end of its store-only prefix)
        for req in batch:
            start, end = req.query_range()
            prefix_end = req.store_only_end()
            if prefix_end is None or prefix_end <= start:
                self._add_rows(split.rest, rest_rows, req, start, end, start, req.sample_targets())
                continue
            prefixes.append((req, start, prefix_end))
            if end > prefix_end:
                rest_start = prefix_end - int(req.settings.logits_shift)
                self._add_rows(split.rest, rest_rows, req, rest_start, end, prefix_end, req.sample_targets())
        _with_rows(split.rest, rest_rows)
        for group in self._prompt_groups(prefixes):
            part, part_rows = StepInputs(), StepRows(page_size)
            for req, start, prefix_end in group:
                self._add_rows(part, part_rows, req, start, prefix_end, start, [])
            _with_rows(part, part_rows)
            rows = prefill.bucket_for(part)
            if rows is None:
                return None
            split.prefills.append((part, rows))
        return split

    def _prompt_groups(self, prefixes: list[tuple[Request, int, int]]) -> list[list[tuple[Request, int, int]]]:
        """The store-only prefixes of a step (request, first row, end) in the groups their prefill replays take
        (`diffulex.engine.prefill_graphs.group_prompts`): a prefix after `GROUP_MAX_CONTEXT_KEYS` cached keys or
        more replays alone, and so does one wider than the largest group bucket, in batch order after the groups."""
        widest = self.prefill_graphs.group_buckets[-1]
        fits = [start < GROUP_MAX_CONTEXT_KEYS and end - start <= widest for _, start, end in prefixes]
        groupable = [prefix for prefix, ok in zip(prefixes, fits, strict=True) if ok]
        alone = [[prefix] for prefix, ok in zip(prefixes, fits, strict=True) if not ok]
        rows = [end - start for _, start, end in groupable]
        groups = group_prompts(rows, self.prefill_graphs.group_buckets)
        return [[groupable[i] for i in group] for group in groups] + alone

    def _add_rows(
        self,
        step: StepInputs,
        rows: StepRows,
        req: Request,
        start: int,
        end: int,
        store_from: int,
        targets: list[SampleTarget],
    ) -> None:
        """Append ``req``'s positions ``[start, end)`` to ``step``: its span to ``rows`` (which builds the flat rows
        at the end, `diffulex.engine.step_rows`) with the positions it stores (from ``store_from`` on; rows before it
        store nothing), its layout and the rows of ``targets`` to sample."""
        s = self.settings
        page = s.page_size
        stored = req.stored_runs(store_from, end) if store_from < end else []
        offset = rows.add(req.input_token_ids(start, end), start, stored, req.page_table, req.req_id)
        if s.token_merge is not None:
            step.soft_rows.extend(
                (offset + pos - start, soft) for pos, soft in req.soft_inputs().items() if start <= pos < end
            )
        shift = 1 if req.settings.logits_shift else 0
        sample_rows = step.sample_rows
        before = None  # (block index, sampled block) of the request's last target
        for target in targets:
            sample_rows.extend(offset + p - shift - start for p in target.positions)
            block = target.block
            gate = before[1] if before is not None and before[0] == block.index - 1 else -1
            # stored once decoded where the block before it is committed or moves on with it (its gate); else it
            # waits on a block the continuation does not sample
            after_committed = block.index == 0 or req.blocks[block.index - 1].is_committed
            if req.stores_when_decoded(block) and (gate >= 0 or after_committed):
                base = _slot(req, block.start, page)
                step.sample_blocks.append((offset + block.start - start, offset + block.end - start, base, gate))
            else:  # no rows to store, whatever the continuation decodes
                step.sample_blocks.append((offset, offset, -1, gate))
            before = (block.index, len(step.sample_blocks) - 1)
        step.work.append((req, targets))
        step.query_lens.append(end - start)
        step.context_lens.append(start)
        step.prefix_lens.append(req.prompt_len)
        step.page_tables.append(req.page_table)
        step.key_lens.append(max(end, req.keys_end() or end))
        step.answer_ends.append(req.generation_end)
        step.cu_seqlens_q.append(rows.num_rows)

    def _eager_forward(self, step: StepInputs) -> torch.Tensor:
        merge = None
        if self.settings.token_merge is not None:
            merge = TokenMerge.of(step.soft_rows, self.settings.token_merge, self.settings.device)
        if merge is None:
            return self.forward(*self._eager_inputs(step))
        return self.forward(*self._eager_inputs(step), merge=merge)

    def _eager_inputs(
        self, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        s = self.settings
        dev = s.device
        table = np.full((step.num_requests, step.max_pages), -1, dtype=np.int32)
        for row, pages in zip(table, step.page_tables, strict=True):
            row[: len(pages)] = page_array(pages)

        pin = dev.type == "cuda"

        def tensor(values: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            """On the device through pinned memory, the copy queued on the stream: a copy from pageable memory
            would hold the host until the device has run everything queued before it (a step still in flight)."""
            if isinstance(values, np.ndarray):  # a step's rows: at memory speed
                host = torch.from_numpy(values).to(dtype)
                host = host.pin_memory() if pin else host
            else:
                host = torch.tensor(values, dtype=dtype, pin_memory=pin)
            return host.to(dev, non_blocking=True)

        tails = step.has_cached_tail
        meta = PagedAttentionMetadata(
            cu_seqlens_q=tensor(step.cu_seqlens_q, torch.int32),
            context_lens=tensor(step.context_lens, torch.int32),
            prefix_lens=tensor(step.prefix_lens, torch.int32),
            page_tables=tensor(table, torch.int32),
            slot_mapping=tensor(step.slot_mapping, torch.long),
            block_size=s.block_size,
            page_size=s.page_size,
            prefix_full=s.prefix_full,
            query_lens_cpu=step.query_lens,
            context_lens_cpu=step.context_lens,
            prefix_lens_cpu=step.prefix_lens,
            key_lens_cpu=step.key_lens if tails else None,
            key_lens=tensor(step.key_lens, torch.int32) if tails else None,
        )
        return tensor(step.input_ids, torch.long), tensor(step.positions, torch.long), meta


def _plain_advance(
    input_ids: torch.Tensor, source_rows: torch.Tensor, slot_mapping: torch.Tensor, result: torch.Tensor,
    starts: torch.Tensor, blocks: torch.Tensor, segment: torch.Tensor, force: torch.Tensor, *, shift: int,
    max_rows: int, block_size: int, decoded_to_force: int, decoded_to_join: int,
    opening: BlockOpening | None = None,
) -> None:  # fmt: skip
    """`advance_inputs` as the graphs call an advance (`diffulex.engine.cuda_graph.Advance`): it reads not the
    rows' segments, moves the blocks' force flags on along their gates (`BlockGates`), and opens a block where the
    newest's decoded positions reach ``decoded_to_join``."""
    gates = BlockGates(force, block_size, decoded_to_force)
    if opening is not None:
        opening = dataclasses.replace(opening, decoded_to_join=decoded_to_join)
    advance_inputs(input_ids, source_rows, slot_mapping, result, starts, blocks, shift, max_rows, opening, gates)


def _with_rows(step: StepInputs, rows: StepRows) -> StepInputs:
    """``step`` with the flat rows ``rows`` collected for it."""
    step.input_ids, step.positions, step.slot_mapping = rows.build()
    return step


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU from ``calloc``, whose large blocks are pages the kernel zeroes on first touch, so
    that a page pool sized for the request limits costs neither build time nor memory until its pages are used
    (``torch.zeros`` writes every byte: 5.6 s and 2 GiB resident for the default pool of the built-in model)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _slot(req: Request, position: int, page_size: int) -> int:
    """The KV-cache slot of ``req``'s ``position``, or -1 while its page has not been given."""
    page = position // page_size
    return req.page_table[page] * page_size + position % page_size if page < len(req.page_table) else -1
