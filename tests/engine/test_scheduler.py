"""Continuous batching without a model: admission, scheduling order, preemption, finishing and abort.

The forward is simulated by writing a token at every sampling target of every scheduled request and then
calling `Scheduler.finish_step`, exactly what the engine does with the sampler's writes.
"""

from __future__ import annotations

from diffulex.engine.kv_cache_manager import KVCacheManager
from diffulex.engine.prefill_cost import PrefillCostModel
from diffulex.engine.scheduler import Scheduler, SchedulerLimits
from diffulex.sampling_params import SamplingParams
from diffulex.strategy.block import BlockStatus
from diffulex.strategy.request import CompletionReason, DecodeSettings, Request, RequestStatus

MASK = 379
BLOCK = 4

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


class Factory:
    """Requests with distinct prompts (no accidental prefix-cache hits) and increasing ids."""

    def __init__(self) -> None:
        self.next_id = 0

    def __call__(self, prompt_len: int, max_tokens: int = 32) -> Request:
        base = 20 * self.next_id
        prompt = [base + i for i in range(prompt_len)]
        req = Request(self.next_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), SETTINGS)
        self.next_id += 1
        return req


def make_scheduler(num_pages: int = 64, max_num_reqs: int = 8, budget: int = 4096, page_size: int = BLOCK,
                   prefix_caching: bool = False, reserve: bool = False) -> Scheduler:
    kv = KVCacheManager(num_pages, page_size, prefix_caching)
    return Scheduler(SchedulerLimits(max_num_reqs, budget, reserve), kv)


def forward(sched: Scheduler, batch: list[Request], token: int = 7) -> None:
    """Decode every sampling target of every request in the batch, then finish the step."""
    for req in batch:
        writes = [(p, token) for target in req.sample_targets() for p in target.positions]
        sched.finish_step(req, writes)


def ids(reqs) -> list[int]:
    return [r.req_id for r in reqs]


# ----- admission --------------------------------------------------------------------------------------------


def test_waiting_requests_are_admitted_first_come_first_served_up_to_max_num_reqs():
    new = Factory()
    sched = make_scheduler(max_num_reqs=2)
    reqs = [new(6) for _ in range(3)]
    for req in reqs:
        sched.add(req)
    batch = sched.schedule()
    assert ids(batch) == [0, 1]
    assert ids(sched.running) == [0, 1] and ids(sched.waiting) == [2]
    assert [r.status for r in reqs] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]


def test_a_finished_request_makes_room_for_the_next_waiting_one():
    new = Factory()
    sched = make_scheduler(max_num_reqs=2)
    short = new(4, max_tokens=4)
    for req in (short, new(6), new(6)):
        sched.add(req)
    forward(sched, sched.schedule())
    assert short.completion_reason is CompletionReason.MAX_TOKENS
    assert short.status is RequestStatus.FINISHED and short.page_table == []
    assert ids(sched.schedule()) == [1, 2]


def test_admission_stops_at_the_token_budget():
    new = Factory()
    sched = make_scheduler(budget=20)
    sched.add(new(10))  # query [0, 16) once its second block opens
    sched.add(new(10))  # estimate 12 + one block = 16 > 20 - 16
    assert ids(sched.schedule()) == [0]
    assert ids(sched.waiting) == [1]


def test_admission_within_the_token_budget_takes_several_requests():
    new = Factory()
    sched = make_scheduler(budget=32)
    for _ in range(3):
        sched.add(new(10))
    # the first opens a second block once admitted (query 16); the second's estimate 12 + 4 fits the rest
    assert ids(sched.schedule()) == [0, 1]
    assert ids(sched.waiting) == [2]


def test_admission_is_fcfs_a_blocked_head_blocks_the_queue():
    new = Factory()
    sched = make_scheduler(budget=30)
    sched.add(new(10))  # 16 tokens once admitted: 14 left
    sched.add(new(30))  # estimate 32 + 4: too long for the rest of the budget
    sched.add(new(2))  # estimate 4 + 4 would fit, but must not overtake
    assert ids(sched.schedule()) == [0]
    assert ids(sched.waiting) == [1, 2]


def test_a_long_first_request_is_always_admitted_alone():
    new = Factory()
    sched = make_scheduler(budget=8)
    sched.add(new(50))
    sched.add(new(2))
    assert ids(sched.schedule()) == [0]
    assert ids(sched.waiting) == [1]


def test_admission_needs_free_pages():
    new = Factory()
    sched = make_scheduler(num_pages=3)
    sched.add(new(8))  # 2 pages
    sched.add(new(8))  # 2 more: only 1 left
    assert ids(sched.schedule()) == [0]
    assert ids(sched.waiting) == [1]


# ----- scheduling order -------------------------------------------------------------------------------------


def test_running_requests_are_scheduled_before_waiting_ones():
    new = Factory()
    sched = make_scheduler()
    sched.add(new(6))
    forward(sched, sched.schedule())
    sched.add(new(6))
    batch = sched.schedule()
    assert ids(batch) == [0, 1]


def test_running_requests_take_the_request_slots_first():
    new = Factory()
    sched = make_scheduler(max_num_reqs=1)
    sched.add(new(6))
    forward(sched, sched.schedule())
    sched.add(new(6))
    assert ids(sched.schedule()) == [0]
    assert ids(sched.waiting) == [1]


def test_running_requests_are_not_limited_by_the_token_budget():
    new = Factory()
    sched = make_scheduler(budget=1)
    sched.add(new(10))
    forward(sched, sched.schedule())
    sched.add(new(2))
    batch = sched.schedule()
    assert ids(batch) == [0]  # scheduled although its query exceeds the budget; the waiting one is not
    assert ids(sched.waiting) == [1]


def test_each_scheduled_request_opens_its_next_block_when_allowed():
    new = Factory()
    sched = make_scheduler()
    req = new(8)
    sched.add(req)
    sched.schedule()
    assert [b.index for b in req.running] == [2]
    assert req.query_range() == (0, 12)


# ----- preemption -------------------------------------------------------------------------------------------


def _three_requests_one_page_short():
    """Three requests of one prompt block each in a 4-page pool; after one forward each needs one more page."""
    new = Factory()
    sched = make_scheduler(num_pages=4)
    reqs = [new(4) for _ in range(3)]
    for req in reqs:
        sched.add(req)
    batch = sched.schedule()
    assert ids(batch) == [0, 1, 2] and sched.kv_cache.num_free_pages == 1
    forward(sched, batch)  # block 1 of each is complete and commits: each needs a second page
    assert all(r.blocks[1].status is BlockStatus.TO_CACHE for r in reqs)
    return sched, reqs, new


def test_out_of_pages_preempts_the_most_recently_admitted_running_request():
    sched, (r0, r1, r2), new = _three_requests_one_page_short()
    late = new(4)
    sched.add(late)
    tokens = list(r2.token_ids)
    batch = sched.schedule()
    assert ids(batch) == [0, 1]
    assert ids(sched.running) == [0, 1]
    assert ids(sched.waiting) == [2, late.req_id]  # the preempted request goes to the front
    assert r2.status is RequestStatus.WAITING and r2.num_preemptions == 1
    assert r2.page_table == [] and r2.page_hashes == []
    assert r2.token_ids == tokens
    assert [b.status for b in r2.blocks] == [BlockStatus.TO_CACHE, BlockStatus.TO_CACHE]
    assert r2.num_cached_blocks == 0
    assert len(r0.page_table) == len(r1.page_table) == 2
    assert sched.kv_cache.num_free_pages == 0


def test_a_preempted_request_is_readmitted_and_recomputes_its_committed_blocks():
    sched, (r0, r1, r2), _ = _three_requests_one_page_short()
    sched.schedule()  # preempts r2
    sched.abort(r0.req_id)  # frees two pages
    batch = sched.schedule()
    assert ids(batch) == [1, 2]
    assert r2.status is RequestStatus.RUNNING and len(r2.page_table) == 2
    assert r2.query_range()[0] == 0  # its committed blocks are computed (and stored) again
    assert ids(sched.running) == [1, 2]


def test_the_newest_request_preempts_itself_when_it_is_the_one_short_of_pages():
    new = Factory()
    sched = make_scheduler(num_pages=3)
    r0, r1 = new(4), new(4)
    sched.add(r0)
    sched.add(r1)
    forward(sched, sched.schedule())
    batch = sched.schedule()  # r0 takes the last free page; r1 is the newest: it goes
    assert ids(batch) == [0]
    assert ids(sched.waiting) == [1] and r1.page_table == []
    assert r1.status is RequestStatus.WAITING


def _history(reserve: bool, num_pages: int, lengths: list[int], steps: int = 14) -> list[tuple]:
    """Batches, queues and preemptions of a run with too few pages, with or without loans to running blocks."""
    new = Factory()
    sched = make_scheduler(num_pages=num_pages, reserve=reserve)
    for n in lengths:
        sched.add(new(n, max_tokens=12))
    history = []
    for _ in range(steps):
        batch = sched.schedule()
        history.append((ids(batch), ids(sched.waiting), [r.num_preemptions for r in batch]))
        forward(sched, batch)
    return history


def test_pages_lent_to_running_blocks_never_change_admission_or_preemption():
    assert _history(True, 6, [4, 5, 3, 6]) == _history(False, 6, [4, 5, 3, 6])
    assert _history(True, 40, [4, 5, 3, 6]) == _history(False, 40, [4, 5, 3, 6])


def test_a_page_lent_to_a_running_block_goes_back_for_a_newcomer():
    for reserve in (False, True):
        new = Factory()
        sched = make_scheduler(num_pages=3, reserve=reserve)
        r0 = new(4)
        sched.add(r0)
        sched.schedule()
        (target,) = r0.sample_targets()
        sched.finish_step(r0, [(target.positions[0], 7)])  # its running block stays active: a page on loan
        late = new(8)  # two prompt blocks: it needs the two pages r0's committed prompt leaves
        sched.add(late)
        assert ids(sched.schedule()) == [0, 1], f"reserve={reserve}"


def test_running_blocks_get_their_pages_while_free_pages_last():
    new = Factory()
    sched = make_scheduler(num_pages=3, reserve=True)
    r0, r1 = new(4), new(4)
    sched.add(r0)
    sched.add(r1)
    sched.schedule()
    # each has its prompt block's page; r0 is lent the page of its running block, r1 finds none left
    assert len(r0.page_table) == 2 and len(r1.page_table) == 1
    assert sched.kv_cache.num_free_pages == 0


def test_a_waiting_request_is_admitted_next_only_once_its_pages_are_free_beside_the_running_ones():
    """`admits_waiting`, which the engine asks before it continues a step on the device: a free slot is not
    enough, the waiting request's committed prefix must fit the pages the running requests leave (their loans
    taken back first)."""
    new = Factory()
    sched = make_scheduler(num_pages=4, page_size=BLOCK, reserve=True)
    running = new(8)  # two pages of prompt
    sched.add(running)
    sched.schedule()
    assert not sched.admits_waiting(), "nobody waits"
    waiting = new(12)  # three pages of prompt: more than the pool has left
    sched.add(waiting)
    assert not sched.slots_full() and not sched.admits_waiting()
    sched.finish(running, CompletionReason.MAX_TOKENS)
    assert sched.admits_waiting()


# ----- finishing and abort ----------------------------------------------------------------------------------


def test_finish_step_counts_the_forward_and_returns_the_filled_positions():
    new = Factory()
    sched = make_scheduler()
    req = new(6)
    sched.add(req)
    sched.schedule()
    assert sched.finish_step(req, [(6, 7)]) == 1
    assert req.nfe == 1 and req.status is RequestStatus.RUNNING


def test_a_finished_request_frees_its_pages():
    new = Factory()
    sched = make_scheduler(num_pages=8)
    req = new(8, max_tokens=4)
    sched.add(req)
    forward(sched, sched.schedule())
    assert req.completion_reason is CompletionReason.MAX_TOKENS
    assert not sched.has_unfinished()
    assert sched.kv_cache.num_free_pages == 8


def test_abort_of_a_waiting_request():
    new = Factory()
    sched = make_scheduler(max_num_reqs=1)
    r0, r1 = new(6), new(6)
    sched.add(r0)
    sched.add(r1)
    sched.schedule()
    assert sched.abort(r1.req_id) is r1
    assert r1.completion_reason == "aborted" and r1.status is RequestStatus.FINISHED
    assert list(sched.waiting) == [] and r1.page_table == []
    assert ids(sched.running) == [0]


def test_abort_of_a_preempted_waiting_request():
    sched, (_, _, r2), _ = _three_requests_one_page_short()
    sched.schedule()
    free = sched.kv_cache.num_free_pages
    assert sched.abort(r2.req_id) is r2
    assert r2.completion_reason is CompletionReason.ABORTED
    assert sched.kv_cache.num_free_pages == free  # it held no pages any more


def test_abort_of_a_running_request_frees_its_pages():
    new = Factory()
    sched = make_scheduler(num_pages=8)
    req = new(10)
    sched.add(req)
    sched.schedule()
    assert sched.kv_cache.num_free_pages == 6
    assert sched.abort(req.req_id) is req
    assert req.completion_reason == "aborted" and req.status is RequestStatus.FINISHED
    assert req.page_table == [] and list(sched.running) == []
    assert sched.kv_cache.num_free_pages == 8
    assert all(c == 0 for c in sched.kv_cache.ref_counts)


def test_abort_of_an_unknown_or_finished_request_returns_none():
    new = Factory()
    sched = make_scheduler()
    req = new(6)
    sched.add(req)
    assert sched.abort(99) is None
    assert sched.abort(req.req_id) is req
    assert sched.abort(req.req_id) is None


# ----- chunked prefill -----------------------------------------------------------------------------------


def make_chunking_scheduler(budget: int) -> Scheduler:
    return Scheduler(SchedulerLimits(8, budget, chunked_prefill=True), KVCacheManager(64, BLOCK, False))


def test_a_prompt_beyond_the_budget_is_computed_in_whole_blocks_that_sample_nothing():
    make = Factory()
    sched = make_chunking_scheduler(budget=12)
    req = make(42)  # ten prompt blocks, then a running block holding the last two prompt tokens
    sched.add(req)
    queries = []
    while req.nfe == 0:
        (scheduled,) = sched.schedule()
        queries.append(req.query_range())
        chunk = req.prefill_chunk_end is not None
        assert not (chunk and req.sample_targets()), "a prefill chunk samples nothing"
        forward(sched, [scheduled])
    # the last step fits the budget whole: the rest of the prefix, the running block and the block it opens
    assert queries == [(0, 12), (12, 24), (24, 36), (36, 48)]
    assert req.num_cached_blocks == 10 and req.prefill_chunk_end is None
    assert req.nfe == 1, "only the step that decoded counts as a function evaluation"


def test_decoding_requests_take_their_rows_before_a_prefill_chunk():
    make = Factory()
    sched = make_chunking_scheduler(budget=12)
    long, short = make(40), make(3)
    sched.add(long)
    assert sched.schedule() == [long] and long.query_range() == (0, 12)
    sched.add(short)
    assert sched.schedule(busy={long.req_id}) == [short]  # admitted while the chunk is in flight
    forward(sched, [long, short])
    batch = sched.schedule()  # the short request stores its two decoded blocks: 8 rows of the 12
    assert ids(batch) == [short.req_id, long.req_id]
    rows = [end - start for start, end in (r.query_range() for r in batch)]
    assert rows == [8, 4] and sum(rows) <= 12
    assert long.prefill_chunk_end == 16 and not long.sample_targets()


def test_a_prefill_waits_when_the_decoders_leave_less_than_a_block():
    make = Factory()
    sched = make_chunking_scheduler(budget=10)
    long, short = make(40), make(3)
    sched.add(long)
    sched.schedule()
    sched.add(short)
    sched.schedule(busy={long.req_id})
    forward(sched, [long, short])
    assert sched.schedule() == [short], "two rows left: not one whole prompt block"
    assert long.prefill_chunk_end is None and long.num_cached_blocks == 2


def make_graph_chunking_scheduler(budget: int, prefill_chunk_rows: int) -> Scheduler:
    limits = SchedulerLimits(8, budget, chunked_prefill=True, prefill_chunk_rows=prefill_chunk_rows)
    return Scheduler(limits, KVCacheManager(64, BLOCK, False))


def test_beside_decoders_a_prompt_takes_no_more_rows_than_the_largest_prefill_graph():
    make = Factory()
    sched = make_graph_chunking_scheduler(budget=64, prefill_chunk_rows=9)
    short = make(3)
    sched.add(short)
    forward(sched, sched.schedule())
    long = make(30)  # 28 rows of prefix: the budget holds them, the prefill graphs do not
    sched.add(long)
    batch = sched.schedule()
    assert ids(batch) == [short.req_id, long.req_id]
    assert long.query_range() == (0, 8) and long.prefill_chunk_end == 8, "two whole blocks within 9 rows"
    forward(sched, batch)
    while long.prefill_end - long.num_cached_tokens > 9:
        batch = sched.schedule()
        assert long.prefill_chunk_end is not None and long.query_range()[1] - long.query_range()[0] <= 9
        forward(sched, batch)
    batch = sched.schedule()  # the rest of the prefix fits: the request runs whole, its running set included
    assert long in batch and long.prefill_chunk_end is None
    assert long.store_only_end() - long.query_range()[0] <= 9


def test_a_prompt_with_no_decoder_beside_it_takes_the_whole_budget():
    make = Factory()
    sched = make_graph_chunking_scheduler(budget=64, prefill_chunk_rows=9)
    long = make(30)
    sched.add(long)
    assert sched.schedule() == [long]
    assert long.prefill_chunk_end is None, "one forward: there are no decode rows to keep on the graphs"
    assert long.query_range()[0] == 0 and long.store_only_end() == 28


# ----- chunks sized by cost ---------------------------------------------------------------------------------

COST_MODEL = PrefillCostModel(parity_context=32)  # a row after 32 cached tokens costs two rows after none


def make_cost_scheduler(max_cost: int, budget: int = 4096) -> Scheduler:
    limits = SchedulerLimits(8, budget, chunked_prefill=True, max_prefill_chunk_cost=max_cost,
                             prefill_cost_model=COST_MODEL)
    return Scheduler(limits, KVCacheManager(512, BLOCK, False))


def prompt_rows(req: Request) -> tuple[int, int]:
    """(first row, rows) of the prompt rows ``req`` computes this step: the store-only rows before its running set."""
    start = req.query_range()[0]
    end = req.store_only_end()
    return start, 0 if end is None else end - start


def start_decoding(sched: Scheduler, make: Factory) -> Request:
    decoder = make(3, max_tokens=800)
    sched.add(decoder)
    forward(sched, sched.schedule())
    assert decoder.nfe == 1
    return decoder


def test_beside_a_decoder_a_prompt_takes_the_rows_whose_cost_fits_and_its_chunks_shrink_as_its_context_grows():
    make = Factory()
    sched = make_cost_scheduler(max_cost=24)
    decoder = start_decoding(sched, make)
    long = make(120)
    sched.add(long)
    chunks = []
    while long.nfe == 0:
        batch = sched.schedule()
        assert decoder in batch and long in batch, "the decoder and the prompt both run in every step"
        start, rows = prompt_rows(long)
        chunks.append(rows)
        cost = COST_MODEL.rows_cost(rows, start)
        assert cost <= 24 or rows == BLOCK, f"rows [{start}, {start + rows}) cost {cost:.1f} of 24"
        # the most whole blocks the cost allows: one more would not fit
        assert rows == BLOCK or COST_MODEL.rows_cost(rows + BLOCK, start) > 24 or start + rows == 120
        forward(sched, batch)
    assert sum(chunks) == 120
    assert chunks[0] == 16 and chunks[-1] == BLOCK, chunks
    assert chunks == sorted(chunks, reverse=True), f"the chunks grow no larger as the context grows: {chunks}"


def test_a_prompt_with_no_decoder_beside_it_takes_the_whole_token_budget_whatever_its_cost():
    make = Factory()
    sched = make_cost_scheduler(max_cost=24, budget=64)
    long = make(120)
    sched.add(long)
    assert sched.schedule() == [long]
    assert prompt_rows(long) == (0, 64)


def test_the_first_prompt_of_a_step_gets_one_block_beyond_the_cost_budget_and_the_next_prompt_waits():
    make = Factory()
    sched = make_cost_scheduler(max_cost=1)  # not even one row fits
    decoder = start_decoding(sched, make)
    first, second = make(12), make(12)
    sched.add(first)
    sched.add(second)
    computed = []
    while first.nfe == 0 or second.nfe == 0:
        batch = sched.schedule()
        assert decoder in batch
        computed.append([prompt_rows(r)[1] for r in (first, second) if r in batch])
        forward(sched, batch)
    # one block a step, the first prompt's three before the second's (which then runs beside two decoders)
    assert computed == [[BLOCK]] * 3 + [[0, BLOCK]] * 3, computed


def test_a_prompt_beside_decoders_in_flight_is_held_to_the_cost_budget():
    """With micro-batches the decoders may be in flight while the prompt's batch is formed: they still wait for it."""
    make = Factory()
    sched = make_cost_scheduler(max_cost=24)
    decoder = start_decoding(sched, make)
    long = make(120)
    sched.add(long)
    assert sched.schedule(busy={decoder.req_id}) == [long]
    assert prompt_rows(long) == (0, 16)


def test_with_prompts_arriving_while_others_decode_no_step_exceeds_the_cost_budget_but_by_one_block():
    """Prompts of many lengths arrive every few steps; in each step the prompt rows cost at most the budget, or are
    the one block of the step's only prompt, and every prompt reaches its decoding."""
    make = Factory()
    sched = make_cost_scheduler(max_cost=40, budget=64)
    start_decoding(sched, make)
    arrivals = [make(n, max_tokens=8) for n in (50, 7, 90, 33, 120, 12, 64, 3, 100)]
    for step in range(400):
        if step % 5 == 0 and arrivals:
            sched.add(arrivals.pop(0))
        batch = sched.schedule()
        computing = [prompt_rows(r) for r in batch if prompt_rows(r)[1] > 0]
        cost = sum(COST_MODEL.rows_cost(rows, start) for start, rows in computing)
        assert cost <= 40 or [rows for _, rows in computing] == [BLOCK], f"step {step}: {computing} cost {cost:.1f}"
        assert sum(end - start for start, end in (r.query_range() for r in batch)) <= 64 or len(batch) == 1
        forward(sched, batch)
        if not arrivals and len(sched.running) == 1 and not sched.waiting:
            break
    assert not arrivals and not sched.waiting and len(sched.running) == 1, "every prompt decoded and finished"
