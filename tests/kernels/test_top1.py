"""Triton top-1 against `greedy` on banned logits: the same token always, the same probability up to rounding.

Every check runs the one-program-per-row launch and split-vocabulary launches (slices of a row combined by the
last program to finish), whose slice boundaries fall on tile boundaries.
"""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels import split_counters, top1
from diffulex.kernels.top1 import auto_num_splits, triton_top1
from diffulex.sampler.token_sampling import ban_tokens, greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILE = 4096  # the kernel's BLOCK_V: vocabularies above it take several tiles


def reference(logits: torch.Tensor, vocab_limit: int, banned_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    return greedy(ban_tokens(logits.float().clone(), vocab_limit, banned_id))


def check(
    logits: torch.Tensor, vocab_limit: int, banned_id: int | None, splits: tuple[int, ...] = (1, 2, 3)
) -> tuple[list[int], list[float]]:
    """The same answer, the reference's, for each split count (capped at one slice per tile by the kernel)."""
    ref_tokens, ref_conf = reference(logits.cpu(), vocab_limit, banned_id)
    answers = []
    for num_splits in splits:
        tokens, conf = triton_top1(logits.to(DEVICE), vocab_limit, banned_id, num_splits=num_splits)
        assert tokens.dtype == torch.int64 and conf.dtype == torch.float32
        assert tokens.cpu().tolist() == ref_tokens.tolist(), f"num_splits={num_splits}"
        # the confidence's normalizer sums the whole row's exponentials in fp32, in an order of the kernel's own
        torch.testing.assert_close(conf.cpu(), ref_conf, rtol=2e-5, atol=0)
        answers.append((tokens.cpu().tolist(), conf.cpu().tolist()))
    return answers[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("vocab", "vocab_limit"), [(7, 7), (384, 380), (TILE, TILE - 3), (2 * TILE + 37, 2 * TILE + 30)]
)
def test_matches_the_reference_on_random_logits(dtype, vocab, vocab_limit):
    gen = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(9, vocab, generator=gen)).to(dtype)
    check(logits, vocab_limit, banned_id=vocab_limit - 2)


def test_the_probability_is_the_softmax_probability_of_the_argmax():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    _, conf = check(logits, 300, None)
    torch.testing.assert_close(torch.tensor(conf), torch.softmax(logits, dim=-1).amax(dim=-1), rtol=1e-5, atol=0)


def test_a_banned_id_or_a_padding_id_at_the_maximum_is_skipped():
    logits = torch.zeros(3, 2 * TILE + 5)
    logits[:, 17] = 2.0
    logits[0, 40] = 9.0  # the banned id
    logits[1, 2 * TILE + 1] = 9.0  # a padding id, beyond the vocabulary limit in the last tile
    logits[2, TILE + 3] = 9.0  # an allowed id in the second tile
    tokens, _ = check(logits, 2 * TILE, banned_id=40)
    assert tokens == [17, 17, TILE + 3]


def test_ties_go_to_the_lowest_id_within_a_tile_and_across_tiles():
    logits = torch.zeros(3, 2 * TILE + 5)
    logits[0, [5, 9]] = 4.0
    logits[1, [TILE - 1, TILE, 2 * TILE + 2]] = 4.0
    logits[2, [3, 2 * TILE + 4]] = 4.0
    logits[2, 2] = 4.0  # ties with id 3 but is banned
    tokens, _ = check(logits, 2 * TILE + 5, banned_id=2)
    assert tokens == [5, TILE - 1, 3]


def test_a_row_with_one_finite_logit_is_certain_of_it_even_after_whole_tiles_of_minus_infinity():
    logits = torch.full((3, 2 * TILE + 5), float("-inf"))
    logits[0, 0] = -50.0
    logits[1, TILE + 7] = 3.0  # the first tile is all -inf: nothing there may turn into NaN
    logits[2, 2 * TILE + 4] = 1e4
    tokens, conf = check(logits, 2 * TILE + 5, None)
    assert tokens == [0, TILE + 7, 2 * TILE + 4]
    assert conf == [1.0, 1.0, 1.0]


def test_rows_need_not_be_contiguous_and_there_may_be_none():
    wide = torch.randn(4, 700, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    check(wide[:, :500], 480, banned_id=0)  # row stride 700
    tokens, conf = triton_top1(torch.zeros(0, 100, device=DEVICE), 100, None)
    assert tokens.shape == conf.shape == (0,)


def test_ties_across_slices_go_to_the_earliest_slice_and_counters_reset_between_launches():
    logits = torch.zeros(2, 4 * TILE + 9)
    logits[0, [3 * TILE + 1, TILE + 2, 4 * TILE + 8]] = 6.0  # slices 1..3 tie; the lowest id is in slice 1
    logits[0, 7] = 6.0  # ...but banned
    logits[1, [4 * TILE + 5, 4 * TILE + 6]] = 1.0  # a tie within the last, partial slice
    logits[1, 4 * TILE + 8] = 9.0  # a padding id beyond the vocabulary limit
    for _ in range(2):  # a second launch reuses the counters the first left at zero
        tokens, _ = check(logits, 4 * TILE + 7, banned_id=7, splits=(1, 2, 5, 64))
        assert tokens == [TILE + 2, 4 * TILE + 5]


def test_a_slice_of_minus_infinity_adds_nothing_to_the_combined_probability():
    logits = torch.full((2, 3 * TILE), float("-inf"))
    logits[0, 2 * TILE + 5] = 0.0  # the first two slices have no finite logit
    logits[1, [10, 2 * TILE + 1]] = 0.0
    tokens, conf = check(logits, 3 * TILE, None, splits=(3,))
    assert tokens == [2 * TILE + 5, 10]
    assert conf == [1.0, 0.5]


def test_split_count_comes_from_the_row_count(monkeypatch):
    cuda, sms = torch.device("cuda", 0), 132
    monkeypatch.setitem(split_counters._SM_COUNT, cuda, sms)
    tiles = 38  # a 151936-id vocabulary in 4096-id tiles
    assert auto_num_splits(cuda, 4, tiles) == 32  # decode at batch 1: about every tile its own program
    assert auto_num_splits(cuda, 64, tiles) == 4  # 264 // 64, already a power of two
    assert auto_num_splits(cuda, 50, tiles) == 4  # 264 // 50 = 5, rounded down to a power of two
    assert auto_num_splits(cuda, 2 * sms, tiles) == 1  # large batches keep one program per row
    assert auto_num_splits(torch.device("cpu"), 4, tiles) == 1


def test_every_row_count_uses_one_of_a_few_compiled_variants(monkeypatch):
    """Each split count is a separate kernel compile; the sampler's row count changes every step, so the counts
    must come from a small set that `warm_up` can compile up front."""
    cuda, sms = torch.device("cuda", 0), 132
    monkeypatch.setitem(split_counters._SM_COUNT, cuda, sms)
    plans = {top1._split_plan(cuda, rows, 151936, None) for rows in range(1, 4 * sms)}
    assert len(plans) <= 7
    assert all(splits * per_split >= 38 and (splits - 1) * per_split < 38 for splits, per_split in plans)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles native kernels")
def test_after_warm_up_no_row_count_compiles_a_kernel():
    import triton

    device = torch.device("cuda")
    misses = []
    top1.warm_up(device, 151936, torch.bfloat16, 151665, 151666, max_rows=600)
    triton.knobs.runtime.jit_cache_hook = lambda *a, **k: misses.append(k.get("fn")) or False
    try:
        for rows in (1, 2, 3, 4, 5, 8, 13, 16, 17, 18, 33, 64, 100, 131, 200, 264, 265, 600, 601):
            result = torch.empty(2, rows, dtype=torch.int64, device=device)  # as the sampler's: row 1 is written
            logits = torch.randn(rows, 151936, device=device, dtype=torch.bfloat16)
            triton_top1(logits, 151665, 151666, tokens_out=result[1])
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert misses == []


@pytest.mark.parametrize("num_splits", [1, 3])
def test_source_rows_answer_for_the_rows_they_name_and_padding_rows_read_nothing(num_splits):
    """A captured graph samples some rows of its fixed-size logits: the answer of output row i is that of
    ``logits[source_rows[i]]``; negative entries pad the launch to a fixed size and leave the real rows untouched."""
    logits = (3 * torch.randn(6, 2 * TILE + 11, generator=torch.Generator().manual_seed(5))).to(DEVICE)
    source = torch.tensor([4, 0, 4, 2, -1, -1, -1], dtype=torch.int64, device=DEVICE)
    tokens, conf = triton_top1(logits, 2 * TILE, banned_id=3, num_splits=num_splits, source_rows=source)
    ref_tokens, ref_conf = reference(logits.cpu()[[4, 0, 4, 2]], 2 * TILE, 3)
    assert tokens.shape == conf.shape == (7,)
    assert tokens[:4].cpu().tolist() == ref_tokens.tolist()
    torch.testing.assert_close(conf[:4].cpu(), ref_conf, rtol=1e-5, atol=0)
    assert conf[4:].cpu().tolist() == [float("-inf")] * 3, "a row not read is no candidate"
    again, _ = triton_top1(logits, 2 * TILE, banned_id=3, num_splits=num_splits)  # the counters were left at zero
    assert again.cpu().tolist() == reference(logits.cpu(), 2 * TILE, 3)[0].tolist()


def test_tokens_can_be_written_into_a_row_of_a_result():
    """The sampler's ``[2, N]`` result takes the tokens in its second row: same tokens, no copy."""
    logits = (3 * torch.randn(5, TILE + 7, generator=torch.Generator().manual_seed(9))).to(DEVICE)
    result = torch.zeros(2, 5, dtype=torch.int64, device=DEVICE)
    tokens, _ = triton_top1(logits, TILE + 7, banned_id=None, tokens_out=result[1])
    assert tokens.data_ptr() == result[1].data_ptr()
    assert result[1].cpu().tolist() == reference(logits.cpu(), TILE + 7, None)[0].tolist()
    assert result[0].cpu().tolist() == [0] * 5
    with pytest.raises(ValueError, match="tokens_out"):
        triton_top1(logits, TILE + 7, None, tokens_out=torch.zeros(4, dtype=torch.int64, device=DEVICE))
