"""The Fast-dLLM v2 request without a model: which forward each step runs, what it computes, stores and samples.

Each test drives a `FastDllmV2Request` in the engine's order (activate, build the forward, write the sampled
tokens, commit, count the forward, check completion), standing in for the sampler. Blocks are 8 positions of two
4-position sub-blocks (``block_size=8, buffer_size=2`` in `DecodeSettings`, whose ``block_size`` is the span).
"""

from __future__ import annotations

import dataclasses

import pytest

from diffulex.sampling_params import SamplingParams
from diffulex.strategy.block import BlockStatus
from diffulex.strategy.fast_dllm_v2 import FastDllmV2Options
from diffulex.strategy.fast_dllm_v2.request import FastDllmV2Request, ForwardKind
from diffulex.strategy.request import CompletionReason, DecodeSettings

MASK = 99
EOS = 98
TOK = 7

SETTINGS = DecodeSettings(
    block_size=8, buffer_size=2, mask_token_id=MASK, max_model_len=1000, stop_token_ids=frozenset({EOS}),
    accept_threshold=0.9, add_block_threshold=0.0, semi_complete_threshold=0.0, auto_max_nfe_warmup_steps=8,
    auto_max_nfe_tpf_floor=1.0, logits_shift=True, options=FastDllmV2Options(),
)  # fmt: skip


def make_request(prompt_len: int, max_tokens: int = 16, use_block_cache: bool = True) -> FastDllmV2Request:
    settings = dataclasses.replace(SETTINGS, options=FastDllmV2Options(fdv2_use_block_cache=use_block_cache))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return FastDllmV2Request(0, [10 + i for i in range(prompt_len)], params, settings)


def step(req: FastDllmV2Request, take: int = 1, token: int = TOK) -> tuple[ForwardKind, tuple[int, int], list[int]]:
    """One engine step writing ``token`` at the first ``take`` sampled positions; returns the forward's kind,
    query range and sampled positions."""
    req.maybe_activate_block()
    kind, query = req.forward_kind(), req.query_range()
    positions = [p for target in req.sample_targets() for p in target.positions]
    req.apply_tokens([(p, token) for p in positions[:take]])
    req.retire_and_commit()
    req.nfe += 1
    reason = req.check_completion()
    if reason is not None:
        req.completion_reason = reason
    return kind, query, positions


def test_a_block_is_refined_sub_block_by_sub_block_then_committed() -> None:
    """Prompt of 5: the first block [0, 8) holds it; one token per forward."""
    req = make_request(5)
    assert step(req) == (ForwardKind.INIT, (0, 8), [5, 6, 7])  # the whole block, prompt included
    assert req.kept_tokens == [10, 11, 12, 13, 14, MASK, MASK, MASK] and req.kept_in_cache
    assert step(req) == (ForwardKind.REFINE, (4, 8), [6, 7])  # only the current sub-block
    assert step(req) == (ForwardKind.REFINE, (4, 8), [7])
    assert req.blocks[0].status is BlockStatus.TO_CACHE
    # the commit forward stores the block and its last row predicts the next block's first position
    kind, query, positions = step(req)
    assert (kind, query, positions) == (ForwardKind.COMMIT, (0, 8), [8])
    assert req.num_cached_blocks == 1 and req.token_ids[8] == TOK
    assert step(req) == (ForwardKind.INIT, (8, 16), [9, 10, 11])


def test_a_refinement_reads_the_rest_of_its_block_from_the_cache_and_stores_nothing() -> None:
    req = make_request(5)
    step(req)
    req.maybe_activate_block()
    block = req.blocks[0]
    assert req.forward_kind() is ForwardKind.REFINE
    assert req.query_range() == (4, 8) and req.keys_end() == 8
    assert not req.stores_kv(block)
    assert req.stored_len == 8  # the kept K/V lives in the block's pages


def test_a_whole_block_forward_keeps_the_block_only_with_the_block_cache() -> None:
    on, off = make_request(5), make_request(5, use_block_cache=False)
    for req in (on, off):
        req.maybe_activate_block()
    assert on.stores_kv(on.blocks[0]) and on.stored_len == 8
    assert not off.stores_kv(off.blocks[0]) and off.stored_len == 0
    kinds = [step(off)[0] for _ in range(3)]
    assert kinds == [ForwardKind.INIT] * 3 and off.kept_tokens is None


def test_a_sub_block_that_starts_with_a_mask_gets_a_whole_block_forward_again() -> None:
    """Prompt of 9: block [8, 16); its first sub-block [8, 12) then the second [12, 16), which starts with a mask."""
    req = make_request(9)
    assert step(req, take=3) == (ForwardKind.INIT, (0, 16), [9, 10, 11])  # stores the prompt's block [0, 8)
    assert step(req, take=2) == (ForwardKind.INIT, (8, 16), [12, 13, 14, 15])
    assert step(req)[:2] == (ForwardKind.REFINE, (12, 16))


def test_a_prompt_ending_on_a_block_boundary_starts_with_a_commit_forward() -> None:
    req = make_request(16)
    assert step(req) == (ForwardKind.COMMIT, (0, 16), [16])
    assert req.num_cached_blocks == 2
    assert step(req)[:2] == (ForwardKind.INIT, (16, 24))


def test_a_prefix_cache_hit_over_the_whole_prompt_recomputes_only_its_last_row() -> None:
    req = make_request(16)
    req.maybe_activate_block()
    req.mark_prefix_cached(16)
    assert req.forward_kind() is ForwardKind.COMMIT and req.query_range() == (15, 16)
    assert not any(req.stores_kv(b) for b in req.blocks[:2])


def test_after_a_preemption_the_kept_kv_is_rebuilt_from_the_tokens_it_was_computed_from() -> None:
    req = make_request(5)
    step(req)  # INIT keeps [10..14, MASK, MASK, MASK]; writes position 5
    req.forget_cache()
    req.maybe_activate_block()
    assert req.forward_kind() is ForwardKind.REBUILD
    assert req.query_range() == (0, 8)
    assert req.input_token_ids(0, 8) == [10, 11, 12, 13, 14, MASK, MASK, MASK]
    assert req.token_ids[5] == TOK  # the sequence itself keeps the decoded token
    assert req.stores_kv(req.blocks[0]) and req.sample_targets() == []
    cap = req.max_nfe
    req.apply_tokens([])
    req.retire_and_commit()
    assert req.forward_kind() is ForwardKind.REFINE  # the step the preemption interrupted
    assert req.max_nfe == cap + 1  # the automatic cap on forwards does not count the rebuild


def test_a_stop_token_ends_the_request_once_its_sub_block_is_complete() -> None:
    req = make_request(5, max_tokens=30)
    step(req, token=EOS)  # position 5 is a stop token; 6 and 7 are still masks
    assert req.stop_pos == 5 and req.completion_reason is None
    kind, _, positions = step(req)
    assert kind is ForwardKind.REFINE and positions == [6, 7]  # decoded after the stop: they take part in sampling
    assert req.completion_reason is None
    step(req)
    assert req.completion_reason is CompletionReason.EOS
    assert req.answer_token_ids() == []
    assert req.sample_targets() == []  # its sub-blocks after the stop are never decoded


def test_the_generation_end_is_never_decoded_and_the_pages_cover_its_whole_block() -> None:
    req = make_request(5, max_tokens=4)  # generation end 9, inside block [8, 16)
    assert req.max_stored_len == 16
    assert make_request(5, max_tokens=4, use_block_cache=False).max_stored_len == 9
    for _ in range(3):
        step(req)
    assert step(req) == (ForwardKind.COMMIT, (0, 8), [8])
    assert req.completion_reason is CompletionReason.MAX_TOKENS
    assert req.answer_token_ids() == [TOK] * 4


@pytest.mark.parametrize("use_block_cache", [True, False])
def test_every_forward_decodes_a_token(use_block_cache: bool) -> None:
    req = make_request(3, max_tokens=20, use_block_cache=use_block_cache)
    while req.completion_reason is None:
        before = req.num_new_tokens_total
        step(req)
        assert req.num_new_tokens_total == before + 1
    assert req.nfe == 20 and req.completion_reason is CompletionReason.MAX_TOKENS


def test_a_refinement_is_continued_while_its_sub_block_has_twice_the_last_acceptance_in_masks() -> None:
    """Asked while a step is in flight (`next_step_has_same_rows`): only a refinement says its successor computes
    the same rows, and only while its sub-block has at least 2 masks and at least twice as many as the last
    forward accepted. Sub-blocks of 8 here (blocks of 32); a prompt of 9 leaves 7 masks in the second one."""
    settings = dataclasses.replace(SETTINGS, block_size=32, buffer_size=4)
    req = FastDllmV2Request(0, list(range(10, 19)), SamplingParams(temperature=0.0, max_tokens=40), settings)

    def continued() -> bool:
        req.maybe_activate_block()
        return req.next_step_has_same_rows()

    assert not continued() and req.forward_kind() is ForwardKind.INIT
    step(req)  # the whole block: 7 masks, one accepted
    assert continued() and len(req.sub_block_masks(8)) == 6
    step(req, take=3)  # 6 masks, three accepted
    assert not continued() and len(req.sub_block_masks(8)) == 3, "3 masks < 2 x 3: the sub-block may complete"
    step(req)
    assert continued() and len(req.sub_block_masks(8)) == 2
    step(req)
    assert not continued() and len(req.sub_block_masks(8)) == 1, "the last mask: the step in flight decodes it"
    assert not req.stores_when_decoded(req.open_block), "a continued refinement never stores"
    step(req)
    assert not continued() and req.forward_kind() is ForwardKind.INIT  # the next sub-block starts with a mask


def test_without_the_block_cache_no_step_is_continued() -> None:
    req = make_request(5, use_block_cache=False)
    for _ in range(6):
        req.maybe_activate_block()
        assert req.forward_kind() is not ForwardKind.REFINE and not req.next_step_has_same_rows()
        step(req)
