"""The Fast-dLLM v2 reference decoder: the oracle for the ``fast_dllm_v2`` strategy, one request, greedy.

Like `diffulex.testing.reference_decoder` it keeps no KV cache: every forward runs the model over the whole
sequence ``[0, block end)`` under an explicit mask and reads the rows it needs, with plain lists and loops,
independently of ``diffulex.engine``. The algorithm is the one of the Fast-dLLM v2 authors' generation loop
(``batch_sample``), for one request:

* The sequence is cut into blocks of ``block_size`` tokens (``B*K``, e.g. 32), each into ``K`` sub-blocks of
  ``sub_block_size`` (``B``, e.g. 8). Attention is block-causal at the block: a position sees every position of
  its own block and of the blocks before it.
* The model predicts shifted: the row at position ``p - 1`` predicts the token at ``p``. (The row of a block's
  first position would predict it from itself, but that position is never a mask: it holds the prompt or the
  token predicted from the block before.)
* A block is decoded sub-block by sub-block, left to right. While the current sub-block has masks, one forward
  samples them: each mask takes its greedy token when the token's probability is above ``threshold``, and the most
  probable one is always taken (at least one token per forward).
* Once every position of a block is decoded, a commit forward stores the block's final K/V and its last row
  predicts the first token of the next block (greedy), which is written there. A prompt whose length is a multiple
  of ``block_size`` gets the same forward for its last block (the authors' prefill).
* **Block cache** (``use_block_cache``, the authors' DualCache): a forward over the whole block is run when the
  block has none yet, and whenever the current sub-block starts with a mask; its K/V of the block's positions is
  kept. Every other forward recomputes only the current sub-block: its rows attend to the prefix and to the block
  through the kept K/V, in which only the current sub-block's entries are fresh. The kept K/V of the other
  sub-blocks was computed from the tokens the current sub-block had then, so it is stale (at every layer after
  the first). Here that is modelled without a cache (`DenseAttentionMetadata.stale_kv`): the whole sequence is
  run, and at every layer the K/V of the block's other positions is replaced by the kept one.

Decisions where the authors' loop leaves room (the engine makes the same ones):

* Positions at or after ``end = min(L + max_tokens, max_model_len)`` are never decoded; they stay masks inside
  the forward (the authors decode the whole last block and cut the answer afterwards).
* The request finishes when a stop token is decoded, every position before it is decoded and the sub-block that
  holds it is complete (the authors finish the block first; the later sub-blocks lie after the stop token and
  cannot change the answer), or when ``[L, end)`` is decoded. A finished request takes no commit forward.
* When ``L`` is not a multiple of ``block_size``, the prompt's full blocks and the first decoding forward are one
  forward (block-causal attention makes it equal to the authors' separate prefill).
* The commit forward's next-token prediction excludes the mask id and ids beyond the tokenizer, as every other
  sample does.
* NFE counts every forward, the commit forwards included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from diffulex.attention import DenseAttentionMetadata
from diffulex.testing.reference_decoder import (
    EOS_TOKEN_GENERATED,
    MAX_MODEL_LEN_REACHED,
    MAX_NEW_TOKENS_REACHED,
    MAX_NFE_REACHED,
    build_attention_mask,
    decision_margin,
    greedy_proposals,
    model_device,
    top2_gaps,
)

INIT = "INIT"  # a forward over the whole block (keeps its K/V when the block cache is on)
REFINE = "REFINE"  # a forward in which only the current sub-block is fresh (block cache on)
COMMIT = "COMMIT"  # the forward after a block is complete: stores it and predicts the next block's first token


@dataclass
class FDv2Step:
    """One forward: its kind, the sub-block it sampled (None for a commit) and the tokens it wrote."""

    kind: str
    sub_block_start: int | None
    written: list[tuple[int, int]]  # (position, token), by position


@dataclass
class FDv2Result:
    token_ids: list[int]  # the answer: from L up to the first stop token or end
    completion_reason: str
    nfe: int
    steps: list[FDv2Step] = field(default_factory=list)
    final_sequence: list[int] = field(default_factory=list)
    # How close the closest decision came to going the other way: a confidence and the threshold, the forced
    # position's confidence and the runner-up's, a written token's probability and the next token's. An engine
    # that rounds differently (other kernels, other summation orders) can disagree only where this is at the level
    # of its rounding, so a token comparison is well posed only when it is clearly larger.
    min_margin: float = float("inf")


@torch.no_grad()
def reference_generate_fast_dllm_v2(
    model: nn.Module,
    prompt_ids: list[int],
    *,
    mask_token_id: int,
    block_size: int,
    sub_block_size: int,
    max_tokens: int,
    max_model_len: int,
    threshold: float = 0.9,
    use_block_cache: bool = True,
    stop_token_ids: set[int] | frozenset[int] = frozenset(),
    ignore_eos: bool = False,
    vocab_limit: int | None = None,
    max_nfe: int | None = None,
) -> FDv2Result:
    """Decode one request as the module docstring says. ``model(input_ids, positions, attn_meta)`` returns hidden
    states, ``model.compute_logits(rows)`` their logits; ``threshold`` is compared with ``>`` on float32."""
    prompt_len = len(prompt_ids)
    if prompt_len == 0 or max_tokens < 1 or prompt_len >= max_model_len:
        raise ValueError("the prompt must be non-empty, leave room in max_model_len, and max_tokens must be >= 1")
    if sub_block_size < 1 or block_size % sub_block_size:
        raise ValueError(f"block_size={block_size} must be a positive multiple of sub_block_size={sub_block_size}")
    end = min(prompt_len + max_tokens, max_model_len)
    if max_nfe is None:  # every forward decodes at least one token, plus one commit forward per block
        max_nfe = max_tokens + -(-max_tokens // block_size) + 2
    stops = frozenset() if ignore_eos else frozenset(stop_token_ids)
    device = model_device(model)
    tokens = list(prompt_ids)
    steps: list[FDv2Step] = []
    margins: list[float] = []

    def forward(length: int, stale: tuple[list, torch.Tensor] | None, record: list | None) -> torch.Tensor:
        ids = torch.tensor(tokens[:length], dtype=torch.long, device=device)
        positions = torch.arange(length, dtype=torch.long, device=device)
        meta = DenseAttentionMetadata(allowed=build_attention_mask(length, block_size, False, prompt_len).to(device))
        if stale is not None:
            meta.stale_kv, meta.stale_rows = stale
        meta.recorded_kv = record
        return model(ids, positions, meta)

    def answer_and_reason() -> tuple[list[int], str | None]:
        """The answer so far and, if the request is finished, why (checked after every forward)."""
        for p in range(prompt_len, end):
            if p >= len(tokens) or tokens[p] == mask_token_id:  # not decoded (a later block's, or a mask)
                return tokens[prompt_len:p], None
            if tokens[p] in stops:
                sub_start = p - (p % sub_block_size)
                sub_end = min(sub_start + sub_block_size, end)
                done = all(tokens[q] != mask_token_id for q in range(sub_start, sub_end))
                return tokens[prompt_len:p], (EOS_TOKEN_GENERATED if done else None)
        full = end == prompt_len + max_tokens
        return tokens[prompt_len:end], (MAX_NEW_TOKENS_REACHED if full else MAX_MODEL_LEN_REACHED)

    def commit(block_end: int) -> None:
        """The commit forward of the complete block ending at ``block_end``: predict the next block's first token."""
        hidden = forward(block_end, None, None)
        logits = model.compute_logits(hidden[block_end - 1 : block_end])
        token, _ = greedy_proposals(logits, mask_token_id, vocab_limit)
        margins.extend(top2_gaps(logits, mask_token_id, vocab_limit))
        tokens.append(token[0])  # block_end < end: a block reaching end finishes the request before its commit
        steps.append(FDv2Step(COMMIT, None, [(block_end, token[0])]))

    def result(reason: str) -> FDv2Result:
        answer, _ = answer_and_reason()
        return FDv2Result(answer, reason, len(steps), steps, list(tokens), min(margins, default=float("inf")))

    if prompt_len % block_size == 0:  # the prompt's last block is complete: its commit forward seeds the next
        commit(prompt_len)
    while True:
        block_start = len(tokens) - len(tokens) % block_size
        block_end = block_start + block_size
        tokens.extend([mask_token_id] * (block_end - len(tokens)))
        kept: list | None = None  # the block cache: K/V of every attention call of the last INIT forward
        for sub_start in range(block_start, block_end, sub_block_size):
            sub_end = min(sub_start + sub_block_size, end)
            while any(tokens[q] == mask_token_id for q in range(sub_start, sub_end)):
                if len(steps) >= max_nfe:
                    return result(MAX_NFE_REACHED)
                masks = [q for q in range(sub_start, sub_end) if tokens[q] == mask_token_id]
                full = not use_block_cache or kept is None or tokens[sub_start] == mask_token_id
                if full:
                    record = [] if use_block_cache else None
                    hidden = forward(block_end, None, record)
                    kept = record if use_block_cache else None
                else:
                    stale_rows = torch.zeros(block_end, dtype=torch.bool)
                    stale_rows[block_start:block_end] = True
                    stale_rows[sub_start : sub_start + sub_block_size] = False
                    hidden = forward(block_end, (kept, stale_rows), None)
                rows = torch.tensor([q - 1 for q in masks], dtype=torch.long, device=hidden.device)
                logits = model.compute_logits(hidden[rows])
                guesses, conf = greedy_proposals(logits, mask_token_id, vocab_limit)
                confident, confidences = (conf > threshold).tolist(), conf.tolist()
                best = max(range(len(masks)), key=lambda i: (confidences[i], -i))  # the first among equals
                chosen = sorted({best, *(i for i in range(len(masks)) if confident[i])})
                gaps = top2_gaps(logits, mask_token_id, vocab_limit)
                margins.append(decision_margin(confidences, threshold, chosen, not any(confident), None, gaps))
                for i in chosen:
                    tokens[masks[i]] = guesses[i]
                steps.append(FDv2Step(INIT if full else REFINE, sub_start, [(masks[i], guesses[i]) for i in chosen]))
            _, reason = answer_and_reason()
            if reason is not None:
                return result(reason)
        if len(steps) >= max_nfe:
            return result(MAX_NFE_REACHED)
        commit(block_end)
