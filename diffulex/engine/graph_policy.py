"""How an engine's decode steps run: captured as CUDA graphs or eager, continued on the device or not, and the
static shape the graphs take. Decided once, when the engine is built, from the config and the model's layers."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from diffulex.attention.layer import TRITON_IMPLS, triton_supports_head_dim
from diffulex.config import Config
from diffulex.engine.cuda_graph import MAX_GRAPH_REQUESTS, graph_requests, request_buckets
from diffulex.engine.model_runner import ModelRunner
from diffulex.engine.prefill_graphs import CHUNK_BESIDE_DECODERS_ROWS, CHUNK_GRAPH_ROWS, contexts_may_straggle
from diffulex.strategy.strategy import StepRunner

logger = logging.getLogger("diffulex")


@dataclass(frozen=True)
class GraphPolicy:
    cuda_graphs: bool  # decode steps replay captured CUDA graphs
    # steps may be continued on the device (`diffulex.engine.continuation`): ``async_scheduling`` with one batch per
    # step and a strategy whose steps can be continued (`Strategy.continues_steps`); with two micro-batches the other
    # half already hides the host's work
    continues: bool
    staging_buffers: int  # host staging buffers of the graphs: one per step that may be in flight
    # the most rows one request adds to a decode step: its running set, plus the recomputed row of a shifted family;
    # bounds the graphs' query length, the sampled rows and the profiled logits
    max_rows_per_request: int
    logits_shift: bool
    key_tails: bool = False  # the graphs stage each request's key end (`Strategy.attends_past_rows`)
    # rows per request of a second, narrower set of graphs for the strategy's short steps (`Strategy.short_step_rows`)
    short_rows_per_request: int | None = None
    short_buckets: tuple[int, ...] = ()  # the request buckets of those graphs (`Strategy.short_step_buckets`)
    # the most store-only prompt rows of one request the prefill graphs hold (`diffulex.engine.prefill_graphs`); 0:
    # none, where the strategy's prompt rows may not be split from the rest of their step
    prefill_graph_rows: int = 0
    # the most rows one request of a chunk-graph step may have (`diffulex.engine.prefill_graphs.chunk_graph_shape`):
    # a prompt chunk's, where there are prefill graphs; 0: no chunk graphs
    chunk_graph_rows: int = 0
    # decode steps where one context stands out replay graphs of their own, which split it
    # (`diffulex.engine.prefill_graphs.straggler_graph_shape`): where a context may reach that length
    straggler_graphs: bool = False

    @classmethod
    def decide(
        cls, config: Config, device: torch.device, runner: StepRunner, logits_shift: bool
    ) -> GraphPolicy:
        cuda_graphs = (
            isinstance(runner, ModelRunner)  # the graphs capture the engine runner's forward
            and device.type == "cuda"
            and not config.enforce_eager
            and config.strategy.cuda_graphs
            and config.enable_full_static_runner
            and config.attn_impl in TRITON_IMPLS
            # a captured step replays its launches: the PyTorch attention path reads the layout on the host
            and all(triton_supports_head_dim(layer.head_dim) for layer in runner.attention_layers)
        )
        continues = (
            config.async_scheduling
            and config.micro_batches == 1
            and config.strategy.continues_steps(config)
        )
        max_rows_per_request = config.buffer_size * config.block_size + int(logits_shift)
        prefill_graph_rows = _prefill_graph_rows(config)
        short_rows = config.strategy.short_step_rows(config, logits_shift)
        short_buckets = _short_buckets(config, short_rows, max_rows_per_request)
        if short_rows is None or short_rows >= max_rows_per_request or not short_buckets:
            short_rows, short_buckets = None, ()  # no narrower set is built: neither counted nor captured
        return cls(
            cuda_graphs=cuda_graphs,
            continues=continues,
            staging_buffers=2 if continues else config.micro_batches,
            max_rows_per_request=max_rows_per_request,
            logits_shift=logits_shift,
            key_tails=config.strategy.attends_past_rows,
            short_rows_per_request=short_rows,
            short_buckets=short_buckets,
            prefill_graph_rows=prefill_graph_rows,
            chunk_graph_rows=_chunk_graph_rows(prefill_graph_rows, max_rows_per_request),
            straggler_graphs=contexts_may_straggle(config.max_model_len),
        )

    @property
    def prefill_chunk_rows(self) -> int:
        """`graph_path_chunk_rows` where steps replay captured graphs; 0: no such cap."""
        return self.graph_path_chunk_rows if self.cuda_graphs else 0

    @property
    def graph_path_chunk_rows(self) -> int:
        """The most prompt rows a chunked prefill may put in a step beside decoding requests on the graph path:
        within the largest prefill graph's, so that the step replays graphs, and `CHUNK_BESIDE_DECODERS_ROWS`, so
        that the decoders wait for no longer chunk (`SchedulerLimits.prefill_chunk_rows`)."""
        return min(self.prefill_graph_rows, CHUNK_BESIDE_DECODERS_ROWS)

    def maybe_compile(self, runner: ModelRunner, config: Config) -> None:
        """``enable_torch_compile`` with ``enable_cudagraph_torch_compile``: compile the forward the graphs capture."""
        if self.cuda_graphs and config.enable_torch_compile and config.enable_cudagraph_torch_compile:
            runner.compile_forward(config.torch_compile_mode)

    def maybe_capture(self, runner: ModelRunner, config: Config, device: torch.device) -> None:
        if device.type == "cuda" and not self.cuda_graphs and not config.enforce_eager:
            logger.info(
                "CUDA graphs off: they need attn_impl 'triton' or 'triton_grouped' with heads its kernels tile, the "
                "static runner and a decoding strategy that runs in graphs"
            )
        if not self.cuda_graphs:
            return
        t0 = time.perf_counter()
        self.enable_static_decode(runner, config, capture=True)
        logger.info("CUDA graph capture took %.1f s", time.perf_counter() - t0)

    def rehearse_capture(self, runner: ModelRunner, config: Config) -> None:
        """Run the warm-up forwards `maybe_capture` runs before its captures, and keep nothing: the graphs' part of a
        build's dry pass (`diffulex.kernels.parallel_compile`). Nothing where no graphs are captured."""
        if self.cuda_graphs:
            self.enable_static_decode(runner, config, capture=True, warm_up_only=True)

    def enable_static_decode(
        self, runner: ModelRunner, config: Config, capture: bool, warm_up_only: bool = False
    ) -> None:
        """Serve decode steps from the padded static buffers of the graph path, captured as CUDA graphs or (CPU
        tests, ``capture=False``) run through the eager forward: one place for the shape the engine's graphs
        take. ``warm_up_only``: `ModelRunner.enable_decode_graphs`'s."""
        runner.enable_decode_graphs(
            max_requests=config.max_num_reqs,
            max_query_len=self.max_rows_per_request,
            max_model_len=config.max_model_len,
            capture=capture,
            staging_buffers=self.staging_buffers,
            continuations=self.continues,
            logits_shift=self.logits_shift,
            key_tails=self.key_tails,
            short_rows_per_request=self.short_rows_per_request,
            short_buckets=self.short_buckets,
            max_prefill_rows=self.prefill_graph_rows,
            max_chunk_rows=self.chunk_graph_rows,
            straggler_graphs=self.straggler_graphs,
            warm_up_only=warm_up_only,
        )


def _short_buckets(config: Config, short_rows: int | None, full_rows_per_request: int) -> tuple[int, ...]:
    """The request buckets of the short steps' graphs (`Strategy.short_step_buckets`). For a strategy whose short
    buckets go past the engine's request count (`Strategy.short_buckets_past_max_requests`) the candidates reach
    the buckets that hold fewer rows than the full graphs' largest: a step of ``r`` requests whose rows exceed ``r``
    short requests' then replays a short bucket of more requests, padded with empty ones, rather than the full
    graphs' bucket of ``r``, which pads every request to the widest."""
    requests = graph_requests(config.max_num_reqs)
    if not short_rows:
        return ()
    buckets = request_buckets(requests)
    if config.strategy.short_buckets_past_max_requests:
        full_rows = requests * full_rows_per_request
        reach = max(requests, min(MAX_GRAPH_REQUESTS, full_rows // short_rows))
        buckets = [b for b in request_buckets(reach) if b <= requests or b * short_rows < full_rows]
    return tuple(config.strategy.short_step_buckets(buckets))


def _prefill_graph_rows(config: Config) -> int:
    """``max_prefill_graph_tokens`` (at most ``max_model_len``) where the strategy's prompt rows may run before the
    rest of their step: the condition of chunked prefill (block-causal prompt attention, requests that compute
    their prompt in chunks), else 0."""
    request_class = config.strategy.request_class
    if config.multi_block_prefix_full or request_class is None or not request_class.supports_prefill_chunks:
        return 0
    return min(config.max_prefill_graph_tokens, config.max_model_len)


def _chunk_graph_rows(prefill_graph_rows: int, max_rows_per_request: int) -> int:
    """`GraphPolicy.chunk_graph_rows`: a prompt chunk rides with the decoders where its rows could run in a prefill
    graph of their own, up to `CHUNK_GRAPH_ROWS`; elsewhere there are no chunk graphs."""
    if prefill_graph_rows:
        return max(min(prefill_graph_rows, CHUNK_GRAPH_ROWS), max_rows_per_request)
    return 0
