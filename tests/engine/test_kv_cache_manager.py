"""The page pool: pages for committed blocks only, chained prefix hashes, shared pages, LRU reuse of freed pages.

A "forward" is simulated the way the scheduler does it after a real one: `retire_and_commit` (the TO_CACHE
blocks were stored) then `register_cached_pages`.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

import diffulex.engine.kv_cache_manager as kv_cache_manager
from diffulex.engine.kv_cache_manager import KVCacheManager, PrefixHit, chained_page_keys, content_key
from diffulex.sampling_params import SamplingParams
from diffulex.strategy.block import BlockStatus
from diffulex.strategy.request import DecodeSettings, Request

MASK = 379
BLOCK = 4
PAGE = 8

SETTINGS = DecodeSettings(
    block_size=BLOCK,
    buffer_size=2,
    mask_token_id=MASK,
    max_model_len=1000,
    stop_token_ids=frozenset({376, 378}),
    accept_threshold=0.9,
    add_block_threshold=0.1,
    semi_complete_threshold=0.9,
    auto_max_nfe_warmup_steps=8,
    auto_max_nfe_tpf_floor=1.0,
)

_next_id = iter(range(10_000))


def make_request(prompt: list[int]) -> Request:
    return Request(next(_next_id), list(prompt), SamplingParams(temperature=0.0, max_tokens=32), SETTINGS)


def forward(kv: KVCacheManager, req: Request) -> None:
    req.retire_and_commit()
    kv.register_cached_pages(req)


def prompt_of(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def page_digest(prev: bytes | None, tokens: list[int]) -> bytes:
    """The reference digest of a page: the 128-bit blake2b of its key (the digest before it, then its tokens)."""
    return hashlib.blake2b(content_key(prev, np.asarray(tokens, dtype=np.int64).tobytes()), digest_size=16).digest()


def cached_request(kv: KVCacheManager, prompt: list[int]) -> Request:
    """Admit a request and run its prefill forward, so its prompt pages are cached and registered."""
    req = make_request(prompt)
    kv.admit(req)
    forward(kv, req)
    return req


# ----- pages only for committed blocks ----------------------------------------------------------------------


def test_admission_gives_pages_only_for_committed_blocks():
    kv = KVCacheManager(8, PAGE, True)
    req = make_request(prompt_of(10))  # blocks [0,4) [4,8) committed, [8,12) active
    kv.admit(req)
    assert len(req.page_table) == 1
    assert kv.num_free_pages == 7


def test_a_request_without_committed_blocks_holds_no_page():
    kv = KVCacheManager(8, PAGE, True)
    req = make_request(prompt_of(3))
    kv.admit(req)
    assert req.page_table == []
    assert kv.num_free_pages == 8


def test_pages_grow_when_a_block_commits():
    kv = KVCacheManager(8, PAGE, True)
    req = make_request(prompt_of(10))
    kv.admit(req)
    forward(kv, req)
    req.maybe_activate_block()  # [12, 16) opens: still no page needed for active blocks
    assert kv.pages_missing(req) == 0
    req.apply_tokens([(10, 1), (11, 2)])
    forward(kv, req)  # block [8, 12) commits (TO_CACHE): its K/V needs page 1
    assert req.blocks[2].status is BlockStatus.TO_CACHE
    assert kv.pages_missing(req) == 1
    kv.grow(req)
    assert len(req.page_table) == 2 and kv.pages_missing(req) == 0


# ----- prefix caching ---------------------------------------------------------------------------------------


def test_prefix_hit_shares_pages_and_marks_blocks_in_cache():
    kv = KVCacheManager(8, PAGE, True)
    first = cached_request(kv, prompt_of(17))
    second = make_request(prompt_of(16) + [300, 301, 302])
    assert kv.lookup_prefix(second).num_tokens == 16
    free_before = kv.num_free_pages
    kv.admit(second)
    assert second.page_table == first.page_table[:2]
    assert [kv.ref_counts[p] for p in second.page_table] == [2, 2]
    assert [b.status for b in second.blocks[:4]] == [BlockStatus.IN_CACHE] * 4
    assert second.num_cached_blocks == 4
    assert second.query_range()[0] == 16
    assert kv.num_free_pages == free_before


def test_prefix_hit_stops_at_the_first_page_that_differs():
    kv = KVCacheManager(8, PAGE, True)
    cached_request(kv, prompt_of(17))
    other = make_request(prompt_of(8) + prompt_of(8, start=200) + [1])
    assert kv.lookup_prefix(other).num_tokens == 8


def test_prefix_hit_needs_the_whole_chain_not_just_equal_page_content():
    kv = KVCacheManager(8, PAGE, True)
    cached_request(kv, prompt_of(17))
    shifted = make_request(prompt_of(8, start=200) + prompt_of(8, start=18) + [1])  # same second page only
    assert kv.lookup_prefix(shifted).num_tokens == 0


def test_hashes_are_registered_after_the_blocks_are_cached_not_at_admission():
    kv = KVCacheManager(8, PAGE, True)
    first = make_request(prompt_of(17))
    kv.admit(first)
    assert kv.page_of_key == {} and first.page_hashes == []
    twin = make_request(prompt_of(17))
    assert kv.lookup_prefix(twin).num_tokens == 0  # the K/V of `first` does not exist yet
    first.retire_and_commit()
    assert kv.page_of_key == {}  # cached, but not registered until register_cached_pages
    kv.register_cached_pages(first)
    assert len(first.page_hashes) == 2
    assert kv.lookup_prefix(twin).num_tokens == 16


def test_a_committed_but_not_yet_stored_page_is_not_registered():
    kv = KVCacheManager(8, PAGE, True)
    req = cached_request(kv, prompt_of(10))  # page 0 ([0, 8)) is cached and registered
    req.apply_tokens([(10, 1), (11, 2)])
    forward(kv, req)  # block [8, 12) is TO_CACHE: page 1 is neither full nor stored
    kv.grow(req)
    assert len(req.page_hashes) == 1
    assert set(kv.hash_of_page) == {req.page_table[0]}


def test_a_freed_page_keeps_its_hash_and_is_found_again():
    kv = KVCacheManager(8, PAGE, True)
    first = cached_request(kv, prompt_of(17))
    pages = list(first.page_table[:2])
    kv.free(first)
    assert all(kv.ref_counts[p] == 0 and p in kv.free_pages for p in pages)
    assert all(p in kv.hash_of_page for p in pages)
    again = make_request(prompt_of(17))
    kv.admit(again)
    assert again.page_table[:2] == pages
    assert all(kv.ref_counts[p] == 1 and p not in kv.free_pages for p in pages)


def test_a_freed_page_reused_for_other_content_loses_its_hash():
    kv = KVCacheManager(2, PAGE, True)
    first = cached_request(kv, prompt_of(17))
    kv.free(first)
    other = make_request(prompt_of(16, start=200))
    kv.admit(other)  # takes both freed pages
    assert sorted(other.page_table) == [0, 1]
    assert kv.hash_of_page == {}
    assert kv.page_of_key == {} and kv.key_of_page == {}
    kv.free(other)  # never cached: its pages hold no findable content
    assert kv.lookup_prefix(make_request(prompt_of(17))).num_tokens == 0


def test_free_pages_are_handed_out_oldest_freed_first_after_never_used_ones():
    kv = KVCacheManager(6, PAGE, True)
    x = make_request(prompt_of(16))
    y = make_request(prompt_of(16, start=100))
    kv.admit(x)
    kv.admit(y)
    assert (x.page_table, y.page_table) == ([0, 1], [2, 3])
    kv.free(y)
    kv.free(x)
    a = make_request(prompt_of(16, start=200))
    b = make_request(prompt_of(16, start=250))
    c = make_request(prompt_of(16, start=300))
    kv.admit(a)
    kv.admit(b)
    kv.admit(c)
    assert set(a.page_table) == {4, 5}  # never used
    assert set(b.page_table) == {2, 3}  # freed first (by y)
    assert set(c.page_table) == {0, 1}  # freed last (by x)


def test_a_request_frees_its_tail_pages_before_its_head_pages():
    kv = KVCacheManager(2, PAGE, True)
    x = make_request(prompt_of(16))
    kv.admit(x)
    kv.free(x)
    assert list(kv.free_pages) == [1, 0]  # the first page of a prefix survives longest


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(8, PAGE, False)
    first = cached_request(kv, prompt_of(17))
    assert kv.page_of_key == {} and first.page_hashes == []
    twin = make_request(prompt_of(17))
    assert kv.lookup_prefix(twin).num_tokens == 0
    kv.admit(twin)
    assert set(twin.page_table).isdisjoint(first.page_table)
    assert twin.num_cached_blocks == 0


def test_a_shared_page_is_freed_only_when_both_requests_release_it():
    kv = KVCacheManager(8, PAGE, True)
    first = cached_request(kv, prompt_of(17))
    second = make_request(prompt_of(17))
    kv.admit(second)
    shared = first.page_table[:2]
    kv.free(first)
    assert [kv.ref_counts[p] for p in shared] == [1, 1]
    assert all(p not in kv.free_pages for p in shared)
    assert second.page_table == shared
    kv.free(second)
    assert [kv.ref_counts[p] for p in shared] == [0, 0]
    assert all(p in kv.free_pages for p in shared)
    assert kv.num_free_pages == 8 and kv.num_used_pages == 0


def test_free_clears_the_request_page_table_and_hashes():
    kv = KVCacheManager(8, PAGE, True)
    req = cached_request(kv, prompt_of(17))
    kv.free(req)
    assert req.page_table == [] and req.page_hashes == []


def test_can_admit_counts_the_pages_of_the_committed_prefix():
    kv = KVCacheManager(2, PAGE, True)
    assert kv.can_admit(make_request(prompt_of(17)))  # 16 committed tokens: 2 pages
    assert not kv.can_admit(make_request(prompt_of(24)))  # 3 pages


def test_a_pages_digest_depends_on_every_page_before_it():
    tokens = prompt_of(PAGE)
    after_a = chained_page_keys(None, prompt_of(PAGE, start=100) + tokens, PAGE)[1][1]
    after_b = chained_page_keys(None, prompt_of(PAGE, start=200) + tokens, PAGE)[1][1]
    alone = chained_page_keys(None, tokens, PAGE)[1][0]
    assert len({after_a, after_b, alone}) == 3
    assert alone != chained_page_keys(None, tokens[::-1], PAGE)[1][0]
    assert chained_page_keys(None, tokens, PAGE) == chained_page_keys(None, np.array(tokens), PAGE)


def test_reusing_a_tail_page_keeps_the_head_of_the_prefix_findable():
    kv = KVCacheManager(2, PAGE, True)
    first = cached_request(kv, prompt_of(17))
    head, tail = first.page_table
    kv.free(first)
    other = make_request(prompt_of(9, start=200))  # one committed page: takes the tail page, freed first
    kv.admit(other)
    assert other.page_table == [tail]
    assert tail not in kv.hash_of_page and head in kv.hash_of_page
    assert kv.lookup_prefix(make_request(prompt_of(17))).num_tokens == PAGE


def test_keys_chained_from_a_pages_digest_continue_the_chain_and_each_digest_is_its_keys_hash():
    tokens = prompt_of(5 * PAGE + 3)  # the partial page gets no key
    keys, hashes = chained_page_keys(None, tokens, PAGE)
    assert len(keys) == 5
    assert chained_page_keys(hashes[1], tokens[2 * PAGE :], PAGE) == (keys[2:], hashes[2:])
    assert hashes == [hashlib.blake2b(key, digest_size=16).digest() for key in keys]


def test_a_page_key_is_its_hash_input_the_digest_before_it_then_its_tokens():
    tokens = prompt_of(3 * PAGE + 2)
    keys, hashes = chained_page_keys(None, tokens, PAGE)
    prevs = [None, *hashes[:-1]]
    assert hashes == [page_digest(prev, tokens[i * PAGE : (i + 1) * PAGE]) for i, prev in enumerate(prevs)]
    pages = [np.asarray(tokens[i * PAGE : (i + 1) * PAGE], dtype=np.int64).tobytes() for i in range(3)]
    assert keys == [content_key(prev, page) for prev, page in zip([None, *hashes[:-1]], pages, strict=True)]
    assert content_key(hashes[0], pages[1]) != content_key(None, pages[1])


def test_a_prefix_hit_hashes_none_of_its_cached_pages_and_each_page_of_its_tail_once(monkeypatch):
    """The lookup reads the digests the cached pages were registered with: only the tail's new pages are hashed,
    however often the waiting request is looked up, and the hit's digests are those of its own tokens."""
    hashed: list[int] = []

    def counted(prev, tokens, page_size):
        hashed.append(len(tokens) // page_size)
        return chained_page_keys(prev, tokens, page_size)

    kv = KVCacheManager(64, PAGE, True)
    cached_request(kv, prompt_of(20 * PAGE + 1))
    monkeypatch.setattr(kv_cache_manager, "chained_page_keys", counted)
    prompt = prompt_of(20 * PAGE) + prompt_of(4 * PAGE + 1, start=500)
    hit = make_request(prompt)
    for _ in range(3):  # a waiting request is looked up at every schedule
        assert kv.lookup_prefix(hit).num_tokens == 20 * PAGE
    kv.admit(hit)
    assert hashed == []
    forward(kv, hit)  # the tail's pages are cached and registered
    assert hashed == [4]
    assert hit.page_hashes == chained_page_keys(None, prompt, PAGE)[1]


def test_a_page_whose_predecessor_was_handed_out_again_is_found_only_after_that_predecessor():
    """A key names its predecessor by digest, not by page: a cached second page stays findable behind the first
    page's content cached anew in another page, and never behind other content in the old page."""
    kv = KVCacheManager(4, PAGE, True)
    first = cached_request(kv, prompt_of(2 * PAGE + 1))
    head, tail = first.page_table
    kv.free(first)
    kv.free_pages.move_to_end(head, last=False)  # the head's page is handed out next
    other = make_request(prompt_of(PAGE + 1, start=700))
    kv.admit(other)
    forward(kv, other)
    assert other.page_table == [head]
    assert kv.lookup_prefix(make_request(prompt_of(2 * PAGE + 1))).num_tokens == 0
    again = cached_request(kv, prompt_of(PAGE + 1))  # the first page's content, in a fresh page
    assert again.page_table[0] not in (head, tail)
    assert kv.lookup_prefix(make_request(prompt_of(2 * PAGE + 1))).num_tokens == 2 * PAGE


class CountedLookups(dict):
    """The cache's key -> page dictionary, counting the lookups made in it."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def test_a_waiting_request_looked_up_again_walks_on_from_the_pages_it_found():
    """A request waiting at the head of the queue is looked up at every schedule: after the first walk over its 20
    cached pages, a lookup reads only the page where that walk stopped, and finds the pages registered since."""
    kv = KVCacheManager(64, PAGE, True)
    kv.page_of_key = CountedLookups()
    cached_request(kv, prompt_of(20 * PAGE + 1))
    waiting = make_request(prompt_of(24 * PAGE + 1))
    kv.page_of_key.lookups = 0
    assert kv.lookup_prefix(waiting).num_tokens == 20 * PAGE
    assert kv.page_of_key.lookups == 21  # 20 hits and the miss
    assert kv.lookup_prefix(waiting).num_tokens == 20 * PAGE
    assert kv.page_of_key.lookups == 22
    cached_request(kv, prompt_of(22 * PAGE + 1))  # registers two pages more of the same prefix
    assert kv.lookup_prefix(waiting).num_tokens == 22 * PAGE
    shared = kv.lookup_prefix(make_request(prompt_of(22 * PAGE + 1))).pages
    kv.admit(waiting)
    assert waiting.prefix_walk is None and waiting.page_table[:22] == shared


def test_a_page_handed_out_between_lookups_ends_the_hit_before_it():
    kv = KVCacheManager(24, PAGE, True)
    first = cached_request(kv, prompt_of(20 * PAGE + 1))
    waiting = make_request(prompt_of(20 * PAGE + 1))
    assert kv.lookup_prefix(waiting).num_tokens == 20 * PAGE
    kv.free(first)  # its pages keep their keys, the last page first in line
    kv.admit(make_request(prompt_of(9 * PAGE + 1, start=5000)))  # the 4 never-used pages, then the prefix's last 5
    hit = kv.lookup_prefix(waiting)
    assert hit.num_tokens == 15 * PAGE
    assert hit == kv.lookup_prefix(make_request(prompt_of(20 * PAGE + 1)))  # what a first lookup finds


def test_a_prefix_hit_on_a_long_prompt_makes_none_of_its_prompt_blocks():
    kv = KVCacheManager(400, PAGE, True)
    cached_request(kv, prompt_of(300 * PAGE + 1))
    hit = make_request(prompt_of(300 * PAGE) + prompt_of(2 * PAGE + 1, start=5000))
    kv.admit(hit)
    assert hit.num_cached_blocks == 300 * PAGE // BLOCK
    assert hit.blocks.num_made == 1  # only the block the prompt ends in, opened at creation
    assert hit.query_range() == (300 * PAGE, 302 * PAGE + BLOCK)
    forward(kv, hit)
    assert hit.num_cached_blocks == 302 * PAGE // BLOCK  # the forward stored the tail
    assert hit.blocks.num_made == 2  # and read the block before the running one (is it committed?)


def page_bytes(req: Request, page: int) -> bytes:
    return np.asarray(req.token_ids[page * PAGE : (page + 1) * PAGE], dtype=np.int64).tobytes()


class OneByOnePool(KVCacheManager):
    """The pool's bookkeeping written page by page: the reference the bulk operations must equal."""

    def lookup_prefix(self, req: Request) -> PrefixHit:
        hits, prev = [], None
        for i in range(req.shareable_len // self.page_size):
            page = self.page_of_key.get(content_key(prev, page_bytes(req, i)))
            if page is None:
                break
            assert self.hash_of_page[page] == page_digest(prev, req.token_ids[i * PAGE : (i + 1) * PAGE])
            prev = self.hash_of_page[page]
            hits.append((prev, page))
        covered = len(hits) * self.page_size
        hits = hits[: (covered - covered % req.settings.block_size) // self.page_size]
        return PrefixHit([h for h, _ in hits], [page for _, page in hits], len(hits) * self.page_size)

    def admit(self, req: Request, hit: PrefixHit | None = None) -> None:
        hashes, pages, _ = self.lookup_prefix(req)
        for h, page in zip(hashes, pages, strict=True):
            if self.ref_counts[page] == 0:
                del self.free_pages[page]
            self.ref_counts[page] += 1
            req.page_table.append(page)
            req.page_hashes.append(h)
        if req.page_table:
            req.mark_prefix_cached(len(req.page_table) * self.page_size)
        self.grow(req)

    def _take_free_pages(self, count: int) -> list[int]:
        pages = []
        for _ in range(count):
            page, _ = self.free_pages.popitem(last=False)
            stale = self.key_of_page.pop(page, None)
            if stale is not None:
                del self.page_of_key[stale]
                del self.hash_of_page[page]
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def register_cached_pages(self, req: Request) -> None:
        full_pages = req.num_cached_tokens // self.page_size
        for i in range(len(req.page_hashes), full_pages):
            prev = req.page_hashes[i - 1] if i else None
            req.page_hashes.append(page_digest(prev, req.token_ids[i * PAGE : (i + 1) * PAGE]))
            key = content_key(prev, page_bytes(req, i))
            if key not in self.page_of_key:
                self.page_of_key[key] = req.page_table[i]
                self.key_of_page[req.page_table[i]] = key
                self.hash_of_page[req.page_table[i]] = req.page_hashes[i]

    def free(self, req: Request) -> None:
        for page in reversed(req.page_table):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages[page] = None
        req.page_table.clear()
        req.page_hashes.clear()


def pool_state(kv: KVCacheManager, requests: list[Request]) -> tuple:
    return (list(kv.free_pages), list(kv.ref_counts), dict(kv.page_of_key), dict(kv.key_of_page),
            dict(kv.hash_of_page), [list(r.page_table) for r in requests],
            [list(r.page_hashes) for r in requests])  # fmt: skip


def test_bulk_admission_registration_and_release_equal_the_pool_worked_page_by_page():
    rng = random.Random(0)
    shared = prompt_of(40 * PAGE, start=3000)
    pools = [KVCacheManager(160, PAGE, True), OneByOnePool(160, PAGE, True)]
    held: list[list[Request]] = [[], []]
    for op in range(60):
        if held[0] and (rng.random() < 0.4 or sum(len(r.page_table) for r in held[0]) > 100):
            victim = rng.randrange(len(held[0]))
            for kv, requests in zip(pools, held, strict=True):
                kv.free(requests.pop(victim))
        else:
            head = shared[: rng.randrange(0, len(shared))]
            prompt = head + prompt_of(rng.randrange(1, 12 * PAGE), start=rng.randrange(10, 2000))
            for kv, requests in zip(pools, held, strict=True):
                req = make_request(prompt)
                kv.admit(req)
                forward(kv, req)
                requests.append(req)
        assert pool_state(pools[0], held[0]) == pool_state(pools[1], held[1]), f"after operation {op}"
    assert pools[0].page_of_key and any(kv.lookup_prefix(make_request(shared)).num_tokens for kv in pools)


# ----- loans for continuation steps ---------------------------------------------------------------------------


def test_a_loan_covers_the_running_block_the_block_after_it_and_a_page_more_and_is_taken_back_whole() -> None:
    """A continuation may store the running block and then open the block after it before the host sees either
    (`diffulex.engine.continuation.BlockOpening`), and go on opening blocks for a page more: a request whose
    12-token prompt fills pages 0 and 1 runs block 12-15 (page 1) and is lent page 2 for the block after it (16-19)
    and page 3. Taking the loan back leaves the prompt's pages, the lent pages first in line again."""
    kv = KVCacheManager(num_pages=6, page_size=PAGE, enable_prefix_caching=True)
    req = cached_request(kv, prompt_of(12))
    assert len(req.page_table) == 2
    req.maybe_activate_block()
    assert (req.running[0].start, req.running[0].end) == (12, 16)
    kv.reserve_running_pages(req)
    assert len(req.page_table) == 4
    lent = req.page_table[2:]
    kv.release_reserved_pages(req)
    assert len(req.page_table) == 2
    kv.reserve_running_pages(req)
    assert req.page_table[2:] == lent



def test_a_pool_whose_free_pages_all_hold_prefixes_still_lends_and_evicts_only_what_it_lends() -> None:
    """Once the pool has cycled every free page holds a reusable prefix; continuations still need their loans. A
    loan evicts the oldest freed prefix, as the allocation it anticipates would, and a loan taken back and lent
    again is the same page: the other prefixes stay findable."""
    kv = KVCacheManager(num_pages=6, page_size=PAGE, enable_prefix_caching=True)
    for start in (100, 200, 300):  # three finished requests leave three prefixes of two pages each
        kv.free(cached_request(kv, prompt_of(16, start)))
    assert kv.num_free_pages == 6 and len(kv.page_of_key) == 6
    hit = kv.lookup_prefix(make_request(prompt_of(17, 300))).num_tokens
    assert hit == 16
    req = cached_request(kv, prompt_of(12))  # evicts the oldest prefix for its own two pages
    req.maybe_activate_block()
    kv.reserve_running_pages(req)
    assert len(req.page_table) == 4, "the running block's page and the one after it are lent"
    kv.release_reserved_pages(req)
    kv.reserve_running_pages(req)
    kv.release_reserved_pages(req)
    assert kv.lookup_prefix(make_request(prompt_of(17, 300))).num_tokens == hit, "the newest prefix survives"
    assert len(kv.page_of_key) == 6 - 4 + 1  # two pages evicted by the prompt, two by the loans; its own page 0
