"""A diffusion block: a fixed span of positions that is denoised together and committed as one unit."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BlockStatus(enum.Enum):
    """Where a block is in its life: being denoised, final but not yet in the KV cache, or cached."""

    ACTIVE = "active"  # in the running set, some positions may still hold the mask token
    TO_CACHE = "to_cache"  # every token is final; the next forward that includes it writes its K/V
    IN_CACHE = "in_cache"  # final, and its K/V is resident in the paged cache


@dataclass(eq=False)
class Block:
    """Block ``index`` covers absolute positions ``[start, start + size)`` of its request's sequence.

    Tokens are not stored here but in the request's token list, so the forward reads one flat sequence.
    """

    index: int
    start: int
    size: int
    status: BlockStatus

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def is_committed(self) -> bool:
        return self.status is not BlockStatus.ACTIVE
