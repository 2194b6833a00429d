"""The naive reference decoder: the correctness oracle the engine is tested against, token for token.

It implements the block-diffusion decoding algorithm of ``docs/strategies.md`` for ONE request, greedily
(temperature 0), with NO KV cache: every step runs the model over the whole current sequence
``[0, running_end)`` (prompt + every existing block with its current tokens, masks included) under an
explicit boolean attention mask built by `diffulex.attention.visibility_mask`, and reads the logits of the
positions it needs. It is written with plain lists and loops, independently of ``diffulex.engine``, so that
it is obviously right; speed does not matter.

The block statuses (``ACTIVE`` / ``TO_CACHE`` / ``IN_CACHE``) are kept only because they shape the
schedule: a block that completes becomes ``TO_CACHE`` and occupies the running set for one more forward
(the store forward; with ``buffer_size=1`` that forward decodes nothing: the SingleBD store bubble), and
that forward counts as an NFE.

Readings of the doc where it leaves room (the engine must make the same choices):

* **One forward, parallel decisions.** Steps 3-4 (sample, accept) are decided from the state right after
  this step's activation, before any token of this step is written: the decodable positions of every
  block, the stop position ``p*``, and the progress of a block's previous block used by the forcing rule
  all come from that snapshot. So a block whose previous block completes in this step may not force yet,
  and tokens accepted after a stop token found in this very step are still written (they lie after ``p*``
  and are cut from the answer). ``p*`` is recomputed after the writes as the smallest decoded position
  ``>= L`` holding a stop token, so it may move earlier in a later step.
* **Threshold comparisons.** ``confidence > accept_threshold`` is evaluated the torch way, on the float32
  confidence tensor against the Python threshold (which torch casts to float32). Progress is the Python
  float ``(B - remaining) / B``, compared with ``>=`` against ``add_block_threshold`` and
  ``semi_complete_threshold``.
* **Tokens per step** counts every position written in that forward, over all blocks (including positions
  after a stop token found in the same forward).
* **Positions at or after ``end``** inside the last block are never decoded and stay masks, but they are
  part of the sequence fed to the model (the query range ends at the end of the last running block).
* **The repetition check** looks at the decoded positions from ``L`` up to the first mask (the doc's
  "answer so far"); it fires when that answer has at least ``max_repetition_run`` tokens and its last
  ``max_repetition_run`` tokens are identical.
* **Full prompt blocks** are committed (``TO_CACHE``) before the running set and are not part of it; they
  become ``IN_CACHE`` after the first forward. Only the partial prompt block (if ``L % B != 0``) starts in
  the running set, ``ACTIVE``.
* **Degenerate requests** (empty prompt, ``max_tokens < 1``, ``L >= max_model_len``, non-positive sizes or
  caps) are rejected with ``ValueError`` rather than given a made-up schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from diffulex.attention import DenseAttentionMetadata, visibility_mask
from diffulex.sampling_params import MIN_REPETITION_RUN

ACTIVE = "ACTIVE"
TO_CACHE = "TO_CACHE"
IN_CACHE = "IN_CACHE"

EOS_TOKEN_GENERATED = "eos_token_generated"
MAX_NEW_TOKENS_REACHED = "max_new_tokens_reached"
MAX_MODEL_LEN_REACHED = "max_model_len_reached"
MAX_NFE_REACHED = "max_nfe_reached"
MAX_REPETITION_RUN_REACHED = "max_repetition_run_reached"


@dataclass
class StepTrace:
    """What one forward did, so that a mismatch with the engine can be located to the step and block."""

    activated: int | None  # block activated before this forward, if any
    running: list[tuple[int, str]]  # the running set during the forward: (block index, status), oldest first
    accepted: list[tuple[int, int]]  # (absolute position, token id) written by this forward, by position


@dataclass
class ReferenceResult:
    token_ids: list[int]  # the answer: tokens from L up to the first stop token, the first mask, or end
    completion_reason: str  # one of the five reasons of the doc's step 6
    nfe: int
    tokens_per_step: list[int]  # number of tokens accepted in each forward
    final_sequence: list[int] = field(default_factory=list)  # the whole sequence at the end, masks included
    trace: list[StepTrace] = field(default_factory=list)
    # The smallest distance, over every decision taken, between what decided it and what would have flipped it: a
    # confidence and the threshold, a forced (or k-th ranked) position's confidence and the runner-up's, a written
    # token's probability and the next token's. Another correct implementation rounds differently (other kernels,
    # other summation orders: about 1e-6 in float32) and can disagree only where this is at that level, so a test
    # comparing tokens is well posed only when it is clearly larger (`decision_margin`).
    min_margin: float = float("inf")


def derived_max_nfe(max_tokens: int, block_size: int, warmup_steps: int = 8, tpf_floor: float = 1.0) -> int:
    """Cap used when ``max_nfe`` is unset; it never binds for a request making the guaranteed progress."""
    return warmup_steps + math.ceil(max_tokens / tpf_floor) + math.ceil(max_tokens / block_size) + 1


def build_attention_mask(seq_len: int, block_size: int, prefix_full: bool, prompt_len: int) -> torch.Tensor:
    """The ``[seq_len, seq_len]`` mask of a whole-sequence forward: every position queries every position."""
    positions = torch.arange(seq_len)
    return visibility_mask(positions, positions, block_size, prefix_full, prompt_len)


def model_device(model: nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


class _Request:
    """The state of one request: its tokens, its blocks' statuses and its running set, all as plain lists.

    ``tokens`` always covers exactly the existing blocks, so its length is the end of the last existing block;
    since blocks are only ever appended after the running set, that is also ``running_end``.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        mask_token_id: int,
        block_size: int,
        end: int,
        stop_token_ids: frozenset[int],
        ignore_eos: bool,
    ) -> None:
        self.mask = mask_token_id
        self.B = block_size
        self.L = len(prompt_ids)
        self.end = end
        self.stop_token_ids = stop_token_ids
        self.ignore_eos = ignore_eos
        self.tokens: list[int] = list(prompt_ids)
        self.status: list[str] = []  # status[b] of every existing block b
        self.running: list[int] = []  # block indices, oldest first
        for _ in range(self.L // self.B):
            self.status.append(TO_CACHE)  # full prompt blocks: committed, outside the running set
        if self.L % self.B != 0:
            partial = self.L // self.B
            self.tokens.extend([self.mask] * (self.B - self.L % self.B))
            self.status.append(ACTIVE)
            self.running.append(partial)

    # ----- positions -------------------------------------------------------------------------------------

    def num_blocks(self) -> int:
        return len(self.status)

    def is_decoded(self, q: int) -> bool:
        """A generated position holds a decoded token (positions of blocks not created yet count as masks)."""
        return q < len(self.tokens) and self.tokens[q] != self.mask

    def stop_position(self) -> int | None:
        """``p*``: the smallest decoded position ``>= L`` holding a stop token, unless ``ignore_eos``."""
        if self.ignore_eos:
            return None
        for q in range(self.L, len(self.tokens)):
            if self.tokens[q] != self.mask and self.tokens[q] in self.stop_token_ids:
                return q
        return None

    def decodable_positions(self, b: int) -> list[int]:
        """Positions of block ``b`` that may still be decoded: ``L <= q < end``, ``q <= p*``, still a mask."""
        p_star = self.stop_position()
        result = []
        for q in range(b * self.B, (b + 1) * self.B):
            if q < self.L or q >= self.end:
                continue
            if p_star is not None and q > p_star:
                continue
            if self.tokens[q] == self.mask:
                result.append(q)
        return result

    def progress(self, b: int) -> float:
        remaining = len(self.decodable_positions(b))
        return (self.B - remaining) / self.B

    def is_complete(self, b: int) -> bool:
        return len(self.decodable_positions(b)) == 0

    def is_committed(self, b: int) -> bool:
        return self.status[b] in (TO_CACHE, IN_CACHE)

    # ----- the answer --------------------------------------------------------------------------------------

    def answer(self) -> list[int]:
        """Tokens from ``L`` up to (not including) the first stop token, the first mask, or ``end``."""
        result = []
        for q in range(self.L, self.end):
            if not self.is_decoded(q):
                break
            token = self.tokens[q]
            if not self.ignore_eos and token in self.stop_token_ids:
                break
            result.append(token)
        return result

    def answer_so_far(self) -> list[int]:
        """The decoded positions from ``L`` up to the first mask (used by the repetition check)."""
        result = []
        q = self.L
        while self.is_decoded(q):
            result.append(self.tokens[q])
            q += 1
        return result

    # ----- the step ---------------------------------------------------------------------------------------

    def try_activate(self, buffer_size: int, add_block_threshold: float) -> int | None:
        """Step 1: append the next block as ``ACTIVE`` (all masks) if the doc's four conditions hold."""
        if self.stop_position() is not None:
            return None
        if len(self.running) >= buffer_size:
            return None
        b_next = self.num_blocks()
        if b_next * self.B >= self.end:
            return None
        if self.running and self.progress(self.running[-1]) < add_block_threshold:
            return None
        self.tokens.extend([self.mask] * self.B)
        self.status.append(ACTIVE)
        self.running.append(b_next)
        return b_next

    def forcing_allowed(self, b: int, semi_complete_threshold: float) -> bool:
        return b == 0 or self.progress(b - 1) >= semi_complete_threshold

    def retire_and_commit(self, to_cache_during_forward: list[int]) -> None:
        """Step 5: store what this forward stored, then commit completed blocks in order."""
        for b in to_cache_during_forward:
            self.status[b] = IN_CACHE
            if b in self.running:
                self.running.remove(b)
        for b in self.running:
            if self.status[b] != ACTIVE or not self.is_complete(b):
                continue
            if b == 0 or self.is_committed(b - 1):
                self.status[b] = TO_CACHE


def decision_margin(confidences: list[float], threshold: float, chosen: list[int], forced: bool, ranked_k: int | None,
                    token_gaps: list[float]) -> float:
    """`ReferenceResult.min_margin` of one block's decision (``token_gaps``: each position's top-1 minus top-2
    probability)."""
    margins = [token_gaps[i] for i in chosen]
    if ranked_k is not None:
        ordered = sorted(confidences, reverse=True)
        if len(ordered) > ranked_k:
            margins.append(ordered[ranked_k - 1] - ordered[ranked_k])
    else:
        if 0.0 < threshold < 1.0:  # a threshold outside (0, 1) decides nothing: every probability is on one side
            margins += [abs(c - threshold) for c in confidences]
        if forced and len(confidences) > 1:
            ordered = sorted(confidences, reverse=True)
            margins.append(ordered[0] - ordered[1])
    return min(margins, default=float("inf"))


def greedy_proposals(
    logits: torch.Tensor, mask_token_id: int, vocab_limit: int | None
) -> tuple[list[int], torch.Tensor]:
    """Argmax over the allowed vocabulary and its float32 softmax probability, one per row."""
    logits = logits.float().clone()
    if vocab_limit is not None:
        logits[:, vocab_limit:] = float("-inf")
    logits[:, mask_token_id] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    token_ids = torch.argmax(logits, dim=-1)
    confidences = probs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return [int(t) for t in token_ids.tolist()], confidences


def top2_gaps(logits: torch.Tensor, mask_token_id: int, vocab_limit: int | None) -> list[float]:
    """Per row, the top-1 minus the top-2 probability over the allowed vocabulary."""
    logits = logits.float().clone()
    if vocab_limit is not None:
        logits[:, vocab_limit:] = float("-inf")
    logits[:, mask_token_id] = float("-inf")
    top = torch.softmax(logits, dim=-1).topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@torch.no_grad()
def reference_generate(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    mask_token_id: int,
    block_size: int,
    buffer_size: int,
    max_tokens: int,
    max_model_len: int,
    stop_token_ids: set[int] | frozenset[int] = frozenset(),
    ignore_eos: bool = False,
    accept_threshold: float = 0.9,
    add_block_threshold: float = 0.1,
    semi_complete_threshold: float = 0.9,
    prefix_full: bool = False,
    vocab_limit: int | None = None,
    max_nfe: int | None = None,
    max_repetition_run: int | None = None,
    auto_max_nfe_warmup_steps: int = 8,
    auto_max_nfe_tpf_floor: float = 1.0,
    logits_shift: bool = False,
    force_always: bool = False,
    tokens_per_block: int | None = None,
) -> ReferenceResult:
    """Decode one request greedily by full recomputation, following ``docs/strategies.md`` step by step.

    ``model(input_ids, positions, attn_meta)`` returns hidden states and ``model.compute_logits(rows)`` the
    logits of some of their rows. Position ``q`` predicts the token at ``q``, or, with ``logits_shift``
    (Dream-style families), the token at ``q + 1``. ``force_always`` makes forcing always allowed (the
    Stable-DiffCoder rule: every sampled block takes at least its most confident position). ``tokens_per_block``
    replaces the threshold rule: every sampled block takes its ``tokens_per_block`` most confident positions (the
    earlier position first among equal confidences).
    """
    prompt_len = len(prompt_ids)
    if prompt_len == 0:
        raise ValueError("the prompt is empty")
    if block_size < 1 or buffer_size < 1:
        raise ValueError(f"block_size={block_size} and buffer_size={buffer_size} must be >= 1")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    if prompt_len >= max_model_len:
        raise ValueError(f"the prompt ({prompt_len} tokens) leaves no room in max_model_len={max_model_len}")
    if max_repetition_run is not None and max_repetition_run < MIN_REPETITION_RUN:
        raise ValueError(f"max_repetition_run={max_repetition_run} must be >= {MIN_REPETITION_RUN} or None")
    if max_nfe is None:
        max_nfe = derived_max_nfe(max_tokens, block_size, auto_max_nfe_warmup_steps, auto_max_nfe_tpf_floor)
    if max_nfe < 1:
        raise ValueError(f"max_nfe={max_nfe} must be >= 1")

    end = min(prompt_len + max_tokens, max_model_len)
    end_set_by_model_len = max_model_len < prompt_len + max_tokens
    req = _Request(prompt_ids, mask_token_id, block_size, end, frozenset(stop_token_ids), ignore_eos)
    device = model_device(model)

    nfe = 0
    min_margin = float("inf")
    tokens_per_step: list[int] = []
    trace: list[StepTrace] = []
    while True:
        # 1. Activate (before the forward).
        activated = req.try_activate(buffer_size, add_block_threshold)

        # The blocks that are TO_CACHE during this forward: they are stored by it (step 5.1).
        to_cache_during_forward = [b for b in range(req.num_blocks()) if req.status[b] == TO_CACHE]
        running_during_forward = [(b, req.status[b]) for b in req.running]

        # 3-4 decisions are taken on this snapshot, before any write of this step.
        to_sample: list[tuple[int, list[int], bool]] = []  # (block, decodable positions, forcing allowed)
        for b in req.running:
            if req.status[b] != ACTIVE:
                continue
            positions = req.decodable_positions(b)
            if positions:
                forcing = force_always or req.forcing_allowed(b, semi_complete_threshold)
                to_sample.append((b, positions, forcing))

        # 2. Forward over the whole sequence [0, running_end) with the explicit mask.
        seq_len = len(req.tokens)
        input_ids = torch.tensor(req.tokens, dtype=torch.long, device=device)
        positions_t = torch.arange(seq_len, dtype=torch.long, device=device)
        allowed = build_attention_mask(seq_len, block_size, prefix_full, prompt_len).to(device)
        hidden = model(input_ids, positions_t, DenseAttentionMetadata(allowed=allowed))

        # 3. Sample every ACTIVE block with decodable positions (greedy), 4. accept per block.
        writes: list[tuple[int, int]] = []
        for _b, positions, forcing in to_sample:
            shift = 1 if logits_shift else 0
            rows = torch.tensor([p - shift for p in positions], dtype=torch.long, device=hidden.device)
            logits = model.compute_logits(hidden[rows])
            token_ids, confidences = greedy_proposals(logits, mask_token_id, vocab_limit)
            above = (confidences > accept_threshold).tolist()
            chosen = [i for i in range(len(positions)) if above[i]]
            if tokens_per_block is not None:
                confidence_list = confidences.tolist()
                ranked = sorted(range(len(positions)), key=lambda i: (-confidence_list[i], i))
                chosen = sorted(ranked[:tokens_per_block])
            elif not chosen and forcing:
                confidence_list = confidences.tolist()
                best = 0  # strict ">" keeps the first position among equals
                for i in range(1, len(positions)):
                    if confidence_list[i] > confidence_list[best]:
                        best = i
                chosen = [best]
            forced = tokens_per_block is None and not any(above) and forcing
            gaps = top2_gaps(logits, mask_token_id, vocab_limit)
            margin = decision_margin(confidences.tolist(), accept_threshold, chosen, forced, tokens_per_block, gaps)
            min_margin = min(min_margin, margin)
            writes.extend((positions[i], token_ids[i]) for i in chosen)
        for q, token in writes:
            req.tokens[q] = token

        # 5. Retire, then commit.
        req.retire_and_commit(to_cache_during_forward)

        # 6. Count and stop.
        nfe += 1
        tokens_per_step.append(len(writes))
        trace.append(StepTrace(activated, running_during_forward, sorted(writes)))
        reason = _completion_reason(req, nfe, max_nfe, max_repetition_run, end_set_by_model_len)
        if reason is not None:
            return ReferenceResult(
                token_ids=req.answer(),
                completion_reason=reason,
                nfe=nfe,
                tokens_per_step=tokens_per_step,
                final_sequence=list(req.tokens),
                trace=trace,
                min_margin=min_margin,
            )


def _completion_reason(
    req: _Request, nfe: int, max_nfe: int, max_repetition_run: int | None, end_set_by_model_len: bool
) -> str | None:
    """The doc's step-6 checks, in the doc's order; ``None`` while the request goes on."""
    p_star = req.stop_position()
    if p_star is not None and all(req.is_decoded(q) for q in range(req.L, p_star)):
        return EOS_TOKEN_GENERATED
    if all(req.is_decoded(q) for q in range(req.L, req.end)):
        return MAX_MODEL_LEN_REACHED if end_set_by_model_len else MAX_NEW_TOKENS_REACHED
    if nfe >= max_nfe:
        return MAX_NFE_REACHED
    if max_repetition_run is not None:
        so_far = req.answer_so_far()
        tail = so_far[-max_repetition_run:]
        if len(tail) == max_repetition_run and len(set(tail)) == 1:
            return MAX_REPETITION_RUN_REACHED
    return None


def reference_for_engine(
    llm, prompt_ids: list[int], params, *, force_always: bool = False, tokens_per_block: int | None = None
) -> ReferenceResult:
    """Decode ``prompt_ids`` with the reference decoder under exactly the settings of engine ``llm``.

    The one place that maps an engine's config, tokenizer-derived ids and SamplingParams onto the oracle's
    arguments, so every engine-vs-reference test compares the same thing.
    """
    cfg, th = llm.config, llm.config.decoding_thresholds
    return reference_generate(
        llm.model,
        prompt_ids,
        mask_token_id=llm.mask_token_id,
        block_size=cfg.block_size,
        buffer_size=cfg.buffer_size,
        max_tokens=params.max_tokens,
        max_model_len=cfg.max_model_len,
        stop_token_ids=llm.settings.stop_token_ids,
        ignore_eos=params.ignore_eos,
        accept_threshold=th.accept_threshold,
        add_block_threshold=th.add_block_threshold,
        semi_complete_threshold=th.semi_complete_threshold,
        prefix_full=bool(cfg.multi_block_prefix_full),
        vocab_limit=llm.vocab_limit,
        max_nfe=params.max_nfe,
        max_repetition_run=params.max_repetition_run,
        logits_shift=llm.settings.logits_shift,
        force_always=force_always,
        tokens_per_block=tokens_per_block,
    )
