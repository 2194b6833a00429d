"""The batched sampler decides exactly what the per-block rule decides, request by request and block by block."""

from __future__ import annotations

import random

import pytest
import torch

from diffulex.sampler.acceptance import accept_confident, accept_confident_segments
from diffulex.sampler.rows import SamplerSettings
from diffulex.sampler.token_sampling import ban_tokens, greedy, sample, step_generator
from diffulex.sampling_params import SamplingParams
from diffulex.strategy.block import Block, BlockStatus
from diffulex.strategy.multi_bd.sampler import ConfidenceSampler
from diffulex.strategy.request import DecodeSettings, Request, SampleTarget

VOCAB, VOCAB_LIMIT, MASK = 64, 60, 59
DECODE = DecodeSettings(4, 2, MASK, 4096, frozenset({0}), 0.9, 0.1, 0.9, 8, 1.0)

Work = list[tuple[Request, list[SampleTarget]]]


def per_request_writes(settings: SamplerSettings, logits: torch.Tensor, work: Work, force_every_block: bool) -> dict:
    """The sampler written the straightforward way: propose per request, then `accept_confident` per block."""
    s = settings
    tokens, conf = greedy(ban_tokens(logits.float().clone(), s.vocab_limit, s.mask_token_id))
    writes: dict[int, list[tuple[int, int]]] = {}
    row = 0
    for req, targets in work:
        n = sum(len(t.positions) for t in targets)
        sp = req.sampling_params
        if sp.temperature > 0 and n:
            seed = sp.seed if sp.seed is not None else s.base_seed + req.req_id
            rows = ban_tokens(logits[row : row + n].float().clone(), s.vocab_limit, s.mask_token_id)
            g = step_generator(seed, req.nfe, logits.device)
            tokens[row : row + n], conf[row : row + n] = sample(rows, sp.temperature, sp.top_k, sp.top_p, g)
        out = writes.setdefault(req.req_id, [])
        for target in targets:
            k = len(target.positions)
            keep = accept_confident(
                conf[row : row + k].tolist(), s.accept_threshold, force_every_block or target.force_allowed
            )
            out.extend((target.positions[i], int(tokens[row + i])) for i in keep)
            row += k
    return writes


def random_work(rng: random.Random, num_requests: int) -> Work:
    """Requests with 0-3 blocks of 1-4 positions, random forcing, a mix of greedy and seeded sampled requests."""
    work = []
    for req_id in rng.sample(range(1000), num_requests):
        temperature = rng.choice([0.0, 0.0, 0.7, 1.3])
        sp = SamplingParams(temperature=temperature, top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.8]),
                            seed=rng.choice([None, 11]))  # fmt: skip
        req = Request(req_id, [1, 2, 3, 4], sp, DECODE)
        req.nfe = rng.randrange(20)
        targets = []
        for b in range(rng.randrange(4)):
            start = 4 + 4 * b
            positions = sorted(rng.sample(range(start, start + 4), rng.randint(1, 4)))
            targets.append(SampleTarget(Block(b + 1, start, 4, BlockStatus.ACTIVE), positions, rng.random() < 0.5))
        work.append((req, targets))
    return work


def random_logits(rng: random.Random, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Peaky and flat rows, with repeated rows so that confidences tie inside blocks."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(num_rows, VOCAB, generator=gen) * torch.rand(num_rows, 1, generator=gen) * 12
    for r in range(1, num_rows):
        if rng.random() < 0.3:
            logits[r] = logits[r - 1]
    return logits.to(dtype)


# ----- the vectorized acceptance ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(200))
def test_segment_acceptance_equals_the_per_block_rule(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 1, 2, 3, 4, 7]) for _ in range(rng.randint(1, 12))]
    levels = [0.05, 0.3, 0.5, 0.5, 0.9, 0.9, 0.95, 1.0]  # few distinct values: ties and exact-threshold cases
    conf = torch.tensor([rng.choice(levels) if rng.random() < 0.6 else rng.random() for _ in range(sum(sizes))])
    force = [rng.random() < 0.6 for _ in sizes]
    threshold = rng.choice([0.0, 0.3, 0.5, 0.9, 0.95, 1.0, rng.random()])
    segment = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))

    got = accept_confident_segments(conf, segment, torch.tensor(force), threshold)

    expected, row = [], 0
    for size, f in zip(sizes, force, strict=True):
        expected.extend(row + i for i in accept_confident(conf[row : row + size].tolist(), threshold, f))
        row += size
    assert torch.nonzero(got).flatten().tolist() == expected


def test_segment_acceptance_compares_like_python_floats_against_the_threshold():
    # float32(0.1) is slightly above 0.1: as a Python float it passes a threshold of 0.1, so it must pass here too
    conf = torch.tensor([0.1, 0.05], dtype=torch.float32)
    got = accept_confident_segments(conf, torch.tensor([0, 0]), torch.tensor([False]), 0.1)
    assert got.tolist() == [True, False] == [c > 0.1 for c in conf.tolist()]


def test_segment_acceptance_forces_the_first_of_tied_best_rows_only_where_nothing_passed():
    conf = torch.tensor([0.2, 0.6, 0.6, 0.95, 0.1, 0.4, 0.4])
    segment = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    got = accept_confident_segments(conf, segment, torch.tensor([True, True, False]), 0.9)
    assert torch.nonzero(got).flatten().tolist() == [1, 3]


# ----- the sampler ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("force_every_block", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(15))
def test_writes_equal_the_per_request_sampler_on_random_batches(seed, dtype, force_every_block):
    rng = random.Random(seed)
    work = random_work(rng, rng.choice([1, 3, 8, 20]))
    num_rows = sum(len(t.positions) for _, targets in work for t in targets)
    logits = random_logits(rng, num_rows, dtype)
    settings = SamplerSettings(VOCAB_LIMIT, MASK, rng.choice([0.5, 0.9, 0.99]), base_seed=3)

    expected = per_request_writes(settings, logits, work, force_every_block)
    got = ConfidenceSampler(settings, force_every_block)(logits.clone(), work)

    assert got == expected
    assert list(got) == [req.req_id for req, _ in work]  # every request has an entry, in batch order


def test_always_force_takes_the_best_position_of_every_block_even_where_forcing_is_not_allowed():
    settings = SamplerSettings(VOCAB_LIMIT, MASK, 0.9, 0)
    req = Request(0, [1, 2, 3, 4], SamplingParams(temperature=0.0), DECODE)
    block_a, block_b = Block(1, 4, 4, BlockStatus.ACTIVE), Block(2, 8, 4, BlockStatus.ACTIVE)
    work = [(req, [SampleTarget(block_a, [4, 5], False), SampleTarget(block_b, [9, 10, 11], False)])]
    logits = torch.zeros(5, VOCAB)
    logits[1, 7] = 3.0  # the best of block a, not confident
    logits[2, 8] = logits[3, 9] = 2.0  # tied best of block b: the first position wins
    assert ConfidenceSampler(settings)(logits.clone(), work) == {0: []}
    assert ConfidenceSampler(settings, force_every_block=True)(logits.clone(), work) == {0: [(5, 7), (9, 8)]}


def test_sampled_requests_draw_from_their_own_seeded_generator():
    settings = SamplerSettings(VOCAB_LIMIT, MASK, 0.0, base_seed=0)  # threshold 0: every draw is written
    rng = random.Random(5)
    logits = random_logits(rng, 8, torch.float32)
    block = Block(1, 4, 4, BlockStatus.ACTIVE)
    greedy_req = Request(1, [1, 2, 3, 4], SamplingParams(temperature=0.0), DECODE)
    hot = Request(2, [1, 2, 3, 4], SamplingParams(temperature=1.0, top_k=8, seed=42), DECODE)
    hot.nfe = 6
    work = [(greedy_req, [SampleTarget(block, [4, 5, 6, 7], True)]), (hot, [SampleTarget(block, [4, 5, 6, 7], True)])]

    writes = ConfidenceSampler(settings)(logits.clone(), work)

    drawn, _ = sample(
        ban_tokens(logits[4:].clone(), VOCAB_LIMIT, MASK), 1.0, 8, 1.0, step_generator(42, 6, torch.device("cpu"))
    )
    assert writes[2] == list(zip([4, 5, 6, 7], drawn.tolist(), strict=True))
    assert writes[1] == list(
        zip([4, 5, 6, 7], greedy(ban_tokens(logits[:4].clone(), VOCAB_LIMIT, MASK))[0].tolist(), strict=True)
    )


def test_a_batch_without_targets_writes_nothing():
    req = Request(0, [1, 2, 3, 4], SamplingParams(temperature=0.0), DECODE)
    assert ConfidenceSampler(SamplerSettings(VOCAB_LIMIT, MASK, 0.9, 0))(torch.zeros(0, VOCAB), [(req, [])]) == {0: []}


@pytest.mark.parametrize("seed", range(6))
def test_device_layout_sections_start_16_byte_aligned_whatever_the_row_counts(seed):
    """Triton compiles a kernel per pointer alignment: sections that moved with the parity of the row or block count
    would make the acceptance kernel compile again while serving."""
    from diffulex.sampler.rows import RowLayout

    layout = RowLayout.of(random_work(random.Random(seed), num_requests=1 + seed), force_every_block=False)
    segment, force, starts = layout.to_device(torch.device("cpu"))
    assert segment.tolist() == layout.segments and force.tolist() == layout.force
    assert starts.tolist() == layout.starts
    assert all(t.data_ptr() % 16 == 0 for t in (segment, force, starts))


@pytest.mark.parametrize("force_every_block", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_the_device_only_greedy_step_on_padded_rows_and_blocks_writes_what_the_sampler_writes(seed, force_every_block):
    """`greedy_result` is what a captured graph runs: logits of every row of a padded step, the rows to sample
    picked by index and padded with -1, blocks padded with empty ones, padded rows in one more block that may not
    force. Read back like the eager result, it gives the sampler's writes."""
    rng = random.Random(seed)
    work = [(req, targets) for req, targets in random_work(rng, rng.choice([1, 3, 8]))]
    for req, _ in work:
        req.sampling_params = SamplingParams(temperature=0.0)
    settings = SamplerSettings(VOCAB_LIMIT, MASK, rng.choice([0.5, 0.9]), base_seed=3)
    sampler = ConfidenceSampler(settings, force_every_block)
    layout = sampler.row_layout(work)
    n, blocks = len(layout.positions), len(layout.force)
    logits = random_logits(rng, n, torch.float32)
    # the step's logits rows, interleaved with rows it does not sample, in a padded buffer
    all_rows = torch.randn(2 * n + 3, VOCAB, generator=torch.Generator().manual_seed(seed))
    where = rng.sample(range(2 * n + 3), n)
    all_rows[where] = logits
    pad_rows, pad_blocks = 3, 2
    source = torch.tensor(where + [-1] * pad_rows)
    segment = torch.tensor(layout.segments + [blocks + pad_blocks] * pad_rows)
    force = torch.tensor(layout.force + [0] * (pad_blocks + 1))
    starts = torch.tensor(layout.starts + [n] * pad_blocks)

    result = sampler.greedy_result(all_rows, source, segment, force, starts, 4)

    assert result.shape == (2, n + pad_rows)
    got = layout.pending(result[:, :n]).result()
    assert got == sampler(logits.clone(), work)
    assert got == per_request_writes(sampler.settings, logits, work, force_every_block)
