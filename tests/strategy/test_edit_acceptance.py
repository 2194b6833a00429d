"""The edit rule on the device (what a sampling graph captures) writes what the host rule writes and gives each
block the same verdict, step after step, through fills, edits, time-outs and blocks past their post-edit steps."""

from __future__ import annotations

import copy
import random

import torch

from diffulex.strategy.edit.acceptance import EditPhase, advance_edit_inputs, edit_acceptance
from tests.strategy.test_edit_sampler import MASK, VOCAB, make, peaked


def device_step(req, sampler, logits: torch.Tensor, padding: int = 3):
    """One step through the sampler's `row_layout`, `greedy_result` (with padded rows, as in a graph bucket) and the
    layout's pending writes, which hand out the verdicts; also returns the step's device result."""
    work = [(req, req.sample_targets())]
    layout = sampler.row_layout(work)
    n, blocks = len(layout.positions), len(layout.force)
    source_rows = torch.tensor(list(range(n)) + [-1] * padding)
    segment = torch.tensor(layout.segments + [blocks] * padding)
    phase = torch.tensor(layout.force + [0])
    starts = torch.tensor(layout.starts + [n])
    current = torch.tensor([t for b in layout.blocks for t in b.current] + [MASK] * padding)
    result = sampler.greedy_result(logits, source_rows, segment, phase, starts, 4, current)[:, :n]
    writes = layout.pending(result).result()[req.req_id]
    return writes, {b.index: req.sampled_blocks[b.index] for b in layout.blocks}, layout, result


def host_step(req, sampler, logits: torch.Tensor):
    writes = sampler(logits, [(req, req.sample_targets())])[req.req_id]
    return writes, dict(req.sampled_blocks)


def advance(req, writes) -> None:
    req.apply_tokens(writes)
    req.retire_and_commit()
    req.nfe += 1


def run_twins(seed: int) -> set[EditPhase]:
    """Random proposals step after step: the device rule's writes and verdicts must be the host rule's, on twin
    requests; the host's writes move both on. Returns the phases the blocks went through."""
    rng = random.Random(seed)
    req, sampler = make(edit_threshold=rng.choice([0.0, 0.5]))
    phases = set()
    for _ in range(40):
        if not req.sample_targets():
            break
        rows = sum(len(t.positions) for t in req.sample_targets())
        # few distinct confidences, so that ties between masks and values at the thresholds happen
        tokens = [rng.randrange(VOCAB - 1) for _ in range(rows)]
        conf = [rng.choice([0.3, 0.5, 0.5, 0.9, 0.95]) for _ in range(rows)]
        logits = peaked(tokens, conf)
        twin = copy.deepcopy(req)
        expected_writes, expected_verdicts = host_step(twin, sampler, logits)
        writes, verdicts, layout, _ = device_step(req, sampler, logits)
        assert writes == expected_writes
        assert verdicts == expected_verdicts
        phases.update(b.phase for b in layout.blocks)
        req.sampled_blocks = dict(verdicts)
        advance(req, writes)
    assert req.committed_len > req.prompt_len, "blocks finished and committed"
    return phases


def test_the_device_rule_writes_and_judges_as_the_host_rule() -> None:
    phases = set().union(*(run_twins(seed) for seed in range(8)))
    assert phases == set(EditPhase), "every phase met"


def test_each_phase_decides_what_a_block_may_write() -> None:
    """One block, four rows: a confident mask, an unsure mask, a confident edit, an unsure edit."""
    tokens = torch.tensor([5, 6, 7, 8])
    current = torch.tensor([MASK, MASK, 2, 3])
    conf = torch.tensor([0.95, 0.5, 0.95, 0.2])
    segment = torch.zeros(4, dtype=torch.long)

    def flags(phase: EditPhase, **kw) -> list[int]:
        args = dict(mask_token_id=MASK, accept_threshold=0.9, edit_threshold=0.5) | kw
        return edit_acceptance(tokens, conf, current, segment, torch.tensor([int(phase)]), **args).tolist()

    assert flags(EditPhase.EDITING) == [1, 0, 1, 0]
    assert flags(EditPhase.EDITING, accept_threshold=0.99) == [1, 0, 1, 0], "no confident mask: the best one"
    assert flags(EditPhase.TIMED_OUT) == [1, 1, 1, 0], "its last step fills every mask"
    assert flags(EditPhase.CLOSED) == [0, 0, 0, 0]


def test_a_threshold_compares_as_the_host_does_in_double_precision() -> None:
    """0.3 in float32 is just above 0.3: the host's ``p > 0.3`` takes it (a float32 comparison would not)."""
    conf = torch.tensor([0.3, 0.3], dtype=torch.float32)
    assert float(conf[0]) > 0.3
    got = edit_acceptance(
        torch.tensor([4, 4]), conf, torch.tensor([MASK, 2]), torch.tensor([0, 0]), torch.tensor([0, 0]), MASK, 0.3, 0.3
    )
    assert got.tolist() == [1, 1]


def test_a_continued_step_finds_its_block_as_the_host_leaves_it() -> None:
    """`advance_edit_inputs` after each device step (inputs: the block's tokens, shift 0): wherever the block goes on
    (its verdict is not finished), the advanced inputs are the tokens the host's writes leave and each block's staged
    entry (phase and counts) is the one the host stages for the next step, through time-outs and closed blocks."""
    phases = set()
    for seed in range(12):
        rng = random.Random(seed)
        req, sampler = make(edit_threshold=rng.choice([0.0, 0.5]))
        for _ in range(40):
            targets = req.sample_targets()
            if not targets:
                break
            rows = sum(len(t.positions) for t in targets)
            logits = peaked([rng.randrange(VOCAB - 1) for _ in range(rows)],
                            [rng.choice([0.3, 0.5, 0.9, 0.95]) for _ in range(rows)])  # fmt: skip
            writes, verdicts, layout, _ = device_step(req, sampler, logits, padding=0)
            n = len(layout.positions)
            inputs = torch.tensor([t for b in layout.blocks for t in b.current])
            states = torch.tensor(layout.force + [0])
            segment = torch.tensor(layout.segments)
            result = torch.zeros(2, n, dtype=torch.int64)
            for pos, token in writes:
                row = layout.positions.index(pos)
                result[:, row] = torch.tensor([1, token])
            advance_edit_inputs(inputs, torch.arange(n), result, segment, states, MASK, shift=0)
            req.sampled_blocks = dict(verdicts)
            advance(req, writes)
            if any(v.finished for v in verdicts.values()):
                continue  # the host takes another step: the continuation is dropped
            following = sampler.row_layout([(req, req.sample_targets())])
            assert following.positions == layout.positions
            assert inputs.tolist() == [req.token_ids[p] for p in layout.positions]
            assert states[: len(following.force)].tolist() == following.force
            phases.update(b.phase for b in following.blocks)
    assert {EditPhase.EDITING, EditPhase.TIMED_OUT} <= phases
