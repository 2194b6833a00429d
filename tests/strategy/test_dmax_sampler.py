"""DMax sampling without a model (reference-engine §7.5): refresh of decoded tokens, masks filled as a confident
left-to-right run, and when a block is finished."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffulex.strategy.block import BlockStatus
from diffulex.strategy.dmax.sampler import DMaxSampler
from tests.strategy.test_edit_sampler import MASK, make, peaked


def dmax(fast_path: bool = True):
    """accept_threshold 0.5, below DMax's settled level of 0.9, so a block can be full and still unsettled."""
    req, edit = make()
    return req, DMaxSampler(dataclasses.replace(edit.settings, accept_threshold=0.5, dmax_fast_path=fast_path))


def step(req, sampler, tokens, confidence):
    writes = sampler(peaked(tokens, confidence), [(req, req.sample_targets())])[0]
    req.apply_tokens(writes)
    req.retire_and_commit()
    return writes


def test_masks_are_filled_as_a_confident_run_from_the_left():
    req, sampler = dmax()
    assert step(req, sampler, [5, 6, 7, 5], [0.95, 0.95, 0.3, 0.99]) == [(4, 5), (5, 6)]
    assert req.token_ids[6:8] == [MASK, MASK]  # the confident last one waits behind the unsure one


def test_an_unsure_first_mask_is_filled_alone():
    req, sampler = dmax()
    assert step(req, sampler, [5, 6, 7, 5], [0.2, 0.95, 0.95, 0.95]) == [(4, 5)]


def test_decoded_tokens_take_the_new_top1_whatever_its_confidence():
    req, sampler = dmax()
    step(req, sampler, [5, 6, 7, 5], [0.6] * 4)  # full, but not settled
    assert step(req, sampler, [5, 2, 7, 5], [0.95, 0.2, 0.95, 0.95]) == [(5, 2)]


def test_a_block_commits_when_a_step_changes_nothing():
    req, sampler = dmax(fast_path=False)
    step(req, sampler, [5, 6, 7, 5], [0.6] * 4)
    step(req, sampler, [5, 6, 3, 5], [0.95, 0.95, 0.5, 0.95])  # a change, and not all confident: goes on
    assert req.running[0].status is BlockStatus.ACTIVE
    assert step(req, sampler, [5, 6, 3, 5], [0.95, 0.95, 0.5, 0.95]) == []
    assert req.running[0].status is BlockStatus.TO_CACHE


def test_a_confident_block_commits_even_if_it_changed():
    req, sampler = dmax()
    step(req, sampler, [5, 6, 7, 5], [0.6] * 4)
    assert step(req, sampler, [5, 6, 3, 5], [0.95, 0.95, 0.5, 0.95]) == [(6, 3)]
    # fast path: decoded positions count as confident, so the block is settled although position 6 changed
    assert req.running[0].status is BlockStatus.TO_CACHE


def test_a_block_with_masks_left_is_never_finished():
    """With accept_threshold above the settled level, every position can be 'confident' while masks stay."""
    req, edit = make()
    sampler = DMaxSampler(dataclasses.replace(edit.settings, accept_threshold=0.95))
    assert step(req, sampler, [5, 6, 7, 5], [0.92] * 4) == [(4, 5)]  # below the threshold: the first mask alone
    assert not req.progress_of(req.running[0]).finished
    assert req.remaining(req.running[0]) == 3


def test_the_slow_path_reads_every_confidence():
    req, sampler = dmax(fast_path=False)
    step(req, sampler, [5, 6, 7, 5], [0.6] * 4)
    logits = peaked([5, 6, 3, 5], [0.95, 0.95, 0.5, 0.95])
    sampler(logits, [(req, req.sample_targets())])
    assert not req.sampled_blocks[1].finished  # changed and not all confident
    req.sampled_blocks = {}
    fast = DMaxSampler(dataclasses.replace(sampler.settings, dmax_fast_path=True))
    fast(torch.clone(logits), [(req, req.sample_targets())])
    assert req.sampled_blocks[1].finished


def test_decoded_positions_get_their_token_at_its_confidence_for_the_next_forward():
    from diffulex.layers.token_merge import TokenMergeSettings

    req, edit = make()
    settings = dataclasses.replace(
        edit.settings, accept_threshold=0.5, token_merge=TokenMergeSettings("dmax_topk", 1, 1.0, True, MASK)
    )
    sampler = DMaxSampler(settings)
    step(req, sampler, [5, 6, 7, 5], [0.75, 0.75, 0.25, 0.75])  # the third is below: masks 3 and 4 stay
    soft = req.soft_inputs()
    assert set(soft) == {4, 5}  # the filled masks; masks left get none
    assert soft[4].ids == (5,)
    assert soft[4].probs[0] == pytest.approx(0.75) and soft[4].residual == pytest.approx(0.25)
    step(req, sampler, [5, 6, 7, 5], [0.95] * 4)  # full and settled: the block commits
    assert req.running[0].status is BlockStatus.TO_CACHE
    assert req.soft_inputs() == {}  # a committed block's K/V comes from its final tokens


def test_the_share_of_unchanged_tokens_is_reported():
    req, sampler = dmax()
    step(req, sampler, [5, 6, 7, 5], [0.6] * 4)
    sampler(peaked([5, 6, 3, 2], [0.6] * 4), [(req, req.sample_targets())])
    assert req.sampled_blocks[1].stable_share == 0.5  # positions 6 and 7 change
