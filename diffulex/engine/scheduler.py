"""Continuous batching: which requests take part in the next forward, and what happens to them after it.

Every step first continues the running requests (oldest first), preempting the most recently admitted ones
when pages run out, then admits waiting requests first-come first-served while the token budget, the request
cap and the page pool allow. Prefill and decode chunks share one forward: to the model both are "the uncached
committed blocks of a request followed by its running set".

With chunked prefill a long prompt is computed a few whole blocks per step, from the rows the decoding requests
leave; while any request decodes, ``max_prefill_chunk_cost`` also bounds what a step's prompt rows cost
(`diffulex.engine.prefill_cost`), so that the chunks shrink as a prompt's context grows instead of stretching the
decoders' steps late in a long prompt.

A preempted request keeps its logical state (tokens, blocks) and loses its pages; when it is admitted again
its next ordinary step recomputes the K/V of its committed blocks, so it produces the same tokens as if it had
never been preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from diffulex.engine.kv_cache_manager import KVCacheManager
from diffulex.engine.prefill_cost import PrefillCostModel
from diffulex.strategy.request import CompletionReason, Request, RequestStatus


@dataclass
class SchedulerLimits:
    max_num_reqs: int
    max_num_batched_tokens: int
    # lend free pages to the running sets' blocks (continuation steps store a block before the host sees it
    # finish: `diffulex.engine.continuation`); only with one step scheduled at a time
    reserve_running_pages: bool = False
    # a request whose uncached prompt prefix does not fit the step's budget computes it over several steps, one
    # block-aligned chunk per step, after the decoding requests have taken their rows (`Request.begin_prefill_chunk`)
    chunked_prefill: bool = False
    # with chunked_prefill, the most rows of a prompt's uncached prefix a step that has decoding requests computes
    # (the largest prefill graph's, `diffulex.engine.prefill_graphs`), so that such a step replays graphs; 0: only
    # the token budget bounds it
    prefill_chunk_rows: int = 0
    # with chunked_prefill, while any running request decodes: the most row equivalents (`prefill_cost_model`) of
    # prompt rows one step computes, so that a prompt's chunks shrink as its context grows; the first prompt of a
    # step still gets one block when that alone costs more. 0: no cost bound
    max_prefill_chunk_cost: int = 0
    prefill_cost_model: PrefillCostModel | None = None

    def __post_init__(self) -> None:
        if self.max_prefill_chunk_cost > 0 and self.prefill_cost_model is None:
            raise ValueError(
                f"max_prefill_chunk_cost={self.max_prefill_chunk_cost} needs a prefill_cost_model to price rows with"
            )


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv_cache: KVCacheManager) -> None:
        self.limits = limits
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def slots_full(self) -> bool:
        """Whether every request slot is taken (``max_num_reqs`` running): the next schedule admits no waiting
        request, unless one of the running ones finishes first."""
        return len(self.running) >= self.limits.max_num_reqs

    def admits_waiting(self) -> bool:
        """Whether the next schedule would admit the first waiting request: a request slot is free and the pages
        its committed prefix needs are free once the running requests have theirs (pages lent to them are taken
        back first, pages they lack are given first). A prefix hit may need fewer pages: this errs towards not
        admitting, and the request is admitted at the next step the host plans."""
        if not self.waiting or self.slots_full():
            return False
        kv = self.kv_cache
        spare = kv.num_free_pages + sum(len(r.page_table) - kv.pages_for(r.stored_len) for r in self.running)
        return kv.pages_for(self.waiting[0].stored_len) <= spare

    # ----- forming a batch ----------------------------------------------------------------------------------

    def schedule(self, busy: Collection[int] = (), max_reqs: int | None = None) -> list[Request]:
        """Choose this step's requests and advance their running sets; each is ready for the forward.

        ``busy`` holds the ids of requests whose previous step is still in flight (micro-batches): they are
        neither scheduled nor preempted. ``max_reqs`` caps this batch below ``max_num_reqs`` (a micro-batch's
        share of the requests).
        """
        reserve = self.limits.reserve_running_pages and not busy
        if reserve:  # loans are taken back first, so they never change admission or preemption
            for req in self.running:
                self.kv_cache.release_reserved_pages(req)
        batch: list[Request] = []
        budget = self.limits.max_num_batched_tokens
        cap = self.limits.max_num_reqs if max_reqs is None else min(max_reqs, self.limits.max_num_reqs)
        chunking = self.limits.chunked_prefill
        decoding = False  # the batch has a request that is not computing a prompt
        cost = self._prompt_cost() if chunking else None
        running = list(self.running)
        if chunking:  # decoding requests first: a long prefill only takes the rows they leave
            running.sort(key=lambda r: _prefilling(r) if r.supports_prefill_chunks else False)
        for req in running:
            if len(batch) >= cap:
                break
            if req.status is not RequestStatus.RUNNING or req.req_id in busy:  # preempted earlier, or in flight
                continue
            if chunking and not self._fits_or_chunks(req, budget, self._prompt_rows_cap(req, decoding, cost)):
                continue  # its prefill waits for a step with rows to spare
            if not self._make_room_for(req, busy):
                continue
            if cost is not None:
                cost.charge(req)
            decoding = decoding or not _prefilling(req)
            self.kv_cache.grow(req)
            if req.prefill_chunk_end is None:
                req.maybe_activate_block()
            batch.append(req)
            budget -= _query_len(req)

        while self.waiting and len(batch) < cap and len(self.running) < self.limits.max_num_reqs:
            req = self.waiting[0]
            hit = self.kv_cache.lookup_prefix(req)
            cached = hit.num_tokens
            estimate = _query_len(req) + req.settings.block_size - cached  # upper bound: one block may open
            chunk_fits = chunking and req.supports_prefill_chunks and budget >= _min_chunk_rows(req, cached)
            if batch and estimate > budget and not chunk_fits:
                break
            if not self.kv_cache.can_admit(req):
                break
            self.waiting.popleft()
            self.kv_cache.admit(req, hit)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if chunking and not self._fits_or_chunks(req, budget, self._prompt_rows_cap(req, decoding, cost)):
                continue  # admitted with its pages; its first chunk waits for a step with rows to spare
            if cost is not None:
                cost.charge(req)
            decoding = decoding or not _prefilling(req)
            if req.prefill_chunk_end is None:
                req.maybe_activate_block()
            batch.append(req)
            budget -= _query_len(req)
        if reserve:
            for req in batch:
                self.kv_cache.reserve_running_pages(req)
        return batch

    def _prompt_cost(self) -> _StepPromptCost | None:
        """The step's prompt cost budget (`SchedulerLimits.max_prefill_chunk_cost`) while a running request decodes,
        in this batch or not (in flight in the other micro-batch, or left out by the request cap): a prompt alone
        takes every row the token budget gives it. None: no cost bound this step."""
        limits = self.limits
        if limits.max_prefill_chunk_cost <= 0 or limits.prefill_cost_model is None:
            return None
        if not any(r.status is RequestStatus.RUNNING and not _prefilling(r) for r in self.running):
            return None
        return _StepPromptCost(limits.prefill_cost_model, float(limits.max_prefill_chunk_cost))

    def _prompt_rows_cap(self, req: Request, decoding: bool, cost: _StepPromptCost | None) -> int | None:
        """The most prompt rows of ``req`` this step may compute: beside decoding requests, those of the largest
        prefill graph (`SchedulerLimits.prefill_chunk_rows`); under a cost budget, the rows whose cost the step has
        left; None for no cap but the token budget."""
        caps = []
        if decoding and self.limits.prefill_chunk_rows > 0:
            caps.append(self.limits.prefill_chunk_rows)
        if cost is not None:
            caps.append(cost.rows_for(req))
        return min(caps, default=None)

    @staticmethod
    def _fits_or_chunks(req: Request, budget: int, prompt_rows_cap: int | None = None) -> bool:
        """Whether ``req`` takes part in this step: whole when its query fits ``budget`` and its prompt rows
        ``prompt_rows_cap`` (or it has no prefill left to split), else as a prefill chunk of the whole blocks that
        fit both; False when not even one block fits."""
        if not (req.supports_prefill_chunks and _prefilling(req)):
            return True
        prompt_fits = prompt_rows_cap is None or req.prefill_end - req.chunk_start() <= prompt_rows_cap
        if prompt_fits and _query_len(req) + req.settings.block_size <= budget:  # upper bound: one block may open
            return True
        return req.begin_prefill_chunk(budget if prompt_rows_cap is None else min(budget, prompt_rows_cap))

    def _make_room_for(self, req: Request, busy: Collection[int] = ()) -> bool:
        """Preempt the newest running requests that are not in flight until ``req`` has the pages it needs;
        False if ``req`` went itself, or only requests in flight are left to take pages from (it waits)."""
        while self.kv_cache.pages_missing(req) > self.kv_cache.num_free_pages:
            victim = next((r for r in reversed(self.running) if r.req_id not in busy), None)
            if victim is None:
                return False
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache.free(req)
        req.forget_cache()
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # ----- after the forward ---------------------------------------------------------------------------------

    def finish_step(self, req: Request, writes: list[tuple[int, int]]) -> int:
        """Apply one request's sampled tokens and advance its blocks; returns how many masks were filled."""
        filled = req.apply_tokens(writes)
        chunk = req.prefill_chunk_end is not None
        req.retire_and_commit()
        self.kv_cache.register_cached_pages(req)
        if chunk:  # a prefill chunk samples nothing: not a function evaluation of the decoding
            return filled
        req.nfe += 1
        reason = req.check_completion()
        if reason is not None:
            self.finish(req, reason)
        return filled

    def finish(self, req: Request, reason: CompletionReason) -> None:
        req.completion_reason = reason
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv_cache.free(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    def abort(self, req_id: int) -> Request | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.req_id == req_id:
                    self.finish(req, CompletionReason.ABORTED)
                    return req
        return None


class _StepPromptCost:
    """What is left of one step's prompt cost budget, in row equivalents (`diffulex.engine.prefill_cost`)."""

    def __init__(self, model: PrefillCostModel, budget: float) -> None:
        self.model = model
        self.left = budget
        self.charged = False  # a prompt has taken rows this step: the next one gets no block beyond the budget

    def rows_for(self, req: Request) -> int:
        """The most rows of ``req``'s uncached prefix (the recomputed row of a shifted family included) whose cost
        fits what is left; at least one block for the step's first prompt, so that every step makes progress."""
        rows = self.model.rows_within(self.left, req.chunk_start())
        if not self.charged:
            rows = max(rows, _min_chunk_rows(req, req.num_cached_tokens))
        return rows

    def charge(self, req: Request) -> None:
        """Take the cost of the prompt rows ``req`` computes this step (none for a decoder: the blocks it stores are
        in its running set)."""
        end = req.store_only_end() if req.supports_prefill_chunks else None
        start = req.chunk_start()
        if end is None or end <= start:
            return
        self.left -= self.model.rows_cost(end - start, start)
        self.charged = True


def _query_len(req: Request) -> int:
    start, end = req.query_range()
    return end - start


def _prefilling(req: Request) -> bool:
    """Whether ``req`` has uncached prompt blocks (or recomputed ones, after a preemption) before its running set."""
    return req.prefill_end > req.num_cached_tokens


def _min_chunk_rows(req: Request, cached: int) -> int:
    """Rows of the smallest prefill chunk of a waiting request whose first ``cached`` positions a prefix-cache hit
    supplies: one block, and the row before it for a shifted family."""
    return req.settings.block_size + int(req.settings.logits_shift and cached > 0)
