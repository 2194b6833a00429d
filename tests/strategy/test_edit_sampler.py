"""Edit-mode sampling without a model: which masks are filled, which decoded tokens are rewritten, and when a
block is finished, on hand-made logits for an `EditRequest` (reference-engine §7.4)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffulex.sampling_params import SamplingParams
from diffulex.strategy.block import BlockStatus
from diffulex.strategy.edit import EditOptions
from diffulex.strategy.edit.request import EditRequest
from diffulex.strategy.edit.sampler import EditSampler, EditSettings
from diffulex.strategy.request import DecodeSettings

MASK, EOS, VOCAB = 9, 8, 10
SETTINGS = DecodeSettings(
    block_size=4, buffer_size=1, mask_token_id=MASK, max_model_len=100, stop_token_ids=frozenset({EOS}),
    accept_threshold=0.9, add_block_threshold=1.0, semi_complete_threshold=0.9, auto_max_nfe_warmup_steps=4,
    auto_max_nfe_tpf_floor=1.0, options=EditOptions(max_post_edit_steps=2),
)  # fmt: skip


def make(edit_threshold: float = 0.5, penalty: float = 0.0, ignore_eos: bool = True) -> tuple[EditRequest, EditSampler]:
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=ignore_eos)
    req = EditRequest(0, [1, 2, 3, 4], sp, SETTINGS)
    req.maybe_activate_block()
    return req, EditSampler(EditSettings(VOCAB, MASK, 0.9, edit_threshold, penalty, base_seed=0))


def peaked(tokens: list[int], confidence: list[float]) -> torch.Tensor:
    """Logits whose top-1 is ``tokens[i]`` with softmax probability ``confidence[i]`` (the rest spread evenly over
    the other allowed ids)."""
    rows = torch.full((len(tokens), VOCAB), float("-inf"))
    allowed = VOCAB - 1  # the mask id is banned anyway
    for i, (token, p) in enumerate(zip(tokens, confidence, strict=True)):
        rest = (1 - p) / (allowed - 1)
        for t in range(allowed):
            rows[i, t] = torch.log(torch.tensor(p if t == token else rest))
    return rows


def step(req: EditRequest, sampler: EditSampler, tokens: list[int], confidence: list[float]):
    targets = req.sample_targets()
    writes = sampler(peaked(tokens, confidence), [(req, targets)])[0]
    req.apply_tokens(writes)
    req.retire_and_commit()
    req.nfe += 1
    return writes


def test_masks_above_the_threshold_are_filled_else_the_most_confident():
    req, sampler = make()
    assert step(req, sampler, [5, 6, 7, 5], [0.95, 0.5, 0.99, 0.3]) == [(4, 5), (6, 7)]
    assert step(req, sampler, [5, 6, 7, 5], [0.95, 0.6, 0.99, 0.7]) == [(7, 5)]  # none above: the best mask


def test_decoded_tokens_are_rewritten_when_the_new_proposal_is_confident():
    req, sampler = make(edit_threshold=0.5)
    step(req, sampler, [5, 6, 7, 5], [0.95, 0.95, 0.95, 0.95])
    assert req.token_ids[4:8] == [5, 6, 7, 5]
    writes = step(req, sampler, [5, 2, 3, 5], [0.9, 0.4, 0.8, 0.9])  # position 5 unsure, 6 sure and different
    assert writes == [(6, 3)]
    assert req.token_ids[4:8] == [5, 6, 3, 5]


def test_a_block_that_nothing_changes_is_finished_and_commits():
    req, sampler = make()
    step(req, sampler, [5, 6, 7, 5], [0.95] * 4)
    assert req.running[0].status is BlockStatus.ACTIVE  # full, but not yet known to be stable
    assert step(req, sampler, [5, 6, 7, 5], [0.99] * 4) == []
    assert req.progress_of(req.running[0]).finished
    assert req.running[0].status is BlockStatus.TO_CACHE


def test_a_block_that_keeps_changing_stops_after_its_post_edit_steps():
    req, sampler = make(edit_threshold=0.0)
    step(req, sampler, [5, 6, 7, 5], [0.95] * 4)
    flips = ([1, 6, 7, 5], [5, 6, 7, 5])
    for n in range(SETTINGS.options.max_post_edit_steps):
        assert step(req, sampler, flips[n % 2], [0.95] * 4) != []
    assert step(req, sampler, [2, 6, 7, 5], [0.95] * 4) == []  # its post-edit steps are used up: no write
    assert req.running[0].status is BlockStatus.TO_CACHE


def test_at_its_time_out_a_block_fills_every_mask_left():
    req2, sampler2 = make()
    req2.progress_of(req2.running[0]).steps = SETTINGS.block_size + SETTINGS.options.max_post_edit_steps - 1
    assert step(req2, sampler2, [5, 6, 7, 5], [0.2, 0.3, 0.2, 0.2]) == [(4, 5), (5, 6), (6, 7), (7, 5)]
    assert req2.running[0].status is BlockStatus.TO_CACHE


def test_an_edit_that_removes_a_stop_token_moves_the_answer_end():
    req, sampler = make(edit_threshold=0.5, ignore_eos=False)
    step(req, sampler, [5, EOS, 7, 5], [0.95] * 4)
    assert req.stop_pos == 5
    step(req, sampler, [5, 6, 7, 5], [0.95] * 4)
    assert req.stop_pos is None and req.token_ids[5] == 6


def test_the_repetition_penalty_moves_a_proposal_off_the_previous_token():
    req, sampler = make(edit_threshold=0.0, penalty=5.0)
    step(req, sampler, [5, 6, 7, 5], [0.95] * 4)
    logits = peaked([5, 5, 7, 5], [0.6, 0.6, 0.95, 0.95])
    logits[1, 3] = logits[1, 5] - 1.0  # a runner-up for position 5
    writes = sampler(logits, [(req, req.sample_targets())])[0]
    assert (5, 5) not in writes and (5, 3) in writes  # 5 would repeat position 4's token: penalized


def test_a_request_of_the_naive_mode_is_refused():
    from diffulex.strategy.request import Request

    req = Request(0, [1, 2, 3, 4], SamplingParams(max_tokens=4), dataclasses.replace(SETTINGS))
    req.maybe_activate_block()
    _, sampler = make()
    with pytest.raises(TypeError, match="EditRequest"):
        sampler(peaked([5] * 4, [0.9] * 4), [(req, req.sample_targets())])


def test_a_new_block_waits_until_the_newest_is_stable_enough():
    """``token_stability_threshold``: the newest block's decoded tokens must mostly be proposed again unchanged."""
    settings = dataclasses.replace(SETTINGS, buffer_size=2, add_block_threshold=0.75, token_stability_threshold=0.75)
    req = EditRequest(0, [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), settings)
    req.maybe_activate_block()
    _, sampler = make(edit_threshold=0.0)
    step(req, sampler, [5, 6, 7, 5], [0.95, 0.95, 0.5, 0.5])  # half decoded: not far enough along yet
    assert not req.maybe_activate_block()
    step(req, sampler, [5, 1, 7, 5], [0.95] * 4)  # full, but one of its two decoded tokens changed: 0.5 stable
    assert req.progress_of(req.running[0]).stable_share == 0.5
    assert not req.maybe_activate_block()
    step(req, sampler, [5, 1, 7, 5], [0.95] * 4)  # nothing changes: 1.0
    assert req.maybe_activate_block()


def test_a_drawing_request_draws_reproducibly_from_its_seed():
    def draws(seed: int):
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        req = EditRequest(0, [1, 2, 3, 4], sp, SETTINGS)
        req.maybe_activate_block()
        _, sampler = make()
        logits = torch.zeros(4, VOCAB)  # uniform: every allowed id equally likely
        return sampler(logits, [(req, req.sample_targets())])[0]

    assert draws(7) == draws(7)
    assert any(draws(7) != draws(s) for s in range(8, 12))


def test_a_block_cut_short_by_a_stop_token_is_not_continued_on_the_device() -> None:
    """A continued step counts a block's masks over the positions it samples; the host counts the whole block's.
    They agree while the sampled positions are the block's whole range, and a stop token inside it ends that."""
    req, _ = make(ignore_eos=False)
    req.mark_prefix_cached(req.prompt_len)  # the prompt's K/V stored: the block sits right after the cache
    block = req.running[0]
    assert req.next_step_has_same_rows()
    req.apply_tokens([(block.start + 1, EOS)])
    assert [p for t in req.sample_targets() for p in t.positions] == [block.start, block.start + 1]
    assert not req.next_step_has_same_rows()
