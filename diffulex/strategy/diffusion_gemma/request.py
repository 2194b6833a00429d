"""The state of one DiffusionGemma request: its prompt, the canvases it has finished, the canvas it is denoising,
and how much of it the encoder has written into its KV pages.

Token list: the prompt, then every canvas in order; the running canvas's span shows its latest argmax (what a
viewer sees while it is denoised). A canvas is one block of ``canvas_length`` positions that starts right after
the tokens before it (canvases are not aligned to the block grid of other strategies), and it is committed as a
whole when its denoising ends. The answer is the committed canvases, cut before the first stop token and at
``max_tokens`` (and ``max_model_len``).

The encoder K/V lives in the request's pages (``page_table``, given by the KV cache manager): positions
``[0, encoded_len)`` are written (by the runner, `diffulex.strategy.diffusion_gemma.runner`, or found by a
prefix-cache hit), and the full pages among them are registered for reuse, like every strategy's committed blocks.
The runner also proposes each step's outcome (``proposed``), which `apply_tokens` adopts when the engine applies
the step: a step that is dropped leaves the request as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from diffulex.strategy.block import Block, BlockStatus
from diffulex.strategy.diffusion_gemma.canvas import CanvasState, CanvasStep
from diffulex.strategy.request import CompletionReason, Request, SampleTarget


@dataclass(eq=False)
class CanvasRequest(Request):
    """A `Request` whose blocks are canvases: the scheduler, KV cache manager and engine read it as any request
    (query range, committed length, running set, answer), while what a step does to it is DiffusionGemma's."""

    supports_prefill_chunks = False  # its prompt is encoded whole, before its canvases

    canvas_length: int = field(init=False)
    num_canvases: int = field(init=False)  # canvases needed to reach the generation end
    canvases_done: int = field(init=False, default=0)  # committed canvases
    canvas: CanvasState | None = field(init=False, default=None)  # the running canvas's state, None before step 1
    proposed: CanvasStep | None = field(init=False, default=None)  # the launched step's outcome, until applied
    # how many of the running canvas's latest applied steps showed the same argmax (0 before its first) and the mean
    # entropy of the latest: what the host knows of whether the step after them may end the canvas
    # (`CanvasRunner.can_continue`)
    steady_argmaxes: int = field(init=False, default=0)
    latest_mean_entropy: float = field(init=False, default=0.0)
    encoded_len: int = field(init=False, default=0)  # positions whose encoder K/V is in the request's pages
    prefix_hit_len: int = field(init=False, default=0)  # of those, supplied by a prefix-cache hit at admission

    def __post_init__(self) -> None:
        sp, strategy = self.sampling_params, "decoding_strategy='diffusion_gemma'"
        for name, neutral in (("top_p", 1.0), ("top_k", 0)):
            if getattr(sp, name) != neutral:
                raise ValueError(
                    f"{name}={getattr(sp, name)} is not supported with {strategy}: its canvases are sampled by the "
                    f"entropy-bound rule of the checkpoint (leave {name} at {neutral})"
                )
        s = self.settings
        self.canvas_length = s.block_size
        self.prompt_len = len(self.prompt_token_ids)
        self.generation_end = min(self.prompt_len + self.sampling_params.max_tokens, s.max_model_len)
        self.num_canvases = math.ceil(max(self.generation_end - self.prompt_len, 0) / self.canvas_length)
        self.max_nfe = self.sampling_params.max_nfe or 0  # 0: no cap (a canvas ends after max_denoising_steps)
        self.token_ids = list(self.prompt_token_ids)
        self.blocks = []
        self.running = []
        self.frontier = self.prompt_len

    # ----- derived quantities -------------------------------------------------------------------------

    @property
    def committed_len(self) -> int:
        """End of the last committed canvas: the positions whose K/V the next canvas's context holds."""
        return self.prompt_len + self.canvases_done * self.canvas_length

    @property
    def num_cached_tokens(self) -> int:
        """Positions whose K/V is in the cache (what the KV cache manager registers, in whole pages)."""
        return self.encoded_len

    @property
    def answer_end(self) -> int:
        """The committed canvases, up to the first stop token and the generation end."""
        return max(self.prompt_len, min(self.committed_len, self.decode_limit))

    # ----- running-set policy --------------------------------------------------------------------------

    def maybe_activate_block(self) -> bool:
        """Open the next canvas when none is running, no stop token was committed and one is still due. Its
        span shows the mask token until its first step reports an argmax."""
        if self.running or self.stop_pos is not None or self.canvases_done >= self.num_canvases:
            return False
        block = Block(len(self.blocks), len(self.token_ids), self.canvas_length, BlockStatus.ACTIVE)
        self.token_ids.extend([self.settings.mask_token_id] * self.canvas_length)
        self.blocks.append(block)
        self.running = [block]
        self.canvas = None
        self.steady_argmaxes = 0
        return True

    def query_range(self) -> tuple[int, int]:
        """What the next step computes: the positions still to encode, then the running canvas."""
        end = self.running[-1].end if self.running else self.committed_len
        return self.encoded_len, end

    def sample_targets(self) -> list[SampleTarget]:
        return []  # the canvas runner decides every position itself; no mask-filling rows

    def next_step_has_same_rows(self) -> bool:
        """Whether the step after the one about to run denoises the same canvas with nothing to encode, unless that
        step ends the canvas: everything before the canvas is encoded and the request does not reach its ``max_nfe``.
        Whether the step about to run can end the canvas is the runner's question (`CanvasRunner.can_continue`: the
        schedule's last step, the stability threshold)."""
        if not self.running or self.encoded_len != self.committed_len:
            return False
        return not self.max_nfe or self.nfe + 1 < self.max_nfe

    # ----- after the forward -----------------------------------------------------------------------------

    def apply_tokens(self, writes: list[tuple[int, int]]) -> int:
        """Adopt the applied step's outcome (``proposed``): show its argmax in the running canvas and, when the
        canvas ended, commit it. Returns the answer tokens it committed (0 while the canvas is denoised)."""
        outcome = self.proposed
        if outcome is None or not self.running:
            raise RuntimeError(f"request {self.req_id}: a step was applied that was not launched for it")
        self.proposed = None
        block = self.running[0]
        shown = self.token_ids[block.start : block.end]
        for pos, token in writes:
            self.token_ids[pos] = token
        steady = self.steady_argmaxes > 0 and self.token_ids[block.start : block.end] == shown
        self.steady_argmaxes = self.steady_argmaxes + 1 if steady else 1
        self.latest_mean_entropy = outcome.mean_entropy
        if not outcome.finished:
            self.canvas = outcome.state
            return 0
        self.canvas = None
        self.running = []
        block.status = BlockStatus.TO_CACHE  # its K/V is written when the next canvas's step encodes it
        self.canvases_done += 1
        end = min(block.end, self.generation_end)
        if not self.sampling_params.ignore_eos:
            stops = self.settings.stop_token_ids
            self.stop_pos = next((p for p in range(block.start, end) if self.token_ids[p] in stops), None)
        self.frontier = self.committed_len
        filled = min(end, self.decode_limit) - block.start
        self.num_new_tokens_total += filled
        return filled

    def retire_and_commit(self) -> None:
        """Nothing to do: a canvas commits in `apply_tokens`, when its denoising ends."""

    def check_completion(self) -> CompletionReason | None:
        reason = self._completion()
        if reason is not None:  # never read again: free it now
            self.canvas = None
        return reason

    def _completion(self) -> CompletionReason | None:
        if self.stop_pos is not None:
            return CompletionReason.EOS
        if self.canvases_done >= self.num_canvases:
            return self.length_reason()
        if self.max_nfe and self.nfe >= self.max_nfe:
            return CompletionReason.MAX_NFE
        return self.repetition_reason()

    # ----- preemption ------------------------------------------------------------------------------------

    def forget_cache(self) -> None:
        """The request lost its pages: its encoder K/V is encoded again (prompt, then each committed canvas, in the
        same pieces, so with the same values) when it runs next, but for what a prefix-cache hit supplies. The
        running canvas keeps its state, so the request's tokens do not change."""
        for block in self.blocks:
            if block.status is BlockStatus.IN_CACHE:
                block.status = BlockStatus.TO_CACHE
        self.encoded_len = 0
        self.proposed = None
        self.num_preemptions += 1

    def mark_prefix_cached(self, num_tokens: int) -> None:
        """A prefix-cache hit supplied the K/V of the first ``num_tokens`` positions (whole pages)."""
        self.encoded_len = self.prefix_hit_len = num_tokens
        for block in self.blocks:
            if block.end <= num_tokens and block.is_committed:
                block.status = BlockStatus.IN_CACHE
