"""The engine step of DiffusionGemma: the model is an encoder and a canvas decoder, not the block-causal forward
over paged K/V the engine's `ModelRunner` drives, so the strategy brings its own runner (`Strategy.make_runner`).

One step, for a batch of requests that each have a running canvas:

1. each request's encoder context is brought up to date, one piece at a time: the prompt (or the K/V another
   request with the same prompt encoded, when prefix caching is on), then every canvas it has committed since;
2. one decoder pass over every request's canvas together (`DiffusionGemmaForDiffusionLM.denoise_hidden`: rows of
   equal shape, each after its own context);
3. per request: logits, then its canvas step (`diffulex.strategy.diffusion_gemma.canvas.denoise_canvas`) with
   its own temperature and random streams; the outcome is proposed to the request and adopted when the engine
   applies the step.

The encoder K/V lives in per-request tensors (`EncoderKV`), not in the engine's page pool: the pool's pages only
account for it (one page per canvas of positions), so admission and preemption work as for every strategy. A
preempted request drops its K/V and encodes it again in the same pieces, so its tokens do not change.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from diffulex.errors import RequestFailure
from diffulex.models.diffusion_gemma import DiffusionGemmaForDiffusionLM, EncoderKV
from diffulex.sampler.rows import PendingWrites
from diffulex.strategy.diffusion_gemma.canvas import (
    CanvasSchedule,
    CanvasState,
    CanvasStep,
    denoise_canvas,
    fresh_state,
)
from diffulex.strategy.diffusion_gemma.request import CanvasRequest

logger = logging.getLogger("diffulex")


@dataclass(frozen=True)
class CanvasRunnerSettings:
    device: torch.device
    kv_dtype: torch.dtype
    page_size: int
    vocab_limit: int  # ids at or above this are never drawn
    base_seed: int  # the seed of requests that bring none (``base_seed + req_id``)
    schedule: CanvasSchedule
    prompt_cache_entries: int  # encoded prompts kept for reuse; 0: prefix caching off


class PromptCache:
    """Encoded prompts by their tokens, least recently used dropped first. An `EncoderKV` is immutable, so
    requests with the same prompt share one (the same tensors, hence the same values as encoding it again)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], EncoderKV] = OrderedDict()
        self.hits = 0

    def get(self, tokens: tuple[int, ...]) -> EncoderKV | None:
        context = self._entries.get(tokens)
        if context is not None:
            self._entries.move_to_end(tokens)
            self.hits += 1
        return context

    def put(self, tokens: tuple[int, ...], context: EncoderKV) -> None:
        if self.capacity <= 0:
            return
        self._entries[tokens] = context
        self._entries.move_to_end(tokens)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


class CanvasRunner:
    """What the engine calls on a runner (`diffulex.strategy.strategy.StepRunner`), for DiffusionGemma."""

    can_continue = False  # every step's outcome is decided on the host

    def __init__(self, settings: CanvasRunnerSettings, model: DiffusionGemmaForDiffusionLM) -> None:
        self.settings = settings
        self.model = model
        self.num_pages = 0
        self.prompt_cache = PromptCache(settings.prompt_cache_entries)

    # ----- memory ---------------------------------------------------------------------------------------

    def page_bytes(self) -> int:
        """Bytes of encoder K/V one page of positions may take, over all layers (an upper bound: a sliding layer
        keeps only its window)."""
        itemsize = torch.empty((), dtype=self.settings.kv_dtype).element_size()
        per_position = sum(2 * g.num_kv_heads * g.head_dim for g in self.model.config.layers)
        return per_position * self.settings.page_size * itemsize

    def allocate_kv_cache(self, num_pages: int) -> None:
        """The K/V is held per request; the pages only count it."""
        self.num_pages = num_pages

    def release_kv_cache(self) -> None:
        self.prompt_cache.clear()
        self.num_pages = 0

    def warm_up_attention(self) -> None:
        """Nothing compiles on this path."""

    def warm_up_sampling(self, max_rows: int, dtype: torch.dtype) -> None:
        """Nothing compiles on this path."""

    def forget_launches(self) -> None:
        """A dropped step left its requests as they were (its outcomes are only proposed)."""

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_model_len: int, num_sample_rows: int) -> None:
        """The activation peak the memory planner measures: a prompt of ``min(num_tokens, max_model_len)``
        positions encoded, then a step of as many canvases as ``num_sample_rows`` rows hold, after it."""
        config, device = self.model.config, self.settings.device
        context = self.model.encode(torch.zeros(1, min(num_tokens, max_model_len), dtype=torch.long, device=device))
        rows = max(1, num_sample_rows // config.canvas_length)
        canvas = torch.zeros(rows, config.canvas_length, dtype=torch.long, device=device)
        hidden = self.model.denoise_hidden(canvas, [context] * rows)
        self.model.logits(hidden[:1])

    def token_embedding(self) -> torch.nn.Embedding:
        return self.model.model.decoder.embed_tokens

    # ----- one step ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: list[CanvasRequest]) -> dict[int, list[tuple[int, int]]]:
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: list[CanvasRequest], micro_batch: int = 0) -> PendingWrites:
        """Encode what each request still needs, denoise every canvas in one decoder pass, and propose each
        request's outcome; the writes show each canvas's new argmax."""
        s, model = self.settings, self.model
        for req in batch:
            self._encode_missing(req)
        states = [
            req.canvas
            if req.canvas is not None
            else fresh_state(self._seed(req), req.canvases_done, req.canvas_length, s.vocab_limit, s.device)
            for req in batch
        ]
        canvas_ids = torch.stack([state.tokens for state in states])
        soft = None
        if any(state.soft_embeds is not None for state in states):
            zeros = torch.zeros(req.canvas_length, model.config.hidden_size, dtype=s.kv_dtype, device=s.device)
            soft = torch.stack([zeros if state.soft_embeds is None else state.soft_embeds for state in states])
        hidden = model.denoise_hidden(canvas_ids, [req.context for req in batch], soft)
        writes: dict[int, list[tuple[int, int]]] = {}
        for row, (req, state) in enumerate(zip(batch, states, strict=True)):
            step = self._canvas_step(req, state, model.logits(hidden[row]))
            req.proposed = step
            start = req.running[0].start
            writes[req.req_id] = list(enumerate(step.argmax.tolist(), start))
        return PendingWrites(writes)

    def launch_continuation(self, micro_batch: int) -> PendingWrites:
        raise RuntimeError("a DiffusionGemma step cannot be continued on the device")

    def _seed(self, req: CanvasRequest) -> int:
        seed = req.sampling_params.seed
        return seed if seed is not None else self.settings.base_seed + req.req_id

    def _canvas_step(self, req: CanvasRequest, state: CanvasState, logits: torch.Tensor) -> CanvasStep:
        model = self.model
        dtype = model.model.decoder.embed_tokens.weight.dtype
        try:
            return denoise_canvas(
                logits, state, self.settings.schedule, req.sampling_params.temperature, self.settings.vocab_limit,
                self._seed(req),
                soft_embeddings=lambda scaled: model.soft_embeddings(scaled.to(dtype)),
                token_soft_embeddings=model.token_soft_embeddings,
            )  # fmt: skip
        except RuntimeError as err:  # e.g. a distribution torch cannot draw from: this request alone fails
            raise RequestFailure([req.req_id], f"denoising its canvas failed: {err}") from err

    def _encode_missing(self, req: CanvasRequest) -> None:
        """Bring ``req.context`` up to its committed canvases, in the pieces a request that was never preempted
        encoded them: the prompt, then one canvas at a time."""
        if req.context is None:
            prompt = tuple(req.prompt_token_ids)
            context = self.prompt_cache.get(prompt)
            if context is None:
                context = self._encode(req, list(prompt), None)
                self.prompt_cache.put(prompt, context)
            req.context, req.context_canvases = context, 0
        while req.context_canvases < req.canvases_done:
            tokens = req.canvas_tokens(req.context_canvases)
            req.context = self._encode(req, tokens, req.context)
            req.context_canvases += 1

    def _encode(self, req: CanvasRequest, tokens: list[int], context: EncoderKV | None) -> EncoderKV:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.settings.device)
        try:
            return self.model.encode(ids, context)
        except ValueError as err:  # e.g. an image placeholder in the prompt: this request alone fails
            raise RequestFailure([req.req_id], f"its input cannot be encoded: {err}") from err
