"""Request block state without a model: blocks, running set, activation, sampling targets, commit, completion.

Every test builds a `Request` from hand-made `DecodeSettings` and stands in for the sampler by writing tokens
with `apply_tokens`, then calls the step functions in the engine's order (see docs/strategies.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from diffulex.sampling_params import SamplingParams
from diffulex.strategy.block import BlockStatus
from diffulex.strategy.request import CompletionReason, DecodeSettings, Request

MASK = 379
EOS = 376
IM_END = 378
TOK = 7  # an ordinary generated token

BASE = DecodeSettings(
    block_size=4,
    buffer_size=2,
    mask_token_id=MASK,
    max_model_len=1000,
    stop_token_ids=frozenset({EOS, IM_END}),
    accept_threshold=0.9,
    add_block_threshold=0.5,
    semi_complete_threshold=0.75,
    auto_max_nfe_warmup_steps=8,
    auto_max_nfe_tpf_floor=1.0,
)


def make_request(prompt_len: int, *, max_tokens: int = 16, ignore_eos: bool = False, max_nfe: int | None = None,
                 max_repetition_run: int | None = None, **settings) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, max_nfe=max_nfe,
                        max_repetition_run=max_repetition_run)
    prompt = [10 + i for i in range(prompt_len)]
    return Request(0, prompt, sp, dataclasses.replace(BASE, **settings))


def fill(req: Request, positions, token: int = TOK) -> int:
    return req.apply_tokens([(p, token) for p in positions])


def statuses(req: Request) -> list[BlockStatus]:
    return [b.status for b in req.blocks]


A, T, C = BlockStatus.ACTIVE, BlockStatus.TO_CACHE, BlockStatus.IN_CACHE


# ----- blocks at construction -------------------------------------------------------------------------------


def test_blocks_are_aligned_at_position_zero():
    req = make_request(10)
    assert [(b.index, b.start, b.end) for b in req.blocks] == [(0, 0, 4), (1, 4, 8), (2, 8, 12)]


def test_partial_prompt_block_is_active_in_running_set_with_prompt_kept_and_rest_masked():
    req = make_request(10)
    last = req.blocks[-1]
    assert last.status is A
    assert req.running == [last]
    assert req.token_ids[8:10] == [18, 19]
    assert req.token_ids[10:12] == [MASK, MASK]
    assert len(req.token_ids) == 12
    assert req.remaining(last) == 2 and req.progress(last) == 0.5


def test_partial_prompt_block_sample_targets_exclude_prompt_positions():
    req = make_request(10)
    (target,) = req.sample_targets()
    assert target.positions == [10, 11]


def test_full_prompt_blocks_start_to_cache_outside_the_running_set():
    req = make_request(10)
    assert statuses(req)[:2] == [T, T]
    aligned = make_request(8)
    assert statuses(aligned) == [T, T]
    assert aligned.running == []
    assert aligned.token_ids == aligned.prompt_token_ids


def test_prompt_shorter_than_a_block_is_one_active_block_without_predecessor():
    req = make_request(2)
    assert statuses(req) == [A]
    (target,) = req.sample_targets()
    assert target.positions == [2, 3] and target.force_allowed


# ----- activation -------------------------------------------------------------------------------------------


def test_activation_opens_a_masked_block_when_the_running_set_is_empty():
    req = make_request(8)
    assert req.maybe_activate_block()
    new = req.blocks[-1]
    assert (new.index, new.start, new.status) == (2, 8, A)
    assert req.running == [new]
    assert req.token_ids[8:12] == [MASK] * 4


def test_activation_needs_room_in_the_running_set():
    req = make_request(10, buffer_size=1)
    fill(req, [10, 11])  # the running block is complete but still in the running set
    assert not req.maybe_activate_block()
    assert len(req.blocks) == 3


def test_activation_needs_add_block_threshold_progress_on_the_newest_block():
    req = make_request(8, add_block_threshold=0.5)
    req.maybe_activate_block()
    assert not req.maybe_activate_block()  # progress 0
    fill(req, [8])
    assert not req.maybe_activate_block()  # progress 0.25 < 0.5
    fill(req, [9])
    assert req.maybe_activate_block()  # progress 0.5 >= 0.5 (inclusive)
    assert [b.index for b in req.running] == [2, 3]


def test_activation_looks_at_the_newest_block_not_the_oldest():
    req = make_request(8, buffer_size=3, add_block_threshold=0.5)
    req.maybe_activate_block()
    fill(req, [8, 9])
    assert req.maybe_activate_block()
    fill(req, [10, 11])  # the oldest running block is now complete, the newest has progress 0
    assert not req.maybe_activate_block()


def test_at_most_one_block_is_activated_per_call():
    req = make_request(8, buffer_size=4, add_block_threshold=0.0)
    assert req.maybe_activate_block()
    assert len(req.blocks) == 3
    assert req.maybe_activate_block()
    assert len(req.blocks) == 4


def test_no_block_is_activated_at_or_after_the_generation_end():
    req = make_request(8, max_tokens=4, add_block_threshold=0.0)
    assert req.maybe_activate_block()  # [8, 12): end is 12
    assert not req.maybe_activate_block()  # the next block would start at 12 == end
    assert len(req.token_ids) == 12


def test_a_block_starting_before_the_generation_end_is_activated():
    req = make_request(8, max_tokens=5, add_block_threshold=0.0)
    req.maybe_activate_block()
    assert req.maybe_activate_block()  # [12, 16) starts before end 13
    assert not req.maybe_activate_block()


def test_max_model_len_bounds_activation_too():
    req = make_request(8, max_tokens=100, max_model_len=12, add_block_threshold=0.0)
    assert req.generation_end == 12
    assert req.maybe_activate_block()
    assert not req.maybe_activate_block()


def test_no_block_is_activated_after_a_stop_token():
    req = make_request(8, add_block_threshold=0.0, buffer_size=4)
    req.maybe_activate_block()
    req.apply_tokens([(9, EOS)])
    assert req.stop_pos == 9
    assert not req.maybe_activate_block()


def test_stop_tokens_do_not_block_activation_with_ignore_eos():
    req = make_request(8, add_block_threshold=0.0, buffer_size=4, ignore_eos=True)
    req.maybe_activate_block()
    req.apply_tokens([(9, EOS)])
    assert req.stop_pos is None
    assert req.maybe_activate_block()


# ----- sample targets ---------------------------------------------------------------------------------------


def test_forcing_needs_the_previous_block_at_semi_complete_threshold():
    req = make_request(8, add_block_threshold=0.25, semi_complete_threshold=0.75)
    req.maybe_activate_block()
    (first,) = req.sample_targets()
    assert first.force_allowed  # the previous block is the prompt: progress 1
    fill(req, [8])
    req.maybe_activate_block()
    targets = req.sample_targets()
    assert [(t.block.index, t.force_allowed) for t in targets] == [(2, True), (3, False)]
    fill(req, [9])  # previous progress 0.5
    assert not req.sample_targets()[1].force_allowed
    fill(req, [10])  # previous progress 0.75 >= 0.75 (inclusive)
    assert req.sample_targets()[1].force_allowed


def test_sample_targets_are_the_masked_decodable_positions_of_active_blocks():
    req = make_request(8, max_tokens=3, add_block_threshold=0.0)
    req.maybe_activate_block()
    fill(req, [9])
    (target,) = req.sample_targets()
    assert target.positions == [8, 10]  # 9 is decoded, 11 is at/after the generation end (11)


def test_sample_targets_stop_at_the_stop_token():
    req = make_request(8)
    req.maybe_activate_block()
    req.apply_tokens([(10, EOS)])
    (target,) = req.sample_targets()
    assert target.positions == [8, 9]


def test_complete_or_committed_blocks_are_not_sample_targets():
    req = make_request(10)
    fill(req, [10, 11])
    assert req.sample_targets() == []
    req.retire_and_commit()
    assert req.blocks[2].status is T
    assert req.sample_targets() == []


# ----- retire and commit ------------------------------------------------------------------------------------


def test_to_cache_blocks_become_in_cache_and_leave_the_running_set():
    req = make_request(10)
    req.retire_and_commit()  # the prefill forward stored the two prompt blocks
    assert statuses(req) == [C, C, A]
    assert req.running == [req.blocks[2]]
    assert req.num_cached_blocks == 2


def test_a_complete_active_block_with_committed_predecessor_goes_to_cache_and_stays_running():
    req = make_request(10)
    fill(req, [10, 11])
    req.retire_and_commit()
    assert statuses(req) == [C, C, T]
    assert req.running == [req.blocks[2]]
    req.retire_and_commit()  # the next forward stores it
    assert statuses(req) == [C, C, C]
    assert req.running == []
    assert req.num_cached_blocks == 3


def test_no_commit_while_the_predecessor_is_active():
    req = make_request(8, buffer_size=3, add_block_threshold=0.25)
    req.retire_and_commit()
    req.maybe_activate_block()
    fill(req, [8])
    req.maybe_activate_block()
    fill(req, [12, 13, 14, 15])  # block 3 is complete, block 2 is not
    req.retire_and_commit()
    assert statuses(req)[2:] == [A, A]


def test_consecutive_complete_blocks_commit_in_one_scan_in_order():
    req = make_request(8, buffer_size=3, add_block_threshold=0.25)
    req.retire_and_commit()
    req.maybe_activate_block()
    fill(req, [8])
    req.maybe_activate_block()
    fill(req, [12, 13, 14, 15])
    req.retire_and_commit()
    fill(req, [9, 10, 11])
    req.retire_and_commit()
    assert statuses(req) == [C, C, T, T]
    assert [b.index for b in req.running] == [2, 3]
    req.retire_and_commit()
    assert statuses(req) == [C, C, C, C]
    assert req.running == [] and req.num_cached_blocks == 4


def walked_committed_len(req: Request) -> int:
    """The definition: the end of the committed blocks that follow the cached ones, walked block by block."""
    n = req.num_cached_tokens
    for block in req.blocks[req.num_cached_blocks :]:
        if not block.is_committed:
            break
        n = block.end
    return n


def test_committed_len_is_the_end_of_the_leading_committed_blocks_through_a_request_life():
    """It is read from the running set alone (a long prompt's blocks are not walked): the same as walking them, with
    an uncached prompt, blocks completing out of order and after each commit."""
    req = make_request(10, buffer_size=3, add_block_threshold=0.25)
    seen = [(req.committed_len, walked_committed_len(req))]
    req.retire_and_commit()
    seen.append((req.committed_len, walked_committed_len(req)))
    assert req.maybe_activate_block()
    fill(req, [10, 12])
    assert req.maybe_activate_block()
    fill(req, [16, 17, 18, 19])  # the newest block completes first
    req.retire_and_commit()
    seen.append((req.committed_len, walked_committed_len(req)))
    fill(req, [11, 13, 14, 15])
    req.retire_and_commit()
    seen.append((req.committed_len, walked_committed_len(req)))
    req.retire_and_commit()
    seen.append((req.committed_len, walked_committed_len(req)))
    assert [fast for fast, _ in seen] == [slow for _, slow in seen]
    assert [fast for fast, _ in seen] == [8, 8, 8, 20, 20]


def test_query_range_starts_at_the_cached_prefix_and_ends_at_the_running_set():
    req = make_request(10)
    assert req.query_range() == (0, 12)
    req.retire_and_commit()
    assert req.query_range() == (8, 12)


# ----- completion -------------------------------------------------------------------------------------------


def test_eos_completes_only_once_every_position_before_it_is_decoded():
    req = make_request(8)
    req.maybe_activate_block()
    req.apply_tokens([(9, EOS)])
    assert req.check_completion() is None
    fill(req, [8])
    assert req.check_completion() is CompletionReason.EOS
    assert req.answer_token_ids() == [TOK]


@pytest.mark.parametrize("stop", [EOS, IM_END])
def test_every_stop_token_ends_the_answer(stop):
    req = make_request(8)
    req.maybe_activate_block()
    req.apply_tokens([(8, TOK), (9, stop)])
    assert req.check_completion() is CompletionReason.EOS


def test_max_tokens_completes_when_every_position_up_to_the_end_is_decoded():
    req = make_request(8, max_tokens=3)
    req.maybe_activate_block()
    fill(req, [8, 9])
    assert req.check_completion() is None
    fill(req, [10])
    assert req.check_completion() is CompletionReason.MAX_TOKENS
    assert len(req.answer_token_ids()) == 3


def test_unopened_blocks_count_as_masks_for_max_tokens():
    req = make_request(8, max_tokens=6)
    req.maybe_activate_block()
    fill(req, [8, 9, 10, 11])
    assert req.check_completion() is None


def test_max_model_len_reason_when_it_sets_the_end():
    req = make_request(8, max_tokens=16, max_model_len=11)
    req.maybe_activate_block()
    fill(req, [8, 9, 10])
    assert req.check_completion() is CompletionReason.MAX_MODEL_LEN


def test_max_tokens_reason_when_max_model_len_equals_the_requested_end():
    req = make_request(8, max_tokens=3, max_model_len=11)
    req.maybe_activate_block()
    fill(req, [8, 9, 10])
    assert req.check_completion() is CompletionReason.MAX_TOKENS


def test_max_nfe_completes_at_the_cap():
    req = make_request(8, max_nfe=2)
    req.maybe_activate_block()
    req.nfe = 1
    assert req.check_completion() is None
    req.nfe = 2
    assert req.check_completion() is CompletionReason.MAX_NFE


def test_repetition_run_completes_on_a_trailing_run_of_the_answer():
    req = make_request(8, max_repetition_run=3)
    req.maybe_activate_block()
    req.apply_tokens([(8, 5), (9, 5)])
    assert req.check_completion() is None
    req.apply_tokens([(11, 5)])  # after a mask: not part of the answer yet
    assert req.check_completion() is None
    req.apply_tokens([(10, 5)])
    assert req.check_completion() is CompletionReason.REPETITION


def test_repetition_counts_only_the_trailing_run():
    req = make_request(8, max_repetition_run=3)
    req.maybe_activate_block()
    req.apply_tokens([(8, 5), (9, 5), (10, 6), (11, 6)])
    assert req.check_completion() is None


def test_completion_order_eos_before_max_tokens():
    req = make_request(8, max_tokens=3)
    req.maybe_activate_block()
    req.apply_tokens([(8, TOK), (9, TOK), (10, EOS)])
    assert req.check_completion() is CompletionReason.EOS


def test_completion_order_max_tokens_before_max_nfe():
    req = make_request(8, max_tokens=3, max_nfe=1)
    req.maybe_activate_block()
    fill(req, [8, 9, 10])
    req.nfe = 1
    assert req.check_completion() is CompletionReason.MAX_TOKENS


def test_completion_order_eos_before_max_nfe():
    req = make_request(8, max_nfe=1)
    req.maybe_activate_block()
    req.apply_tokens([(8, EOS)])
    req.nfe = 1
    assert req.check_completion() is CompletionReason.EOS


def test_completion_order_max_nfe_before_repetition():
    req = make_request(8, max_nfe=1, max_repetition_run=2)
    req.maybe_activate_block()
    req.apply_tokens([(8, 5), (9, 5)])
    req.nfe = 1
    assert req.check_completion() is CompletionReason.MAX_NFE


def test_completion_order_max_tokens_before_repetition():
    req = make_request(8, max_tokens=2, max_repetition_run=2)
    req.maybe_activate_block()
    req.apply_tokens([(8, 5), (9, 5)])
    assert req.check_completion() is CompletionReason.MAX_TOKENS


# ----- the answer -------------------------------------------------------------------------------------------


def test_answer_stops_at_the_first_mask():
    req = make_request(8)
    req.maybe_activate_block()
    req.apply_tokens([(8, 1), (9, 2), (11, 4)])
    assert req.answer_token_ids() == [1, 2]
    assert MASK not in req.answer_token_ids()


def test_answer_excludes_the_stop_token_and_what_follows_it():
    req = make_request(8)
    req.maybe_activate_block()
    req.apply_tokens([(8, 1), (9, EOS), (10, 3), (11, 4)])
    assert req.answer_token_ids() == [1]


def test_the_earliest_stop_token_wins():
    req = make_request(8)
    req.maybe_activate_block()
    req.apply_tokens([(11, EOS)])
    req.apply_tokens([(9, IM_END)])
    assert req.stop_pos == 9
    req.apply_tokens([(8, 1)])
    assert req.answer_token_ids() == [1]
    assert req.check_completion() is CompletionReason.EOS


def test_answer_keeps_stop_tokens_with_ignore_eos():
    req = make_request(8, ignore_eos=True)
    req.maybe_activate_block()
    req.apply_tokens([(8, 1), (9, EOS), (10, 3)])
    assert req.answer_token_ids() == [1, EOS, 3]
    assert req.check_completion() is None


def test_answer_never_exceeds_max_tokens():
    req = make_request(8, max_tokens=2)
    req.maybe_activate_block()
    req.apply_tokens([(8, 1), (9, 2), (10, 3)])  # position 10 is past the end: cut from the answer
    assert req.answer_token_ids() == [1, 2]


def test_answer_excludes_the_prompt_of_a_partial_block():
    req = make_request(10)
    req.apply_tokens([(10, 1), (11, 2)])
    assert req.answer_token_ids() == [1, 2]


# ----- preemption, caps, invariants -------------------------------------------------------------------------


def test_forget_cache_turns_every_cached_block_to_cache():
    req = make_request(10)
    req.retire_and_commit()
    fill(req, [10, 11])
    req.retire_and_commit()
    req.retire_and_commit()
    req.maybe_activate_block()
    tokens = list(req.token_ids)
    assert statuses(req) == [C, C, C, A]
    req.forget_cache()
    assert statuses(req) == [T, T, T, A]
    assert req.num_cached_blocks == 0 and req.num_preemptions == 1
    assert req.token_ids == tokens
    assert req.query_range() == (0, 16)


def test_forget_cache_keeps_a_committed_block_waiting_to_be_stored():
    req = make_request(10)
    req.retire_and_commit()
    fill(req, [10, 11])
    req.retire_and_commit()
    req.forget_cache()
    assert statuses(req) == [T, T, T]
    assert req.running == [req.blocks[2]]


def test_mark_prefix_cached_sets_the_leading_blocks_in_cache():
    req = make_request(10)
    req.mark_prefix_cached(8)
    assert statuses(req) == [C, C, A]
    assert req.num_cached_tokens == 8 and req.query_range() == (8, 12)


def test_derived_max_nfe_formula():
    req = make_request(8, max_tokens=10)
    assert req.max_nfe == 8 + 10 + 3 + 1
    req = make_request(8, max_tokens=10, auto_max_nfe_tpf_floor=3.0, auto_max_nfe_warmup_steps=2)
    assert req.max_nfe == 2 + 4 + 3 + 1


def test_derived_max_nfe_never_binds_below_the_guaranteed_progress():
    for max_tokens in (1, 5, 16, 33):
        req = make_request(8, max_tokens=max_tokens)
        assert req.max_nfe > max_tokens + -(-max_tokens // 4) + 1


def test_explicit_max_nfe_wins():
    assert make_request(8, max_tokens=10, max_nfe=3).max_nfe == 3


def test_writing_an_already_decoded_position_raises():
    req = make_request(8)
    req.maybe_activate_block()
    fill(req, [8])
    with pytest.raises(RuntimeError, match="already decoded"):
        fill(req, [8])


def test_writing_a_prompt_position_raises():
    req = make_request(10)
    with pytest.raises(RuntimeError, match="already decoded"):
        fill(req, [9])


def test_apply_tokens_counts_filled_masks():
    req = make_request(8)
    req.maybe_activate_block()
    assert fill(req, [8, 10]) == 2
    assert fill(req, []) == 0
    assert req.num_new_tokens_total == 2
    assert req.frontier == 9


# ----- store-only rows (prefill graphs) -----------------------------------------------------------------------


def test_store_only_rows_end_where_the_running_set_starts():
    req = make_request(10)  # two prompt blocks to store, then the running block holding the last two prompt tokens
    assert req.query_range() == (0, 12)
    assert req.store_only_end() == 8


def test_a_request_with_its_prefix_cached_has_no_store_only_rows():
    req = make_request(10)
    req.mark_prefix_cached(8)
    assert req.store_only_end() is None
    short = make_request(3)  # the prompt lies inside its running block
    assert short.store_only_end() is None


def test_a_prefill_chunk_is_store_only_to_its_end():
    req = make_request(40)
    assert req.begin_prefill_chunk(12)
    assert req.store_only_end() == 12 == req.query_range()[1]


def test_a_prefix_hit_leaves_its_uncached_tail_store_only():
    req = make_request(22)
    req.mark_prefix_cached(8)
    assert req.query_range() == (8, 24) and req.store_only_end() == 20
    shifted = make_request(22, logits_shift=True)
    shifted.mark_prefix_cached(8)
    assert shifted.query_range() == (7, 24), "the recomputed row leads the query"
    assert shifted.store_only_end() == 20


def test_a_preempted_request_stores_its_committed_blocks_again_as_store_only_rows():
    req = make_request(6, max_tokens=16)
    req.mark_prefix_cached(4)
    fill(req, range(6, 8))
    req.retire_and_commit()  # the running block is complete: stored by the next step
    req.retire_and_commit()
    assert req.num_cached_blocks == 2
    req.maybe_activate_block()
    req.forget_cache()
    assert req.store_only_end() == 8, "both committed blocks are recomputed before the running set"


def test_a_request_that_chooses_its_own_rows_never_splits_them():
    class OwnRows(Request):
        supports_prefill_chunks = False

    sp = SamplingParams(temperature=0.0, max_tokens=8)
    req = OwnRows(0, list(range(10, 20)), sp, BASE)
    assert req.store_only_end() is None


# ----- what a forward reads and stores, without making a long prompt's blocks -------------------------------


def stored_by_walking_blocks(req: Request, lo: int, hi: int) -> list[int]:
    """The positions of ``[lo, hi)`` whose block the forward stores, block by block (this makes every block)."""
    size = req.settings.block_size
    return [p for p in range(lo, hi) if req.stores_kv(req.blocks[p // size])]


def positions_of(runs: list[tuple[int, int]]) -> list[int]:
    assert all(lo < hi for lo, hi in runs) and all(a[1] < b[0] for a, b in zip(runs, runs[1:], strict=False)), (
        "runs are non-empty, ordered and merged"
    )
    return [p for lo, hi in runs for p in range(lo, hi)]


def test_a_cold_prompt_stores_one_run_found_without_making_its_blocks():
    req = make_request(4000, buffer_size=1, max_model_len=5000)
    req.maybe_activate_block()
    start, end = req.query_range()
    assert req.stored_runs(start, end) == [(0, 4000)]
    assert req.blocks.num_made == 1  # the block opened after the prompt
    req.retire_and_commit()
    assert req.num_cached_blocks == 1000 and req.blocks.num_made == 2  # and the one before it, read for its status


@pytest.mark.parametrize("prompt_len", [13, 16])
def test_stored_runs_equal_the_blocks_walked_one_by_one_through_hits_steps_and_a_preemption(prompt_len: int):
    req = make_request(prompt_len, max_tokens=24, ignore_eos=True)
    req.mark_prefix_cached(8)  # a prefix-cache hit on two blocks
    seen = 0
    for step in range(12):
        if step == 6:
            req.forget_cache()  # preempted: every cached block is stored again
        req.maybe_activate_block()
        start, end = req.query_range()
        for lo in range(start, end + 1, 3):  # also from inside the rows (a split step stores from its prefix end)
            runs = req.stored_runs(lo, end)
            assert positions_of(runs) == stored_by_walking_blocks(req, lo, end), f"step {step}, from {lo}"
            seen += bool(runs)
        for target in req.sample_targets():
            fill(req, target.positions[:2])
        req.retire_and_commit()
    assert seen > 10


def test_token_arrays_and_input_tokens_read_the_sequence_across_the_prompt_end():
    req = make_request(10, buffer_size=1)
    req.maybe_activate_block()
    fill(req, [10, 11])
    for start, end in ((0, 10), (3, 12), (10, 12), (0, 16), (12, 16), (5, 5)):
        assert req.token_array(start, end).tolist() == req.token_ids[start:end]
        assert list(req.input_token_ids(start, end)) == req.token_ids[start:end]
    with pytest.raises(ValueError):
        req.prompt_array[0] = 1  # the prompt's tokens never change


def test_a_prompt_array_of_another_shape_or_type_is_refused():
    req = make_request(10)
    with pytest.raises(ValueError, match=r"prompt array of shape \(9,\) and dtype int64 is invalid: must be int64"):
        req.adopt_prompt_array(np.arange(9, dtype=np.int64))
    with pytest.raises(ValueError, match="dtype int32 is invalid"):
        req.adopt_prompt_array(np.arange(10, dtype=np.int32))
