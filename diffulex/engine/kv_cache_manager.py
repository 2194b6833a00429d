"""The page pool: which physical KV pages each request owns, and which pages hold a reusable prefix.

A request needs pages for committed blocks (their K/V is written once, by the forward after they commit); active
blocks are recomputed every step and never stored, except where a strategy keeps one's K/V (`Request.stored_len`).
With continuation steps the scheduler also lends free pages to the blocks of the running sets
(`reserve_running_pages`), and takes them back before it plans the next step (`release_reserved_pages`), so a loan
never changes admission or preemption. Page ``i`` of a request holds positions ``[i*P, (i+1)*P)``. A block lies
within one page (``block_size`` divides ``page_size``), or, where a strategy's blocks are wider than a page
(Fast-dLLM v2), covers whole pages.

Prefix caching: a page whose positions all hold final tokens and whose K/V has been written is registered under
its content key: the digest of the page before it (a hash of its tokens chained with the digest before that)
followed by its own tokens' bytes. A later request whose committed prefix has the same chain reuses the page
instead of recomputing it. The lookup walks a prompt's pages by content key, each key made from the digest the
previous hit page was registered with, so a hit computes no hash: a 32,000-token prefix is 1,000 dictionary
lookups (hashing its 1,000 pages took about 2 ms of the hit's time to first token on an H100's host). Freed pages
keep their registration until they are handed out again, oldest-freed first, so recently used prefixes survive
longest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import NamedTuple

import numpy as np

from diffulex.strategy.page_table import page_array
from diffulex.strategy.request import Request

# a token id as the page hash reads it: 8 bytes (int64)
TOKEN_BYTES = 8
HASH_BYTES = 16  # 128-bit digests


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """The tokens as the hash reads them (native int64), from an array at memory speed."""
    if isinstance(tokens, np.ndarray):
        return np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
    return array("q", tokens).tobytes()


def content_key(prev_hash: bytes | None, page_bytes: bytes | memoryview) -> bytes:
    """The key a page is registered and looked up under: the chain's digest before it (None for a prompt's first
    page), then its tokens' bytes. Two keys are equal only where the tokens and the digests (so the whole prefixes,
    up to a 128-bit collision) are."""
    return (prev_hash or b"") + page_bytes


def chained_page_keys(
    prev_hash: bytes | None, tokens: Sequence[int] | np.ndarray, page_size: int
) -> tuple[list[bytes], list[bytes]]:
    """The content key and the digest of each whole page of ``tokens`` in turn, the first chained to
    ``prev_hash``: a page's digest is the 128-bit blake2b of its key, and the next page's key begins with it. Every
    token is converted to bytes in one call, then each page costs one hash call (a 32k-token prompt has 1,000
    pages)."""
    data = memoryview(_token_bytes(tokens))  # pages read in place
    step = page_size * TOKEN_BYTES
    keys: list[bytes] = []
    hashes: list[bytes] = []
    prev, blake2b = prev_hash, hashlib.blake2b
    for offset in range(0, len(data) - step + 1, step):
        key = content_key(prev, data[offset : offset + step])
        prev = blake2b(key, digest_size=HASH_BYTES).digest()
        keys.append(key)
        hashes.append(prev)
    return keys, hashes


class PrefixHit(NamedTuple):
    """The leading pages of a waiting request found in the cache: their digests and pages, and the tokens they
    cover. Valid until the pool changes (a registration or a page handed out): the scheduler looks a request up
    and admits it with the hit in one pass."""

    hashes: list[bytes]
    pages: list[int]
    num_tokens: int


@dataclass
class PrefixWalk:
    """How far a waiting request's pages were found in the cache at its last lookup: their digests and pages. A
    request that waits at the head of the queue (for pages or rows) is looked up at every schedule; the next lookup
    keeps the pages still registered with these digests (one comparison of the lists: a page's digest is that of
    its key) and walks on from there."""

    hashes: list[bytes] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)

    def keep(self, count: int) -> None:
        del self.hashes[count:], self.pages[count:]


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = np.zeros(num_pages, dtype=np.int32)  # requests holding each page
        # Free pages in the order they should be handed out (oldest freed first); values unused.
        self.free_pages: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        # registered pages: each one's digest (`chained_page_keys`: the next page's key begins with it) and content key
        # (`content_key`), and the page of each key
        self.hash_of_page: dict[int, bytes] = {}
        self.key_of_page: dict[int, bytes] = {}
        self.page_of_key: dict[bytes, int] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ----- admission --------------------------------------------------------------------------------------

    def _page_bytes(self, req: Request, first: int, end: int) -> memoryview:
        """The bytes of ``req``'s pages ``[first, end)`` as the keys and hashes read them (one conversion)."""
        return memoryview(_token_bytes(req.token_array(first * self.page_size, end * self.page_size)))

    def lookup_prefix(self, req: Request) -> PrefixHit:
        """The leading full pages of ``req`` already in the cache: each page looked up by its content key, made from
        the digest its predecessor was registered with, so nothing is hashed; a request looked up before walks on
        from the pages it found then that are still registered with the same digests (`PrefixWalk`)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], [], 0)
        num_pages = req.shareable_len // self.page_size
        walk = req.prefix_walk if req.prefix_walk is not None else PrefixWalk()
        walk.keep(num_pages)
        hashes, pages = walk.hashes, walk.pages
        if list(map(self.hash_of_page.get, pages)) != hashes:  # a page handed out since: keep those before it
            walk.keep(next(i for i, (page, h) in enumerate(zip(pages, hashes, strict=True))
                           if self.hash_of_page.get(page) != h))  # fmt: skip
        first = len(pages)
        data = self._page_bytes(req, first, num_pages)
        step = self.page_size * TOKEN_BYTES
        prev, find, digest_of = hashes[-1] if first else b"", self.page_of_key.get, self.hash_of_page.__getitem__
        for offset in range(0, (num_pages - first) * step, step):
            # `content_key` written out: the call would cost this loop about 13% (it is on a hit's critical path)
            page = find(prev + data[offset : offset + step])
            if page is None:
                break
            prev = digest_of(page)
            hashes.append(prev)
            pages.append(page)
        req.prefix_walk = walk
        # a hit covers whole blocks: the rest of a block wider than a page is computed and stored again, which
        # must not happen in a page other requests share
        covered = len(pages) * self.page_size
        found = (covered - covered % req.settings.block_size) // self.page_size
        return PrefixHit(hashes[:found], pages[:found], found * self.page_size)

    def can_admit(self, req: Request) -> bool:
        return self.pages_for(req.stored_len) <= self.num_free_pages

    def admit(self, req: Request, hit: PrefixHit | None = None) -> None:
        """Give a waiting request its pages: shared prefix pages first (``hit``, its `lookup_prefix` with the pool
        unchanged since; looked up here without it), fresh pages for the rest."""
        assert not req.page_table, "a waiting request holds no pages"
        hashes, pages, _ = hit if hit is not None else self.lookup_prefix(req)
        req.prefix_walk = None  # its pages are held from now on
        if pages:
            shared = np.array(pages, dtype=np.int64)
            idle = shared[self.ref_counts[shared] == 0].tolist()  # on the free list until now
            list(map(self.free_pages.pop, idle))
            self.ref_counts[shared] += 1  # a request's pages are distinct: one increment each
            req.page_table.extend(pages)
            req.page_hashes.extend(hashes)  # the chain the registration of its tail goes on from
        if req.page_table:
            req.mark_prefix_cached(len(req.page_table) * self.page_size)
        self.grow(req)

    # ----- running ----------------------------------------------------------------------------------------

    def pages_missing(self, req: Request) -> int:
        """Fresh pages ``req`` needs before its next forward can store what it stores (`Request.stored_len`)."""
        return max(0, self.pages_for(req.stored_len) - len(req.page_table))

    def grow(self, req: Request) -> None:
        missing = self.pages_missing(req)
        if missing > self.num_free_pages:
            raise RuntimeError(f"request {req.req_id} needs {missing} pages, only {self.num_free_pages} free")
        if missing:
            req.page_table.extend(self._take_free_pages(missing))

    def reserve_running_pages(self, req: Request) -> None:
        """Give ``req`` the pages its running set, the block after it and one page more will be stored in, as far
        as free pages allow. A continuation step (`diffulex.engine.continuation`) stores a block in the step right
        after its last mask is decoded, and opens the next block after that, before the host has seen either, so
        their slots must exist already; the device reads the page table the chain of continuations began with, so
        the page beyond lets a request open blocks for a whole page before the chain needs the host again (without
        it, at large batches some request always crossed into a page of its own). A loan is the next page handed
        out, which may evict the oldest freed prefix as the allocation it anticipates would; taken back, it is first
        in line and the next loans take it again, so loans evict a page or two per running request, not one per
        step; and a pool that has cycled (every free page holding a prefix) still lends. Where no page is free a
        step that would need one is not continued (`ContinuationRefusal.NO_PAGE`)."""
        if not req.running:
            return
        running_end = req.running[-1].end
        next_end = min(running_end + req.settings.block_size, req.max_stored_len)
        ahead = min(self.pages_for(next_end) + 1, self.pages_for(req.max_stored_len))
        wanted = max(ahead, self.pages_for(running_end)) - len(req.page_table)
        wanted = min(wanted, self.num_free_pages)
        if wanted > 0:
            req.page_table.extend(self._take_free_pages(wanted))

    def release_reserved_pages(self, req: Request) -> None:
        """Return the pages `reserve_running_pages` gave ``req`` that no committed block needs yet, first in line
        again (the next reservation takes the same pages back). They hold nothing: no block was stored in them."""
        keep = self.pages_for(req.stored_len)
        while len(req.page_table) > keep:
            page = req.page_table.pop()
            self.ref_counts[page] -= 1
            self.free_pages[page] = None
            self.free_pages.move_to_end(page, last=False)

    def _take_free_page(self) -> int:
        return self._take_free_pages(1)[0]

    def _take_free_pages(self, count: int) -> list[int]:
        """The next ``count`` free pages (oldest freed first), each held once now; a prefix they still held is no
        longer findable. Dictionary work at C speed (`map`), the reference counts in one vector op: a 32k-token
        prompt takes 1,000 pages."""
        pages = list(islice(self.free_pages, count))
        list(map(self.free_pages.pop, pages))
        stale_pages = list(self.key_of_page.keys() & pages)
        if stale_pages:
            list(map(self.hash_of_page.pop, stale_pages))
            list(map(self.page_of_key.pop, map(self.key_of_page.pop, stale_pages)))
        self.ref_counts[pages] = 1
        return pages

    def register_cached_pages(self, req: Request) -> None:
        """After a forward: make every newly completed page of cached, final tokens findable by its content key."""
        if not self.enable_prefix_caching:
            return
        full_pages = req.num_cached_tokens // self.page_size
        if len(req.page_hashes) >= full_pages:
            return
        first = len(req.page_hashes)
        tokens = req.token_array(first * self.page_size, full_pages * self.page_size)
        keys, hashes = chained_page_keys(req.page_hashes[-1] if first else None, tokens, self.page_size)
        req.page_hashes.extend(hashes)
        pages = req.page_table[first:full_pages]
        taken = self.page_of_key.keys() & keys  # an equal prefix registered already keeps its page
        if taken:
            fresh = [i for i, key in enumerate(keys) if key not in taken]
            keys, hashes, pages = [keys[i] for i in fresh], [hashes[i] for i in fresh], [pages[i] for i in fresh]
        self.page_of_key.update(zip(keys, pages, strict=True))
        self.key_of_page.update(zip(pages, keys, strict=True))
        self.hash_of_page.update(zip(pages, hashes, strict=True))

    def free(self, req: Request) -> None:
        """Release a request's pages; unshared pages go to the back of the free list, keeping their hash."""
        pages = page_array(req.page_table)[::-1]  # the last page first: the request's tail is reused first
        self.ref_counts[pages] -= 1  # a request's pages are distinct: one decrement each
        unshared = pages[self.ref_counts[pages] == 0]
        self.free_pages.update(dict.fromkeys(unshared.tolist()))
        req.page_table.clear()
        req.page_hashes.clear()
