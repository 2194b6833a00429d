"""The engine step of DiffusionGemma: the model is an encoder and a canvas decoder, not the block-causal forward
the engine's `ModelRunner` drives, so the strategy brings its own runner (`Strategy.make_runner`).

The encoder K/V lives in a page pool like every strategy's K/V: per layer ``[num_pages, page_size, kv_heads,
head_dim]`` (each layer its own head geometry; sliding layers store every position too, since a request that
shares a prefix reads the window before its own start). A request's position ``p`` is in page
``page_table[p // page_size]``; the KV cache manager hands out pages, registers full pages of final tokens and
finds them again for a later request with the same prefix (prompts, and prompts followed by finished canvases).

One step, for a batch of requests that each have a running canvas:

1. each request's missing K/V is encoded and stored, one piece at a time, the pieces a request that was never
   preempted encoded: the rest of its prompt, then every canvas it has committed since; each piece reads the K/V
   before it from the pages (full layers: all of it; sliding layers: the last ``window - 1`` positions);
2. one decoder pass over every request's canvas together (`DiffusionGemmaForDiffusionLM.denoise_hidden`: rows of
   equal shape, each after its own context read from its pages);
3. per request: logits, then its canvas step (`diffulex.strategy.diffusion_gemma.canvas.denoise_canvas`) with
   its own temperature and random streams; the outcome is proposed to the request and adopted when the engine
   applies the step.

The pages are read by gathering them into dense tensors (the PyTorch path; a paged attention kernel would read
them in place).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from diffulex.errors import RequestFailure
from diffulex.models.diffusion_gemma import DiffusionGemmaForDiffusionLM, EncoderKV
from diffulex.sampler.rows import PendingWrites
from diffulex.strategy.block import BlockStatus
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


class CanvasRunner:
    """What the engine calls on a runner (`diffulex.strategy.strategy.StepRunner`), for DiffusionGemma."""

    can_continue = False  # every step's outcome is decided on the host

    def __init__(self, settings: CanvasRunnerSettings, model: DiffusionGemmaForDiffusionLM) -> None:
        self.settings = settings
        self.model = model
        self.num_pages = 0
        self.k_cache: list[torch.Tensor] = []  # per layer [num_pages, page_size, kv_heads, head_dim]
        self.v_cache: list[torch.Tensor] = []
        self.window = model.config.sliding_window

    # ----- memory ---------------------------------------------------------------------------------------

    def page_bytes(self) -> int:
        """Bytes of encoder K/V one page of positions takes, over all layers."""
        itemsize = torch.empty((), dtype=self.settings.kv_dtype).element_size()
        per_position = sum(2 * g.num_kv_heads * g.head_dim for g in self.model.config.layers)
        return per_position * self.settings.page_size * itemsize

    def allocate_kv_cache(self, num_pages: int) -> None:
        s = self.settings
        self.k_cache, self.v_cache = [], []
        for geometry in self.model.config.layers:
            shape = (num_pages, s.page_size, geometry.num_kv_heads, geometry.head_dim)
            self.k_cache.append(torch.zeros(shape, dtype=s.kv_dtype, device=s.device))
            self.v_cache.append(torch.zeros(shape, dtype=s.kv_dtype, device=s.device))
        self.num_pages = num_pages

    def release_kv_cache(self) -> None:
        self.k_cache, self.v_cache = [], []
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

    # ----- one step ---------------------------------------------------------------------------------------

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
            shape = (model.config.canvas_length, model.config.hidden_size)
            zeros = torch.zeros(shape, dtype=model.model.decoder.embed_tokens.weight.dtype, device=s.device)
            soft = torch.stack([zeros if state.soft_embeds is None else state.soft_embeds for state in states])
        contexts = [self._context(req, req.encoded_len) for req in batch]
        hidden = model.denoise_hidden(canvas_ids, contexts, soft)
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
        """Encode and store ``req``'s positions ``[encoded_len, committed_len)`` in the pieces a request that was
        never preempted encoded them: the prompt, then one canvas at a time (a piece already partly in the cache,
        from a prefix-cache hit, is encoded from where the cache ends)."""
        bounds = [req.prompt_len + c * req.canvas_length for c in range(req.canvases_done + 1)]
        for lo, hi in zip([0, *bounds], bounds, strict=False):
            if hi <= req.encoded_len:
                continue
            lo = max(lo, req.encoded_len)
            self._encode_piece(req, lo, hi)
            req.encoded_len = hi
        for block in req.blocks[: req.canvases_done]:
            if block.end <= req.encoded_len:
                block.status = BlockStatus.IN_CACHE

    def _encode_piece(self, req: CanvasRequest, lo: int, hi: int) -> None:
        ids = torch.tensor([req.token_ids[lo:hi]], dtype=torch.long, device=self.settings.device)
        try:
            encoded = self.model.encode(ids, self._context(req, lo), keep_all_positions=True)
        except ValueError as err:  # e.g. an image placeholder in the prompt: this request alone fails
            raise RequestFailure([req.req_id], f"its input cannot be encoded: {err}") from err
        slots = self._slots(req, lo, hi)
        for layer, (keys, values) in enumerate(zip(encoded.keys, encoded.values, strict=True)):
            self.k_cache[layer].view(-1, *keys.shape[2:])[slots] = keys[0, lo - hi :]
            self.v_cache[layer].view(-1, *values.shape[2:])[slots] = values[0, lo - hi :]

    def _context(self, req: CanvasRequest, length: int) -> EncoderKV | None:
        """The K/V of ``req``'s positions ``[0, length)`` read from its pages, as the decoder and the encoder's next
        piece see them: every position for full-attention layers, the last ``window - 1`` for sliding ones."""
        if length == 0:
            return None
        keys, values = [], []
        for layer, geometry in enumerate(self.model.config.layers):
            kept = min(self.window - 1, length) if geometry.is_sliding else length
            slots = self._slots(req, length - kept, length)
            keys.append(self.k_cache[layer].view(-1, *self.k_cache[layer].shape[2:])[slots][None])
            values.append(self.v_cache[layer].view(-1, *self.v_cache[layer].shape[2:])[slots][None])
        return EncoderKV(tuple(keys), tuple(values), length)

    def _slots(self, req: CanvasRequest, lo: int, hi: int) -> torch.Tensor:
        """Cache rows of ``req``'s positions ``[lo, hi)``."""
        page_size = self.settings.page_size
        table = torch.tensor(req.page_table, dtype=torch.long, device=self.settings.device)
        positions = torch.arange(lo, hi, device=self.settings.device)
        if hi > len(req.page_table) * page_size:
            raise RuntimeError(f"request {req.req_id}: positions up to {hi} have no page")
        return table[positions // page_size] * page_size + positions % page_size
