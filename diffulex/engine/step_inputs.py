"""The host-side description of one forward: flat token rows, cache slots and the ragged request layout.

The model runner builds it from the batch in one pass, its per-row fields as int64 arrays
(`diffulex.engine.step_rows`); the eager path turns it into tensors, the CUDA graph path copies it into the static
buffers a captured graph reads. A hand-built step may give lists instead: every reader takes either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from diffulex.layers.token_merge import SoftInput
from diffulex.strategy.request import Request, SampleTarget


@dataclass
class StepInputs:
    """The ``T`` query rows (int64 arrays, or lists in a hand-built step) and the ``R`` requests (lists) of one
    step."""

    input_ids: np.ndarray | list[int] = field(default_factory=list)  # [T]
    positions: np.ndarray | list[int] = field(default_factory=list)  # [T] absolute positions
    slot_mapping: np.ndarray | list[int] = field(default_factory=list)  # [T] cache slot to store K/V into, -1 = none
    cu_seqlens_q: list[int] = field(default_factory=lambda: [0])  # [R + 1]
    query_lens: list[int] = field(default_factory=list)  # [R]
    context_lens: list[int] = field(default_factory=list)  # [R] positions already in the cache
    prefix_lens: list[int] = field(default_factory=list)  # [R] prompt lengths
    # [R][pages] physical page per logical page (each request's `PageTable`, or a plain list in a hand-built step)
    page_tables: list[list[int]] = field(default_factory=list)
    # [R] end of the keys each request attends to (`Request.keys_end`); empty: every one ends with its rows
    key_lens: list[int] = field(default_factory=list)
    # [R] one past the last position each request may generate (`Request.generation_end`): a block that a
    # continuation opens on the device samples only the positions before it (an answer's last block may end early)
    answer_ends: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits the sampler needs, in work order
    # per sampled block, in work order: its first input row, one past its last, the cache slot of its first row
    # (-1 while it has no page); what a continuation step stores once the block is decoded; and its gate, the
    # sampled block before it in its request (-1: none; `diffulex.engine.continuation.BlockGates`)
    sample_blocks: list[tuple[int, int, int, int]] = field(default_factory=list)
    work: list[tuple[Request, list[SampleTarget]]] = field(default_factory=list)
    soft_rows: list[tuple[int, SoftInput]] = field(default_factory=list)  # rows whose input is a token merge

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def has_cached_tail(self) -> bool:
        """Whether a request attends to cached keys after its rows (the step then carries its key ends)."""
        lens = zip(self.key_lens, self.context_lens, self.query_lens, strict=False)
        return any(key_len > ctx + q_len for key_len, ctx, q_len in lens)

    @property
    def max_pages(self) -> int:
        return max((len(t) for t in self.page_tables), default=0)
