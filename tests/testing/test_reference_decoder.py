"""Tests of the naive reference decoder on its own: the oracle must itself follow ``docs/strategies.md``.

It is driven by the models of `stand_in_models`: a tiny real attention layer, and a scripted model whose logits
are a Python function of the sequence.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from stand_in_models import MASK, ScriptedModel, StandInModel
from torch import nn

from diffulex.attention import DenseAttentionMetadata
from diffulex.testing.reference_decoder import (
    ACTIVE,
    TO_CACHE,
    build_attention_mask,
    derived_max_nfe,
    reference_generate,
)

EOS = 2
NEVER = 1.5  # an accept threshold no confidence can exceed: every accepted token is forced


def generate(model: nn.Module, prompt: list[int], **kwargs):
    """`reference_generate` with this file's mask id; B=4, K=1, a roomy max_model_len unless told."""
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("buffer_size", 1)
    kwargs.setdefault("max_model_len", 256)
    return reference_generate(model, prompt, mask_token_id=MASK, **kwargs)


def prompt_of(length: int) -> list[int]:
    return [3 + (7 * i) % 20 for i in range(length)]


def position_token(tokens: list[int], q: int) -> tuple[int, float]:
    """Token ``10 + q % 16``, confidence falling with the position: forcing decodes left to right."""
    return 10 + q % 16, 0.8 - 0.01 * q


# ----- the attention mask ----------------------------------------------------------------------------------


def test_mask_is_block_causal_and_prefix_full_changes_only_prompt_rows() -> None:
    seq_len, block, prompt_len = 13, 4, 6
    causal = build_attention_mask(seq_len, block, prefix_full=False, prompt_len=prompt_len)
    full = build_attention_mask(seq_len, block, prefix_full=True, prompt_len=prompt_len)
    for i in range(seq_len):
        for j in range(seq_len):
            assert bool(causal[i, j]) == (j // block <= i // block)
            if i < prompt_len:
                assert bool(full[i, j]) == (j < prompt_len)
            else:
                assert bool(full[i, j]) == bool(causal[i, j])
    assert not torch.equal(causal[:prompt_len], full[:prompt_len])


@pytest.mark.parametrize("prefix_full", [False, True])
def test_every_forward_sees_the_whole_sequence_with_the_mask(prefix_full: bool) -> None:
    model = StandInModel()
    prompt = prompt_of(6)
    result = generate(
        model, prompt, buffer_size=2, max_tokens=10, accept_threshold=NEVER, prefix_full=prefix_full
    )
    assert len(model.seen_masks) == result.nfe
    for mask in model.seen_masks:
        seq_len = mask.shape[0]
        assert seq_len % 4 == 0  # always whole blocks: [0, running_end)
        assert torch.equal(mask, build_attention_mask(seq_len, 4, prefix_full, len(prompt)))


# ----- schedules worked out on paper -----------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_singlebd_one_token_per_forward_and_one_store_bubble_per_block(block_size: int) -> None:
    prompt = prompt_of(2 * block_size)  # aligned: blocks 0 and 1 are prompt, generation is blocks 2 and 3
    result = generate(
        StandInModel(),
        prompt,
        block_size=block_size,
        buffer_size=1,
        max_tokens=2 * block_size,
        accept_threshold=NEVER,
    )
    # B forwards for block 2, one store forward, B forwards for block 3; the last block finishes the request
    # as soon as it is complete, so its store forward never happens.
    assert result.nfe == 2 * block_size + 1
    assert result.tokens_per_step == [1] * block_size + [0] + [1] * block_size
    assert result.completion_reason == "max_new_tokens_reached"
    assert len(result.token_ids) == 2 * block_size and MASK not in result.token_ids
    bubble = result.trace[block_size]
    assert bubble.activated is None and bubble.running == [(2, TO_CACHE)] and bubble.accepted == []
    assert result.trace[block_size + 1].activated == 3
    assert result.nfe <= 2 * block_size + 2 + 1  # the doc's progress bound


def test_multibd_forcing_uses_the_previous_blocks_progress_before_the_step() -> None:
    prompt = prompt_of(4)
    result = generate(
        ScriptedModel(lambda tokens, q: (5, 0.5)),
        prompt,
        buffer_size=2,
        max_tokens=8,
        accept_threshold=0.9,
        semi_complete_threshold=0.9,
    )
    # Block 1 takes one forced token per forward; block 2 is activated at step 2 (progress 1/4 >= 0.1) but may
    # not force until block 1 is committed (its progress is 3/4 when step 4 starts). Block 1 is stored in
    # step 5 while block 2 decodes: no bubble.
    assert [step.activated for step in result.trace] == [1, 2, None, None, None, None, None, None]
    assert result.tokens_per_step == [1] * 8
    assert result.trace[4].running == [(1, TO_CACHE), (2, ACTIVE)]
    assert result.token_ids == [5] * 8 and result.nfe == 8

    semi = generate(
        ScriptedModel(lambda tokens, q: (5, 0.5)),
        prompt,
        buffer_size=2,
        max_tokens=8,
        accept_threshold=0.9,
        semi_complete_threshold=0.7,
    )
    # Now block 2 may force from step 4 on (block 1 at 3/4 >= 0.7).
    assert semi.tokens_per_step == [1, 1, 1, 2, 1, 1, 1]
    assert semi.completion_reason == "max_new_tokens_reached"


def test_add_block_threshold_delays_activation() -> None:
    result = generate(
        ScriptedModel(position_token),
        prompt_of(4),
        buffer_size=2,
        max_tokens=8,
        accept_threshold=NEVER,
        add_block_threshold=0.5,
    )
    assert [step.activated for step in result.trace][:4] == [1, None, 2, None]


def test_forcing_picks_the_most_confident_position_first_lowest_on_ties() -> None:
    def script(tokens: list[int], q: int) -> tuple[int, float]:
        # 5 and 6 get identical logit rows, so their float32 confidences are exactly equal.
        return {5: (20, 0.6), 6: (20, 0.6), 7: (17, 0.2)}.get(q, (14, 0.3))

    result = generate(ScriptedModel(script), prompt_of(4), max_tokens=4, accept_threshold=NEVER)
    assert [step.accepted for step in result.trace] == [[(5, 20)], [(6, 20)], [(4, 14)], [(7, 17)]]


def test_the_decision_margin_is_the_distance_of_the_closest_decision_from_flipping() -> None:
    """A tie in the forced choice has no margin; otherwise the margin is the smallest gap a decision rested on (here
    the forced position's confidence against the runner-up's, or a confidence against the threshold)."""

    def tied(tokens: list[int], q: int) -> tuple[int, float]:
        return {5: (20, 0.6), 6: (20, 0.6), 7: (17, 0.2)}.get(q, (14, 0.3))

    def apart(tokens: list[int], q: int) -> tuple[int, float]:
        return {5: (20, 0.6), 6: (20, 0.45), 7: (17, 0.2)}.get(q, (14, 0.3))

    assert generate(ScriptedModel(tied), prompt_of(4), max_tokens=4, accept_threshold=NEVER).min_margin == 0.0
    margin = generate(ScriptedModel(apart), prompt_of(4), max_tokens=4, accept_threshold=0.55).min_margin
    assert margin == pytest.approx(0.05, abs=1e-6)  # 0.6 just above the threshold 0.55


def test_low_threshold_accepts_several_tokens_per_forward() -> None:
    result = generate(StandInModel(), prompt_of(8), buffer_size=2, max_tokens=16, accept_threshold=0.5)
    assert max(result.tokens_per_step) > 1
    assert result.nfe < 16
    assert len(result.token_ids) == 16 and MASK not in result.token_ids


def test_greedy_tokens_are_the_argmax_of_one_whole_sequence_forward() -> None:
    model = StandInModel()
    prompt = prompt_of(8)
    result = generate(model, prompt, max_tokens=4, accept_threshold=-1.0)
    assert result.nfe == 1 and result.tokens_per_step == [4]
    # Recompute by hand: one forward over prompt + a block of masks, argmax with the mask id banned.
    ids = torch.tensor(prompt + [MASK] * 4)
    positions = torch.arange(12)
    with torch.no_grad():
        hidden = model(ids, positions, DenseAttentionMetadata(allowed=build_attention_mask(12, 4, False, 8)))
        logits = model.compute_logits(hidden[8:12])
    logits[:, MASK] = float("-inf")
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_some_confidences_of_the_stand_in_model_are_high() -> None:
    """The stand-in model is peaky enough for the threshold tests to mean something."""
    result = generate(
        StandInModel(), prompt_of(8), block_size=8, buffer_size=1, max_tokens=8, accept_threshold=0.9
    )
    assert result.tokens_per_step[0] >= 2


# ----- the prompt and the generation end -------------------------------------------------------------------


def test_partial_prompt_block_keeps_the_prompt_and_is_decoded_first() -> None:
    prompt = prompt_of(6)
    result = generate(StandInModel(), prompt, max_tokens=6, accept_threshold=NEVER)
    assert result.final_sequence[:6] == prompt
    assert result.trace[0].running == [(1, ACTIVE)] and result.trace[0].activated is None
    assert sorted(pos for step in result.trace[:2] for pos, _ in step.accepted) == [6, 7]
    # 2 forwards finish the partial block, 1 stores it, 4 decode block 2.
    assert result.tokens_per_step == [1, 1, 0, 1, 1, 1, 1]
    assert len(result.token_ids) == 6 and result.completion_reason == "max_new_tokens_reached"


def test_prompt_shorter_than_a_block_has_no_previous_block_and_may_force() -> None:
    result = generate(ScriptedModel(position_token), [4, 5], max_tokens=2, accept_threshold=NEVER)
    assert result.token_ids == [12, 13] and result.nfe == 2


def test_partial_prompt_block_progress_counts_prompt_positions() -> None:
    # Block 1 holds 3 prompt tokens: progress 3/4 >= add_block_threshold 0.5: block 2 joins the first forward.
    result = generate(
        ScriptedModel(position_token),
        prompt_of(7),
        buffer_size=2,
        max_tokens=5,
        accept_threshold=NEVER,
        add_block_threshold=0.5,
    )
    assert result.trace[0].activated == 2
    assert result.trace[0].running == [(1, ACTIVE), (2, ACTIVE)]


def test_max_model_len_cuts_the_generation() -> None:
    result = generate(
        ScriptedModel(position_token),
        prompt_of(4),
        max_tokens=8,
        max_model_len=10,
        accept_threshold=NEVER,
    )
    assert result.completion_reason == "max_model_len_reached"
    assert result.token_ids == [14, 15, 16, 17, 18, 19]
    assert result.final_sequence[10:] == [MASK, MASK]  # positions >= end are fed to the model, never decoded
    assert result.nfe == 4 + 1 + 2

    exact = generate(
        ScriptedModel(position_token),
        prompt_of(4),
        max_tokens=6,
        max_model_len=10,
        accept_threshold=NEVER,
    )
    assert exact.completion_reason == "max_new_tokens_reached" and len(exact.token_ids) == 6


def test_no_block_starts_at_or_after_end() -> None:
    result = generate(
        ScriptedModel(position_token), prompt_of(4), buffer_size=3, max_tokens=4, accept_threshold=NEVER
    )
    assert len(result.final_sequence) == 8
    assert all(step.activated in (None, 1) for step in result.trace)


# ----- what may be sampled --------------------------------------------------------------------------------


def test_mask_id_and_ids_beyond_the_vocab_limit_are_never_sampled() -> None:
    def script(tokens: list[int], q: int) -> tuple[int, float]:
        return MASK if q % 2 else 29, 0.99

    result = generate(
        ScriptedModel(script),
        prompt_of(4),
        buffer_size=2,
        max_tokens=7,
        vocab_limit=20,
        accept_threshold=NEVER,
    )
    assert len(result.token_ids) == 7
    assert all(token < 20 for token in result.token_ids)
    # Every other logit is 0: the argmax of the allowed ids is then the lowest id.
    assert set(result.token_ids) == {0}


@pytest.mark.parametrize("buffer_size", [1, 2, 3])
@pytest.mark.parametrize("prompt_len", [3, 8])
def test_answer_is_bounded_and_mask_free(buffer_size: int, prompt_len: int) -> None:
    result = generate(
        StandInModel(seed=prompt_len),
        prompt_of(prompt_len),
        buffer_size=buffer_size,
        max_tokens=9,
        accept_threshold=0.8,
    )
    assert MASK not in result.token_ids
    assert len(result.token_ids) <= 9
    assert len(result.tokens_per_step) == result.nfe
    assert result.nfe <= 9 + math.ceil(9 / 4) + 1
    assert result.final_sequence[:prompt_len] == prompt_of(prompt_len)


# ----- stop tokens -----------------------------------------------------------------------------------------


def test_stop_token_ends_the_answer_before_it() -> None:
    model = StandInModel()
    model.suppressed = {EOS}
    model.forced = {8 + 5: EOS}
    result = generate(
        model, prompt_of(8), buffer_size=2, max_tokens=16, stop_token_ids={EOS}, accept_threshold=0.9
    )
    assert result.completion_reason == "eos_token_generated"
    assert len(result.token_ids) == 5 and EOS not in result.token_ids
    assert result.final_sequence[8 + 5] == EOS


def test_ignore_eos_decodes_past_the_stop_token() -> None:
    model = StandInModel()
    model.suppressed = {EOS}
    model.forced = {8 + 5: EOS}
    result = generate(
        model,
        prompt_of(8),
        buffer_size=2,
        max_tokens=16,
        stop_token_ids={EOS},
        ignore_eos=True,
        accept_threshold=0.9,
    )
    assert result.completion_reason == "max_new_tokens_reached"
    assert len(result.token_ids) == 16 and result.token_ids[5] == EOS


def test_after_a_stop_token_only_positions_before_it_are_decoded_and_no_block_opens() -> None:
    def script(tokens: list[int], q: int) -> tuple[int, float]:
        if q == 6:
            return EOS, 0.95  # found first, in the first forward
        return 10 + q, 0.5

    result = generate(
        ScriptedModel(script),
        prompt_of(4),
        buffer_size=2,
        max_tokens=8,
        stop_token_ids={EOS},
        accept_threshold=0.9,
    )
    # Step 1: block 1 accepts 6 = EOS (0.95 > 0.9). From then on no block is activated (block 2 would have
    # joined at step 2 otherwise); steps 2-3 force 4 then 5; position 7 (after the stop) is never decoded.
    assert result.completion_reason == "eos_token_generated"
    assert result.token_ids == [14, 15]
    assert result.tokens_per_step == [1, 1, 1]
    assert result.final_sequence[7] == MASK
    assert [step.activated for step in result.trace] == [1, None, None]


def test_an_earlier_stop_token_moves_the_stop_position() -> None:
    def script(tokens: list[int], q: int) -> tuple[int, float]:
        return {5: (EOS, 0.4), 6: (EOS, 0.8), 7: (17, 0.7)}.get(q, (14, 0.5))

    result = generate(
        ScriptedModel(script),
        prompt_of(4),
        max_tokens=4,
        stop_token_ids={EOS},
        accept_threshold=NEVER,
    )
    # 6 = EOS first; then 4; then 5 = EOS: p* moves to 5 and [4, 5) is decoded.
    assert [step.accepted for step in result.trace] == [[(6, EOS)], [(4, 14)], [(5, EOS)]]
    assert result.token_ids == [14] and result.completion_reason == "eos_token_generated"


def test_tokens_accepted_with_the_stop_token_in_the_same_forward_are_written_but_cut() -> None:
    def script(tokens: list[int], q: int) -> tuple[int, float]:
        return {5: (EOS, 0.95), 6: (16, 0.95)}.get(q, (10 + q, 0.5))

    result = generate(
        ScriptedModel(script),
        prompt_of(4),
        max_tokens=4,
        stop_token_ids={EOS},
        accept_threshold=0.9,
    )
    # Step 1 accepts 5 = EOS and 6 together (decisions come from the state before the step); step 2 forces 4.
    assert result.tokens_per_step == [2, 1]
    assert result.final_sequence[4:] == [14, EOS, 16, MASK]
    assert result.token_ids == [14] and result.completion_reason == "eos_token_generated"


def test_stop_tokens_in_the_prompt_do_not_count() -> None:
    result = generate(
        ScriptedModel(position_token),
        [EOS, 5, EOS],
        max_tokens=3,
        stop_token_ids={EOS},
        accept_threshold=NEVER,
    )
    assert result.token_ids == [13, 14, 15] and result.completion_reason == "max_new_tokens_reached"


# ----- caps -----------------------------------------------------------------------------------------------


def test_max_nfe_stops_the_request_and_the_answer_ends_at_the_first_mask() -> None:
    def script(tokens: list[int], q: int) -> tuple[int, float]:
        return 10 + q, {4: 0.5, 5: 0.2, 6: 0.6, 7: 0.7}[q % 4 + 4]

    result = generate(
        ScriptedModel(script),
        prompt_of(4),
        max_tokens=8,
        max_nfe=3,
        accept_threshold=NEVER,
    )
    assert result.completion_reason == "max_nfe_reached" and result.nfe == 3
    assert result.token_ids == [14]  # 7, 6, 4 decoded; 5 is still a mask


def test_derived_max_nfe_binds_only_with_a_high_tokens_per_forward_floor() -> None:
    assert derived_max_nfe(8, 4) == 8 + 8 + 2 + 1
    kwargs = dict(max_tokens=8, accept_threshold=NEVER)
    normal = generate(ScriptedModel(position_token), prompt_of(4), **kwargs)
    assert normal.completion_reason == "max_new_tokens_reached" and normal.nfe == 9
    capped = generate(
        ScriptedModel(position_token),
        prompt_of(4),
        auto_max_nfe_warmup_steps=0,
        auto_max_nfe_tpf_floor=4.0,
        **kwargs,
    )
    assert capped.completion_reason == "max_nfe_reached" and capped.nfe == 0 + 2 + 2 + 1


def test_max_repetition_run_counts_the_answer_up_to_the_first_mask() -> None:
    left_to_right = generate(
        ScriptedModel(lambda tokens, q: (7, 0.9 - 0.01 * q)),
        prompt_of(4),
        block_size=4,
        buffer_size=1,
        max_tokens=12,
        max_repetition_run=3,
        accept_threshold=NEVER,
    )
    assert left_to_right.completion_reason == "max_repetition_run_reached"
    assert left_to_right.nfe == 3 and left_to_right.token_ids == [7, 7, 7]

    right_to_left = generate(
        ScriptedModel(lambda tokens, q: (7, 0.5 + 0.01 * q)),
        prompt_of(4),
        block_size=4,
        buffer_size=1,
        max_tokens=12,
        max_repetition_run=3,
        accept_threshold=NEVER,
    )
    # Positions 7, 6, 5 are decoded first; the answer so far stays empty until position 4 is.
    assert right_to_left.completion_reason == "max_repetition_run_reached"
    assert right_to_left.nfe == 4 and right_to_left.token_ids == [7, 7, 7, 7]


def test_completion_checks_are_made_in_the_doc_order() -> None:
    # The last token both completes the generation and makes a run: max_new_tokens wins over repetition,
    # and max_nfe is not reported when the generation is complete at the same step.
    result = generate(
        ScriptedModel(lambda tokens, q: (7, 0.5)),
        prompt_of(4),
        max_tokens=3,
        max_repetition_run=3,
        max_nfe=3,
        accept_threshold=NEVER,
    )
    assert result.completion_reason == "max_new_tokens_reached" and result.nfe == 3


def test_degenerate_requests_are_rejected() -> None:
    model = ScriptedModel(position_token)
    with pytest.raises(ValueError):
        generate(model, [], max_tokens=4)
    with pytest.raises(ValueError):
        generate(model, [5], max_tokens=0)
    with pytest.raises(ValueError):
        generate(model, [5, 6], max_tokens=4, max_model_len=2)


# ----- a real tiny SDAR checkpoint -------------------------------------------------------------------------


def test_real_tiny_sdar_checkpoint(tmp_path: Path) -> None:
    checkpoints = pytest.importorskip("diffulex.testing.checkpoints")
    loader = pytest.importorskip("diffulex.models.loader")
    pytest.importorskip("diffulex.models.sdar")  # registers the "sdar" family
    tokenizer_module = pytest.importorskip("diffulex.tokenizer")
    model_dir = checkpoints.write_tiny_checkpoint(tmp_path / "sdar", family="sdar", seed=0, init_std=0.2)
    model = loader.build_model("sdar", model_dir, torch.float32, torch.device("cpu"))
    tokenizer = tokenizer_module.load_tokenizer(model_dir)
    special = checkpoints.tiny_special_token_ids()
    mask_id, eos_id = special["<|MASK|>"], special["<|endoftext|>"]
    prompt = tokenizer.encode("hello world, this is a test")
    kwargs = dict(
        mask_token_id=mask_id, block_size=4, max_tokens=10, max_model_len=64, vocab_limit=len(tokenizer),
        stop_token_ids={eos_id}, ignore_eos=True,
    )  # fmt: skip
    single = reference_generate(model, prompt, buffer_size=1, accept_threshold=NEVER, **kwargs)
    multi = reference_generate(model, prompt, buffer_size=2, accept_threshold=0.5, **kwargs)
    for result in (single, multi):
        assert len(result.token_ids) == 10 and mask_id not in result.token_ids
        assert all(token < len(tokenizer) for token in result.token_ids)
        assert result.nfe == len(result.tokens_per_step) <= derived_max_nfe(10, 4)
        assert result.final_sequence[: len(prompt)] == prompt
    assert single.tokens_per_step == [1 if step.running[-1][1] == ACTIVE else 0 for step in single.trace]
    # Deterministic: the oracle must give the same answer twice.
    again = reference_generate(model, prompt, buffer_size=1, accept_threshold=NEVER, **kwargs)
    assert again.token_ids == single.token_ids and again.tokens_per_step == single.tokens_per_step
