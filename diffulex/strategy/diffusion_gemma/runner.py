"""The engine step of DiffusionGemma: the model is an encoder and a canvas decoder, not the block-causal forward
the engine's `ModelRunner` drives, so the strategy brings its own runner (`Strategy.make_runner`).

The encoder K/V lives in a page pool like every strategy's K/V: per layer ``[num_pages, page_size, kv_heads,
head_dim]`` (each layer its own head geometry; sliding layers store every position too, since a request that
shares a prefix reads the window before its own start). A request's position ``p`` is in page
``page_table[p // page_size]``; the KV cache manager hands out pages, registers full pages of final tokens and
finds them again for a later request with the same prefix (prompts, and prompts followed by finished canvases).

One step, for a batch of requests that each have a running canvas:

1. each request's missing K/V is encoded and stored, in the pieces a request that was never preempted encoded:
   the rest of its prompt, then every canvas it has committed since. Round ``r`` encodes the ``r``-th missing piece
   of every request in one forward (`DiffusionGemmaForDiffusionLM.encode_rows`, causal, each piece reading the
   K/V before it from the pages);
2. one decoder pass over every request's canvas together (`DiffusionGemmaForDiffusionLM.decode_rows`), each
   canvas attending to its own context in the pages and to itself (`paged`: the Triton kernel on a GPU, the
   PyTorch path elsewhere); on a GPU the pass replays a CUDA graph captured for the smallest bucket of canvases
   that holds the batch (`graphs`);
3. per group of canvases (`LOGITS_GROUP_BYTES`): one LM-head launch, then the canvas rule for all of them
   (`diffulex.strategy.diffusion_gemma.canvas.denoise_canvases`), each canvas with its own temperature and random
   streams; nothing is read on the host until the engine applies the step (`pending.PendingCanvases`), when each
   request's outcome is proposed to it and adopted.

Over several ranks (tensor or expert parallelism, `diffulex.engine.tensor_parallel`) every rank holds its shard of
the layers and the whole embedding (`diffulex.models.diffusion_gemma.DiffusionGemmaDecoder`). Rank 0 runs the
steps above; before each encoder forward and each decoder pass it tells the workers (`EncodeRound`, `DecoderPass`),
and the decoder pass's inputs, which the canvas rule made on rank 0's device, follow in a broadcast of their own.
The workers repeat the two passes on their shards (their collectives meet rank 0's) and nothing else: the LM head
and the rule read the whole vocabulary, which every rank holds, so rank 0 alone computes them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from diffulex.errors import RequestFailure
from diffulex.layers.parallel_state import engine_ranks
from diffulex.models.diffusion_gemma import DiffusionGemmaForDiffusionLM
from diffulex.sampler.rows import PendingWrites
from diffulex.strategy.block import BlockStatus
from diffulex.strategy.diffusion_gemma.canvas import (
    CanvasSchedule,
    CanvasState,
    CanvasSteps,
    canvases_per_product,
    denoise_canvases,
    fresh_state,
)
from diffulex.strategy.diffusion_gemma.graphs import DEFAULT_GRAPH_BUCKETS, CanvasGraph, bucket_for
from diffulex.strategy.diffusion_gemma.paged import (
    CachedAttention,
    CanvasLayout,
    encoder_metadata,
    triton_available,
)
from diffulex.strategy.diffusion_gemma.pending import PendingCanvases
from diffulex.strategy.diffusion_gemma.request import CanvasRequest

if TYPE_CHECKING:
    from diffulex.engine.step_broadcast import StepMessage
    from diffulex.engine.tensor_parallel import TensorParallelWorkers

logger = logging.getLogger("diffulex")

DECODER_SPLITS = 1  # split-KV factor of the canvas rows' attention (`CanvasRunner._decoder_attention`)
# A canvas whose latest applied step's mean entropy is at least this many times the confidence threshold is taken
# not to be confident one step later, so not to end there (`CanvasRunner.can_continue`). A guess: a wrong one costs
# the continued step (the engine drops it, `num_dropped_continuations`), a right one saves the host's gap between
# two steps, a few percent of a step; so it is made only where the entropy has far to fall.
UNCONFIDENT_ENTROPY_FACTOR = 10.0
# Float32 logits of one LM-head launch at most: the canvases of a step get their logits in groups this size
# allows (each launch reads the embedding matrix once: 1.5 GB on the 26B-A4B geometry)
LOGITS_GROUP_BYTES = 1 << 31


@dataclass(frozen=True)
class CanvasRunnerSettings:
    device: torch.device
    kv_dtype: torch.dtype
    page_size: int
    vocab_limit: int  # ids at or above this are never drawn
    base_seed: int  # the seed of requests that bring none (``base_seed + req_id``; greedy ones: ``base_seed``)
    schedule: CanvasSchedule
    # batch sizes whose decoder step runs from static buffers (a CUDA graph where one can be captured); empty:
    # every step eager
    graph_buckets: tuple[int, ...] = ()


@dataclass(frozen=True)
class EncodeRound:
    """An encoder forward the workers repeat: ``(page table, lo, hi)`` of each piece and the pieces' ids in order
    (plain lists: a request's `PageTable` would carry its array along)."""

    pieces: list[tuple[list[int], int, int]]
    ids: list[int]


@dataclass(frozen=True)
class DecoderPass:
    """A decoder pass the workers repeat over canvases each after ``contexts[b]`` positions in pages ``tables[b]``;
    its canvas ids (and, with ``soft``, the self-conditioning inputs) follow in broadcasts."""

    contexts: list[int]
    tables: list[list[int]]
    soft: bool


def default_graph_buckets(device: torch.device, enforce_eager: bool) -> tuple[int, ...]:
    """Graphs where they can be captured: CUDA with the Triton kernel (the PyTorch path reads the layout on the
    host), unless the user asked for eager steps."""
    return DEFAULT_GRAPH_BUCKETS if triton_available(device) and not enforce_eager else ()


@dataclass(frozen=True)
class CanvasLaunch:
    """A launched step as its continuation needs it: its requests and their canvases' proposed next states (on the
    device, in the batch's order)."""

    batch: list[CanvasRequest]
    states: list[CanvasState]


class CanvasRunner:
    """What the engine calls on a runner (`diffulex.strategy.strategy.StepRunner`), for DiffusionGemma."""

    missing_pages = False  # its continuations store nothing: they need no page

    def __init__(self, settings: CanvasRunnerSettings, model: DiffusionGemmaForDiffusionLM) -> None:
        self.settings = settings
        self.model = model
        self.num_pages = 0
        self.k_cache: list[torch.Tensor] = []  # per layer [num_pages, page_size, kv_heads, head_dim]
        self.v_cache: list[torch.Tensor] = []
        config = model.config
        self.windows = [config.sliding_window if g.is_sliding else 0 for g in config.layers]
        self.use_triton = triton_available(settings.device)
        # captured only where the Triton kernel runs; elsewhere the buckets' static path runs uncaptured
        self.capture_graphs = self.use_triton
        self.graphs: dict[int, CanvasGraph] = {}
        self._graph_pool: object | None = None
        # decoder passes replayed from captured graphs so far: benchmarks read it around the steps they time
        self.graph_replays = 0
        # rank 0 of a tensor- or expert-parallel group: the workers each pass is announced to (`follow_step`)
        self.workers: TensorParallelWorkers | None = None
        # a launch failed after a pass went to the workers: they may wait in a collective rank 0 never reaches
        self.out_of_step = False
        self._last: CanvasLaunch | None = None  # the latest launch, which `launch_continuation` follows

    # ----- memory ---------------------------------------------------------------------------------------

    def page_bytes(self) -> int:
        """Bytes of encoder K/V one page of positions takes, over all layers."""
        itemsize = torch.empty((), dtype=self.settings.kv_dtype).element_size()
        per_position = sum(2 * heads * head_dim for heads, head_dim in self._kv_geometry())
        return per_position * self.settings.page_size * itemsize

    def _kv_geometry(self) -> list[tuple[int, int]]:
        """Each layer's ``(K/V heads, head_dim)`` on this rank (its shard of the heads)."""
        return [(layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.model.layers]

    def allocate_kv_cache(self, num_pages: int) -> None:
        s = self.settings
        self.k_cache, self.v_cache = [], []
        for heads, head_dim in self._kv_geometry():
            shape = (num_pages, s.page_size, heads, head_dim)
            self.k_cache.append(torch.zeros(shape, dtype=s.kv_dtype, device=s.device))
            self.v_cache.append(torch.zeros(shape, dtype=s.kv_dtype, device=s.device))
        self.num_pages = num_pages
        self.graphs = {}  # captured over the old pool's addresses
        self._last = None

    def release_kv_cache(self) -> None:
        self.k_cache, self.v_cache = [], []
        self.num_pages = 0
        self.graphs = {}
        self._last = None

    def warm_up_attention(self) -> None:
        """Compile every variant of the attention kernel a step launches (each layer kind's window, encoder and
        decoder), so that none compiles while serving."""
        if not self.use_triton or not self.k_cache:
            return
        from diffulex.kernels.paged_attention import warm_up

        heads, canvas = self.model.layers[0].self_attn.num_heads, self.model.config.canvas_length
        seen = set()
        for layer, window in enumerate(self.windows):
            kind = (tuple(self.k_cache[layer].shape[2:]), window)
            if kind in seen:
                continue
            seen.add(kind)
            k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
            warm_up(k_cache, v_cache, heads, canvas, True, True, window=window, window_from_context=True)
            warm_up(k_cache, v_cache, heads, 1, False, True, window=window, window_from_context=False)

    def warm_up_sampling(self, max_rows: int, dtype: torch.dtype) -> None:
        """Nothing compiles on this path (the decoder graphs are captured at their bucket's first step)."""

    def forget_launches(self) -> None:
        """After a failed step: its requests are as they were (its outcomes are only proposed), and no launch may be
        continued."""
        self._last = None

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_model_len: int, num_sample_rows: int) -> None:
        """The activation peak the memory planner measures: a prompt of ``min(num_tokens, max_model_len)``
        positions encoded, then a step of as many canvases as ``num_sample_rows`` rows hold, after it (in a
        scratch pool of just those pages, released after)."""
        config, device = self.model.config, self.settings.device
        length = min(num_tokens, max_model_len)
        rows = max(1, num_sample_rows // config.canvas_length)
        table = list(range(math.ceil((length + config.canvas_length) / self.settings.page_size)))
        self.allocate_kv_cache(len(table))
        try:
            self._encode_round([(table, 0, length)], torch.zeros(length, dtype=torch.long, device=device))
            canvas = torch.zeros(rows, config.canvas_length, dtype=torch.long, device=device)
            hidden = self._decode_eager(canvas, None, [length] * rows, [table] * rows)
            logits = self.model.logits(hidden[: self._logits_group_size(rows)])
            state = fresh_state(0, 0, config.canvas_length, self.settings.vocab_limit, device)
            # the rule's temporaries: those of the sampled canvases one self-conditioning product takes together
            sampled = min(len(logits), canvases_per_product(config.canvas_length))
            self._rule(logits[:sampled], [state] * sampled, [1.0] * sampled, [0] * sampled)
        finally:
            self.release_kv_cache()

    # ----- one step ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, batch: list[CanvasRequest], micro_batch: int = 0) -> PendingWrites:
        """Encode what each request still needs, denoise every canvas in one decoder pass and one rule per logits
        group, and queue the outcome's copy to the host; the host waits for it only when the step is applied
        (`PendingCanvases.result`, which proposes each request's outcome; the writes show each canvas's argmax)."""
        self.out_of_step = False
        pending = self._launch(batch)
        self.out_of_step = False
        return pending

    def _launch(self, batch: list[CanvasRequest]) -> PendingWrites:
        s = self.settings
        self._encode_missing(batch)
        states = [
            req.canvas
            if req.canvas is not None
            else fresh_state(self._seed(req), req.canvases_done, req.canvas_length, s.vocab_limit, s.device)
            for req in batch
        ]
        for req in batch:
            req.proposed = None
        return self._denoise(batch, states)

    def _denoise(self, batch: list[CanvasRequest], states: list[CanvasState]) -> PendingCanvases:
        """One step of the batch's canvases at ``states`` (their context encoded): the decoder pass, then per logits
        group the LM head and the canvas rule; remembered as the launch a continuation follows."""
        model = self.model
        canvas_ids = torch.stack([state.tokens for state in states])
        soft = None
        if any(state.soft_embeds is not None for state in states):
            shape = (model.config.canvas_length, model.config.hidden_size)
            dtype = model.model.decoder.embed_tokens.weight.dtype
            zeros = torch.zeros(shape, dtype=dtype, device=self.settings.device)
            soft = torch.stack([zeros if state.soft_embeds is None else state.soft_embeds for state in states])
        contexts = [req.encoded_len for req in batch]
        tables = [req.page_table for req in batch]
        hidden = self.decode(canvas_ids, soft, contexts, tables)
        steps: list[CanvasSteps] = []
        group = self._logits_group_size(len(batch))
        for first in range(0, len(batch), group):
            members = batch[first : first + group]
            logits = model.logits(hidden[first : first + group])
            temperatures = [req.sampling_params.temperature for req in members]
            seeds = [self._seed(req) for req in members]
            steps.append(self._rule(logits, states[first : first + group], temperatures, seeds))
        self._last = CanvasLaunch(batch, [state for group_steps in steps for state in group_steps.states])
        return PendingCanvases.launch(batch, steps)

    def _logits_group_size(self, batch: int) -> int:
        """Canvases whose float32 logits one LM-head launch computes (at least one)."""
        config = self.model.config
        per_canvas = config.canvas_length * config.vocab_size * 4
        return max(1, min(batch, LOGITS_GROUP_BYTES // per_canvas))

    @property
    def can_continue(self) -> bool:
        """Whether the step after the latest launch can be queued before its result is read: no canvas of it is to
        end there. A canvas ends at its schedule's last step (known), or once stable and confident. Stable means an
        argmax equal to each of the ``stability_threshold`` argmaxes before it, so a canvas whose applied steps (all
        but the one in flight) end in fewer equal argmaxes than that (`CanvasRequest.steady_argmaxes`) cannot be
        stable at the launched step, whatever it draws. Else (a threshold of 1, the published checkpoint's, leaves
        nothing certain after a canvas's first step) a canvas whose latest applied step was far from confident
        (`UNCONFIDENT_ENTROPY_FACTOR`) is taken not to be confident at the next; a greedy canvas (entropy 0) never is.
        The continuation then denoises the same canvases from the states the launch proposes (its requests' own
        conditions: `CanvasRequest.next_step_has_same_rows`)."""
        last, schedule = self._last, self.settings.schedule
        # a proposed state that counts the schedule's steps all done follows its canvas's last step
        if last is None or any(state.steps >= schedule.max_steps for state in last.states):
            return False
        unconfident = UNCONFIDENT_ENTROPY_FACTOR * schedule.confidence_threshold
        return all(
            req.steady_argmaxes < schedule.stability_threshold
            or (req.steady_argmaxes > 0 and req.latest_mean_entropy >= unconfident)
            for req in last.batch
        )

    def continues_rows(self, req: CanvasRequest) -> bool:
        """A continuation denoises the canvases the launch left (`can_continue`); whether a request's rows stay is
        its own question (`CanvasRequest.next_step_has_same_rows`)."""
        return True

    def opens_block_on_device(self, req: CanvasRequest) -> bool:
        return False

    @torch.inference_mode()
    def launch_continuation(self, micro_batch: int, opened: Collection[int] = ()) -> PendingWrites:
        """Queue the step after the latest launch before its result is read: the same canvases from the states it
        proposed (tokens, self-conditioning inputs and argmax histories, all on the device), over the same pages
        (a bucket's static layout is then left as it is, so nothing waits for the device). Its outcome is proposed
        to each request when the engine applies it, after the launch before it."""
        if opened or not self.can_continue:
            raise RuntimeError("the latest DiffusionGemma step cannot be continued on the device")
        last = self._last
        self.out_of_step = False
        pending = self._denoise(last.batch, last.states)
        self.out_of_step = False
        return pending

    def decode(
        self, canvas_ids: torch.Tensor, soft: torch.Tensor | None, contexts: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """The decoder pass of one step: ``canvas_ids [B, C]``, canvas ``b`` after ``contexts[b]`` positions in
        pages ``tables[b]``; ``[B, C, hidden]``. From a bucket's static buffers (its graph replayed once captured)
        when one holds the batch, eagerly otherwise. On rank 0 of several, the workers repeat it."""
        if self.workers is not None:
            self._announce(DecoderPass(list(contexts), [list(t) for t in tables], soft is not None))
            self._share(canvas_ids, soft)
        return self._decode(canvas_ids, soft, contexts, tables)

    def _decode(
        self, canvas_ids: torch.Tensor, soft: torch.Tensor | None, contexts: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        batch = canvas_ids.shape[0]
        bucket = bucket_for(batch, self.settings.graph_buckets)
        if bucket is None:
            return self._decode_eager(canvas_ids, soft, contexts, tables)
        graph = self.graphs.get(bucket)
        first_use = graph is None
        if graph is None:
            config = self.model.config
            dtype = self.model.model.decoder.embed_tokens.weight.dtype
            graph = CanvasGraph(bucket, config.canvas_length, config.hidden_size, self.num_pages, dtype,
                                self.settings.device)  # fmt: skip
            self.graphs[bucket] = graph
        graph.fill(canvas_ids, soft, contexts, tables)
        if first_use and self.capture_graphs:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph.capture(self._static_forward, self._graph_pool)
        self.graph_replays += graph.graph is not None
        return graph.run(self._static_forward)[:batch]

    def _decoder_attention(self, layout: CanvasLayout, max_kv_len: int = 0) -> CachedAttention:
        """Keys unsplit: a canvas brings ``canvas_length`` query rows per request (64 to 256 programs per request
        at the 26B-A4B geometry) and a denoising step's time is in its expert weights, not its attention; and a
        graph of a padded bucket then sums each row's keys in the order of an eager step (the kernel's own split
        count follows the launch's request count and bounds)."""
        meta = layout.metadata(self.settings.page_size, max_kv_len)
        return CachedAttention(self.k_cache, self.v_cache, self.windows, meta, False, self.use_triton,
                               num_splits=DECODER_SPLITS)  # fmt: skip

    def _static_forward(self, canvas_ids: torch.Tensor, layout: CanvasLayout, soft: torch.Tensor) -> torch.Tensor:
        """A bucket's forward: its launch bounds are the pool's, so that one capture serves every context."""
        attention = self._decoder_attention(layout, max_kv_len=self.num_pages * self.settings.page_size)
        return self.model.decode_rows(canvas_ids, layout.positions, attention, soft)

    def _decode_eager(
        self, canvas_ids: torch.Tensor, soft: torch.Tensor | None, contexts: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        batch, canvas_length = canvas_ids.shape
        width = max(len(table) for table in tables)
        layout = CanvasLayout.empty(batch, canvas_length, width, self.settings.device)
        layout.fill(contexts, tables)
        return self.model.decode_rows(canvas_ids, layout.positions, self._decoder_attention(layout), soft)

    # ----- over several ranks ----------------------------------------------------------------------------

    def _announce(self, payload: EncodeRound | DecoderPass) -> None:
        """Tell the workers the pass about to run."""
        self.out_of_step = True  # until the launch has queued its collectives (`launch`); before the send, which
        self.workers.send_runner_pass(payload)  # an interrupt may leave half done

    @staticmethod
    def _share(canvas_ids: torch.Tensor, soft: torch.Tensor | None) -> None:
        """A decoder pass's inputs, rank 0's on every rank (each rank passes tensors of the announced shapes)."""
        ranks = engine_ranks()
        ranks.broadcast(canvas_ids)
        if soft is not None:
            ranks.broadcast(soft)

    @torch.inference_mode()
    def follow_step(self, message: StepMessage) -> torch.Tensor | None:
        """On a worker: the pass rank 0 announced, on this rank's shard; a decoder pass's hidden states (its
        device work queued, not awaited), None for an encoder forward."""
        work, device = message.payload, self.settings.device
        if isinstance(work, EncodeRound):
            self._encode_round(work.pieces, torch.tensor(work.ids, dtype=torch.long, device=device))
            return None
        config, batch = self.model.config, len(work.contexts)
        canvas_ids = torch.empty(batch, config.canvas_length, dtype=torch.long, device=device)
        soft = None
        if work.soft:
            dtype = self.model.model.decoder.embed_tokens.weight.dtype
            soft = torch.empty(batch, config.canvas_length, config.hidden_size, dtype=dtype, device=device)
        self._share(canvas_ids, soft)
        return self._decode(canvas_ids, soft, work.contexts, work.tables)

    def _seed(self, req: CanvasRequest) -> int:
        """A greedy request without a seed draws only its canvases' starting noise: all of them take the same
        seed, so that its answer depends on its prompt alone (not on its call or its place in a batch), as a
        greedy answer does with the other strategies."""
        params = req.sampling_params
        if params.seed is not None:
            return params.seed
        return self.settings.base_seed if params.greedy else self.settings.base_seed + req.req_id

    def _rule(
        self, logits: torch.Tensor, states: list[CanvasState], temperatures: list[float], seeds: list[int]
    ) -> CanvasSteps:
        """The canvas rule over one logits group ``[G, C, vocab]`` (overwritten)."""
        model = self.model
        dtype = model.model.decoder.embed_tokens.weight.dtype
        return denoise_canvases(
            logits, states, temperatures, seeds, self.settings.schedule, self.settings.vocab_limit,
            soft_embeddings=model.probs_soft_embeddings, token_soft_embeddings=model.token_soft_embeddings,
            probs_dtype=dtype,
        )  # fmt: skip

    # ----- the encoder ------------------------------------------------------------------------------------

    def _missing_pieces(self, req: CanvasRequest) -> list[tuple[int, int]]:
        """``req``'s positions ``[encoded_len, committed_len)`` in the pieces a request that was never preempted
        encoded them: the prompt, then one canvas at a time (a piece already partly in the cache, from a
        prefix-cache hit, is encoded from where the cache ends)."""
        bounds = [req.prompt_len + c * req.canvas_length for c in range(req.canvases_done + 1)]
        return [(max(lo, req.encoded_len), hi) for lo, hi in zip([0, *bounds], bounds, strict=False)
                if hi > req.encoded_len]  # fmt: skip

    def _encode_missing(self, batch: list[CanvasRequest]) -> None:
        """Encode and store every request's missing pieces, the ``r``-th piece of every request in round ``r``.
        A request whose input cannot be encoded (an image placeholder) fails alone, before anything is encoded."""
        device = self.settings.device
        pieces = {req.req_id: self._missing_pieces(req) for req in batch}
        for req in batch:
            for lo, hi in pieces[req.req_id]:
                try:
                    self.model.check_token_ids(torch.tensor(req.token_ids[lo:hi], dtype=torch.long)[None], "input_ids")
                except ValueError as err:
                    raise RequestFailure([req.req_id], f"its input cannot be encoded: {err}") from err
        rounds = max((len(p) for p in pieces.values()), default=0)
        for r in range(rounds):
            members = [req for req in batch if len(pieces[req.req_id]) > r]
            spans = [pieces[req.req_id][r] for req in members]
            for req, (_, hi) in zip(members, spans, strict=True):
                if hi > len(req.page_table) * self.settings.page_size:
                    raise RuntimeError(f"request {req.req_id}: positions up to {hi} have no page")
            round_pieces = [(req.page_table, lo, hi) for req, (lo, hi) in zip(members, spans, strict=True)]
            ids = [token for req, (lo, hi) in zip(members, spans, strict=True) for token in req.token_ids[lo:hi]]
            if self.workers is not None:
                self._announce(EncodeRound([(list(table), lo, hi) for table, lo, hi in round_pieces], ids))
            self._encode_round(round_pieces, torch.tensor(ids, dtype=torch.long, device=device))
            for req, (_, hi) in zip(members, spans, strict=True):
                req.encoded_len = hi
        for req in batch:
            for block in req.blocks[: req.canvases_done]:
                if block.end <= req.encoded_len:
                    block.status = BlockStatus.IN_CACHE

    def _encode_round(self, pieces: list[tuple[list[int], int, int]], ids: torch.Tensor) -> None:
        """One encoder forward over ``pieces`` (page table, lo, hi), whose token ids are ``ids`` in order."""
        device = self.settings.device
        meta = encoder_metadata([(lo, hi) for _, lo, hi in pieces], [t for t, _, _ in pieces],
                                self.settings.page_size, device)  # fmt: skip
        positions = torch.cat([torch.arange(lo, hi, device=device) for _, lo, hi in pieces])
        attention = CachedAttention(self.k_cache, self.v_cache, self.windows, meta, True, self.use_triton)
        self.model.encode_rows(ids, positions, attention)
