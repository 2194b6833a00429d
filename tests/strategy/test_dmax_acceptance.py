"""DMax's rule on the device (what a sampling graph captures) writes what the host rule writes, judges each block
as it does and sets the same soft inputs; a continued step's advanced inputs and soft-input records are what the
host would stage for the step after, step after step."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from diffulex.engine.static_soft_inputs import StaticSoftInputs
from diffulex.layers.token_merge import TokenMergeSettings
from diffulex.strategy.dmax.acceptance import advance_dmax_inputs, dmax_acceptance
from diffulex.strategy.dmax.sampler import DMaxSampler
from tests.strategy.test_edit_acceptance import device_step
from tests.strategy.test_edit_sampler import MASK, VOCAB, make, peaked

MERGE = TokenMergeSettings("dmax_topk", 1, 1.0, True, MASK)


def dmax(fast_path: bool, merge: TokenMergeSettings | None, threshold: float = 0.5):
    req, edit = make()
    settings = dataclasses.replace(edit.settings, accept_threshold=threshold, dmax_fast_path=fast_path,
                                   token_merge=merge)  # fmt: skip
    return req, DMaxSampler(settings)


def applied(req, writes) -> None:
    req.apply_tokens(writes)
    req.retire_and_commit()
    req.nfe += 1


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "slow-path"])
@pytest.mark.parametrize("merge", [MERGE, None], ids=["token-merge", "no-merge"])
def test_the_device_rule_writes_judges_and_merges_as_the_host_rule(fast_path, merge) -> None:
    """Random proposals, few distinct confidences (ties at the thresholds happen), on twin requests: each step's
    writes, verdicts and next soft inputs agree; the host's writes move both on until the blocks commit."""
    committed = 0
    for seed in range(8):
        rng = random.Random(seed)
        req, sampler = dmax(fast_path, merge)
        for _ in range(40):
            if not req.sample_targets():
                break
            rows = sum(len(t.positions) for t in req.sample_targets())
            tokens = [rng.randrange(VOCAB - 1) for _ in range(rows)]
            conf = [rng.choice([0.3, 0.5, 0.5, 0.9, 0.95]) for _ in range(rows)]
            logits = peaked(tokens, conf)
            twin = copy.deepcopy(req)
            expected = sampler(logits, [(twin, twin.sample_targets())])[twin.req_id]
            writes, _, layout, _ = device_step(req, sampler, logits)
            assert layout.greedy
            assert writes == expected
            assert req.sampled_blocks == twin.sampled_blocks
            assert req.next_soft == twin.next_soft
            applied(req, writes)
        committed += req.committed_len > req.prompt_len
    assert committed > 0, "blocks finished and committed"


def test_masks_fill_as_a_confident_run_from_the_left_and_decoded_tokens_refresh() -> None:
    current = torch.tensor([MASK, MASK, MASK, 2, MASK, 3])
    tokens = torch.tensor([5, 6, 7, 4, 1, 3])
    conf = torch.tensor([0.95, 0.6, 0.3, 0.1, 0.99, 0.2])
    segment = torch.tensor([0, 0, 0, 0, 1, 1])
    flags = dmax_acceptance(tokens, conf, current, segment, 2, MASK, 0.5).tolist()
    assert flags == [1, 1, 0, 1, 1, 0], "a run stops at the unsure mask; a changed decoded token always refreshes"
    unsure_first = dmax_acceptance(tokens, torch.tensor([0.2, 0.9, 0.9, 0.9, 0.9, 0.9]), current, segment, 2, MASK,
                                   0.5)  # fmt: skip
    assert unsure_first.tolist() == [1, 0, 0, 1, 1, 0], "an unsure first mask is filled alone"


def staged_records(req, sampler, positions: list[int]):
    """The soft-input records the host stages for a step of ``positions`` from the request's soft inputs."""
    records = StaticSoftInputs(sampler.settings.token_merge, len(positions), torch.device("cpu"), 1)
    soft = req.soft_inputs()
    records.stage([(row, soft[p]) for row, p in enumerate(positions) if p in soft], len(positions), 0)
    records.upload(len(positions), 0)
    return records.merge(len(positions))


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "slow-path"])
def test_a_continued_step_finds_its_inputs_and_soft_records_as_the_host_stages_them(fast_path) -> None:
    """`advance_dmax_inputs` after each device step (inputs: the block's tokens, shift 0): wherever the block goes on
    (its verdict is not finished), the advanced tokens are those the host's writes leave and the soft-input records
    are those `StaticSoftInputs.stage` writes from the request's soft inputs for the next step."""
    continued = 0
    for seed in range(10):
        rng = random.Random(seed)
        req, sampler = dmax(fast_path, dataclasses.replace(MERGE, top_k=2))
        for _ in range(40):
            if not req.sample_targets():
                break
            rows = sum(len(t.positions) for t in req.sample_targets())
            logits = peaked([rng.randrange(VOCAB - 1) for _ in range(rows)],
                            [rng.choice([0.3, 0.5, 0.9, 0.95]) for _ in range(rows)])  # fmt: skip
            writes, _, layout, result = device_step(req, sampler, logits, padding=0)
            n = len(layout.positions)
            inputs = torch.tensor([t for b in layout.blocks for t in b.current])
            merge = staged_records(req, sampler, layout.positions)  # this step's, as the host staged them
            advance_dmax_inputs(inputs, torch.arange(n), result, merge, MASK, 0, fast_path)
            verdicts = dict(req.sampled_blocks)
            applied(req, writes)
            if any(v.finished for v in verdicts.values()):
                continue  # the host takes another step: the continuation is dropped
            following = sampler.row_layout([(req, req.sample_targets())])
            assert following.positions == layout.positions
            assert inputs.tolist() == [req.token_ids[p] for p in layout.positions]
            expected = staged_records(req, sampler, layout.positions)
            assert merge.soft.tolist() == expected.soft.tolist()
            is_soft = expected.soft != 0
            assert torch.equal(merge.ids[is_soft], expected.ids[is_soft])
            assert torch.equal(merge.probs[is_soft], expected.probs[is_soft])
            assert torch.equal(merge.residual[is_soft], expected.residual[is_soft])
            continued += 1
    assert continued > 10
