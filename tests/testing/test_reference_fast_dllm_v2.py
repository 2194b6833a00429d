"""Tests of the Fast-dLLM v2 reference decoder on its own: its schedule, its stops, and its block cache."""

from __future__ import annotations

import pytest
import torch
from stand_in_models import MASK, ScriptedModel, StandInModel

from diffulex.attention import DenseAttentionMetadata
from diffulex.testing.reference_decoder import build_attention_mask
from diffulex.testing.reference_fast_dllm_v2 import COMMIT, INIT, REFINE, reference_generate_fast_dllm_v2

EOS = 2
NEVER = 1.5  # a threshold no confidence exceeds: every forward takes exactly its most confident mask


def generate(model, prompt, **kwargs):
    """Sub-blocks of 4 in blocks of 8 (B=4, K=2) unless told."""
    kwargs.setdefault("block_size", 8)
    kwargs.setdefault("sub_block_size", 4)
    kwargs.setdefault("max_model_len", 256)
    return reference_generate_fast_dllm_v2(model, prompt, mask_token_id=MASK, **kwargs)


def prompt_of(length: int) -> list[int]:
    return [3 + (7 * i) % 20 for i in range(length)]


def left_to_right(tokens: list[int], q: int) -> tuple[int, float]:
    """The row at q predicts token 10 + (q + 1) % 16 for position q + 1; confidence falls with the position."""
    return 10 + (q + 1) % 16, 0.8 - 0.001 * q


def test_the_schedule_of_one_token_per_forward() -> None:
    """B=4, K=2, a 13-token prompt: the prompt tail fills the first sub-block and the first position of the
    second; each sub-block starting with a mask opens with a whole-block forward; a complete block is committed
    and its last row seeds the next block."""
    model = ScriptedModel(left_to_right)
    result = generate(model, prompt_of(13), max_tokens=11, threshold=NEVER)
    kinds = [(s.kind, s.sub_block_start) for s in result.steps]
    assert kinds == [
        (INIT, 12), (REFINE, 12), (REFINE, 12), (COMMIT, None),  # positions 13, 14, 15; then 16 is seeded
        (INIT, 16), (REFINE, 16), (REFINE, 16),  # 17, 18, 19 (16 holds the seeded token)
        (INIT, 20), (REFINE, 20), (REFINE, 20), (REFINE, 20),  # 20..23
    ]  # fmt: skip
    assert result.steps[3].written == [(16, 10 + 16 % 16)]
    assert [p for s in result.steps for p, _ in s.written] == list(range(13, 24))
    assert result.token_ids == [10 + p % 16 for p in range(13, 24)]
    assert result.completion_reason == "max_new_tokens_reached" and result.nfe == 11
    # every forward sees the sequence up to the end of its block, masks included
    assert [len(seen) for seen in model.seen_inputs] == [16, 16, 16, 16, 24, 24, 24, 24, 24, 24, 24]


def test_a_prompt_of_whole_blocks_is_committed_first_and_seeds_the_first_answer_token() -> None:
    result = generate(ScriptedModel(left_to_right), prompt_of(16), max_tokens=4, threshold=NEVER)
    assert result.steps[0].kind == COMMIT and result.steps[0].written == [(16, 10 + 16 % 16)]
    assert [s.kind for s in result.steps[1:]] == [INIT, REFINE, REFINE]


def test_confident_masks_are_taken_together_and_the_shift_reads_the_row_before() -> None:
    model = ScriptedModel(lambda tokens, q: (20 + q % 8, 0.99))
    result = generate(model, prompt_of(8), max_tokens=8, threshold=0.9, use_block_cache=False)
    # one whole-block forward per sub-block, after the prompt block's commit
    assert [s.kind for s in result.steps] == [COMMIT, INIT, INIT]
    assert result.token_ids == [20 + (p - 1) % 8 for p in range(8, 16)]


def test_a_stop_token_ends_the_request_once_its_sub_block_is_complete() -> None:
    def stop_at_18(tokens: list[int], q: int) -> tuple[int, float]:
        return (EOS, 0.7) if q + 1 == 18 else left_to_right(tokens, q)

    result = generate(ScriptedModel(stop_at_18), prompt_of(13), max_tokens=30, threshold=NEVER, stop_token_ids={EOS})
    assert result.completion_reason == "eos_token_generated"
    assert result.token_ids == [10 + p % 16 for p in range(13, 18)]
    assert result.steps[-1].sub_block_start == 16 and result.steps[-1].kind != COMMIT  # no commit after a stop
    assert result.final_sequence[19] != MASK  # the stop token's sub-block was finished


def test_positions_past_max_model_len_are_never_decoded() -> None:
    result = generate(ScriptedModel(left_to_right), prompt_of(13), max_tokens=30, max_model_len=22, threshold=NEVER)
    assert result.completion_reason == "max_model_len_reached"
    assert len(result.token_ids) == 22 - 13
    assert result.final_sequence[22:24] == [MASK, MASK]


def test_max_nfe_stops_the_request() -> None:
    result = generate(ScriptedModel(left_to_right), prompt_of(13), max_tokens=30, threshold=NEVER, max_nfe=5)
    assert result.completion_reason == "max_nfe_reached" and result.nfe == 5


@pytest.mark.parametrize("threshold", [NEVER, 0.9])
def test_with_one_attention_layer_the_block_cache_changes_no_token(threshold) -> None:
    """A one-layer model's K/V depends on its own token only, so the kept K/V of the other sub-blocks is exact."""
    model = StandInModel(seed=3, layers=1)
    on = generate(model, prompt_of(11), max_tokens=20, threshold=threshold, use_block_cache=True)
    off = generate(model, prompt_of(11), max_tokens=20, threshold=threshold, use_block_cache=False)
    assert on.token_ids == off.token_ids and on.nfe == off.nfe
    assert REFINE in {s.kind for s in on.steps}


def test_a_sub_block_decoded_in_one_forward_needs_no_block_cache() -> None:
    """Threshold 0 takes every mask of a sub-block at once: every forward is a whole-block one, cache or not."""
    model = StandInModel(seed=4, layers=3)
    on = generate(model, prompt_of(9), max_tokens=24, threshold=0.0, use_block_cache=True)
    off = generate(model, prompt_of(9), max_tokens=24, threshold=0.0, use_block_cache=False)
    assert on.token_ids == off.token_ids and {s.kind for s in on.steps} <= {INIT, COMMIT}


def test_the_block_cache_reads_the_kept_kv_of_the_other_sub_blocks() -> None:
    """In a REFINE forward of a multi-layer model, the current sub-block's rows see the other sub-blocks through
    the K/V kept from the last whole-block forward: equal to a fresh forward when nothing changed since, different
    once the sub-block's own tokens changed (they fed the kept K/V of the later layers)."""
    model = StandInModel(seed=5, layers=3)
    length, prompt_len = 16, 8
    meta = lambda: DenseAttentionMetadata(allowed=build_attention_mask(length, 8, False, prompt_len))  # noqa: E731
    before = torch.tensor(prompt_of(8) + [7, MASK, MASK, MASK] + [MASK] * 4)
    after = torch.tensor(prompt_of(8) + [7, 9, MASK, MASK] + [MASK] * 4)
    positions = torch.arange(length)
    stale_rows = torch.zeros(length, dtype=torch.bool)
    stale_rows[12:16] = True  # the other sub-block of the block [8, 16); the current one is [8, 12)
    with torch.no_grad():
        kept_meta = meta()
        kept_meta.recorded_kv = []
        model(before, positions, kept_meta)
        same_state = meta()
        same_state.stale_kv, same_state.stale_rows = kept_meta.recorded_kv, stale_rows
        assert torch.equal(model(before, positions, same_state), model(before, positions, meta()))
        refined = meta()
        refined.stale_kv, refined.stale_rows = kept_meta.recorded_kv, stale_rows
        stale_hidden = model(after, positions, refined)[8:12]
        fresh_hidden = model(after, positions, meta())[8:12]
    assert not torch.allclose(stale_hidden, fresh_hidden)


def test_the_block_cache_is_an_approximation_that_runs_to_the_end() -> None:
    model = StandInModel(seed=6, layers=3)
    for use_block_cache in (True, False):
        result = generate(model, prompt_of(10), max_tokens=24, threshold=0.9, use_block_cache=use_block_cache)
        assert result.completion_reason == "max_new_tokens_reached" and len(result.token_ids) == 24
        assert MASK not in result.token_ids


def test_the_margin_is_the_closest_decision_to_flipping() -> None:
    """Every mask at confidence 0.8 - 0.001 q against a threshold of 0.7955: the closest call is position 4's row
    (0.796, 0.0005 above it); forced choices between rows 0.001 apart come next."""
    result = generate(ScriptedModel(left_to_right), prompt_of(5), max_tokens=3, threshold=0.7955)
    assert result.min_margin == pytest.approx(0.0005, abs=1e-6)
    never = generate(ScriptedModel(left_to_right), prompt_of(5), max_tokens=3, threshold=NEVER)
    assert never.min_margin == pytest.approx(0.001, abs=1e-6)  # no threshold decision: the forced ones
