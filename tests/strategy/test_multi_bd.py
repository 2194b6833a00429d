"""multi_bd's acceptance rule, as each family specialises it: which sampled positions of a block are written."""

from __future__ import annotations

import pytest
import torch

from diffulex.models.family import FAMILIES
from diffulex.sampler.rows import SamplerSettings
from diffulex.sampling_params import SamplingParams
from diffulex.strategy.block import Block, BlockStatus
from diffulex.strategy.multi_bd.sampler import ConfidenceSampler
from diffulex.strategy.request import DecodeSettings, Request, SampleTarget
from diffulex.strategy.strategy import STRATEGIES, SamplerContext

VOCAB, MASK = 16, 15


def make_request() -> Request:
    settings = DecodeSettings(
        block_size=4, buffer_size=2, mask_token_id=MASK, max_model_len=64, stop_token_ids=frozenset({0}),
        accept_threshold=0.9, add_block_threshold=0.1, semi_complete_threshold=0.9, auto_max_nfe_warmup_steps=8,
        auto_max_nfe_tpf_floor=1.0,
    )  # fmt: skip
    return Request(0, [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=8), settings)


def logits_with_confidences(best: list[tuple[int, float]]) -> torch.Tensor:
    """One row per position: token `t` gets probability `p`, the rest is spread over the other ids."""
    rows = []
    for token, p in best:
        probs = torch.full((VOCAB,), (1 - p) / (VOCAB - 2))
        probs[token], probs[MASK] = p, 1e-9
        rows.append(probs.log())
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("name", "force_every_block"),
    [("sdar", False), ("llada", False), ("dream", False), ("diffucoder", False), ("dream_reasoner", False),
     ("fast_dllm_v2", False), ("llada2", False), ("stable_diffcoder", True)],
)  # fmt: skip
@pytest.mark.parametrize("strategy", ["multi_bd", "d2f"])
def test_the_strategy_gives_each_family_its_rule(strategy, name, force_every_block):
    context = SamplerContext(FAMILIES.get(name), VOCAB, MASK, 0.9, 0.0, 0, None)
    sampler = STRATEGIES.get(strategy).make_sampler(context)
    assert isinstance(sampler, ConfidenceSampler)
    assert sampler.force_every_block is force_every_block


@pytest.mark.parametrize("force_allowed", [False, True])
def test_the_rules_differ_only_when_nothing_is_confident_and_forcing_is_not_allowed(force_allowed):
    req = make_request()
    block = Block(1, 4, 4, BlockStatus.ACTIVE)
    settings = SamplerSettings(vocab_limit=VOCAB, mask_token_id=MASK, accept_threshold=0.9, base_seed=0)
    unsure = logits_with_confidences([(3, 0.4), (5, 0.6), (7, 0.5)])
    sure = logits_with_confidences([(3, 0.95), (5, 0.6), (7, 0.97)])
    for logits, expect_confident in ((unsure, []), (sure, [(4, 3), (6, 7)])):
        work = [(req, [SampleTarget(block, [4, 5, 6], force_allowed)])]
        sdar = ConfidenceSampler(settings)(logits, work)[0]
        stable = ConfidenceSampler(settings, force_every_block=True)(logits, work)[0]
        if expect_confident:
            assert sdar == stable == expect_confident
        else:
            assert stable == [(5, 5)]  # the most confident position
            assert sdar == ([(5, 5)] if force_allowed else [])
