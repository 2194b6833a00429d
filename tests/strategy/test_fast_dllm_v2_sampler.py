"""Fast-dLLM v2's acceptance on hand-made requests: each request's current sub-block takes its masks above the
threshold, else its single most probable one (a commit takes the next block's first position), and the sampling
graph's greedy step (`greedy_result`, fixed shapes, padded rows) writes exactly what the eager sampler writes."""

from __future__ import annotations

import torch

from diffulex.sampler.acceptance import accept_confident
from diffulex.sampler.rows import SamplerSettings
from diffulex.sampler.token_sampling import propose_greedy
from diffulex.strategy.fast_dllm_v2.request import ForwardKind
from diffulex.strategy.fast_dllm_v2.sampler import FastDllmV2Sampler
from tests.strategy.test_fast_dllm_v2_request import MASK, make_request, step

VOCAB = 128
THRESHOLD = 0.9


def mixed_batch():
    """Three requests in three modes: a whole-block forward, a refinement, a commit."""
    init = make_request(5)
    refine = make_request(5)
    step(refine)
    commit = make_request(8)
    reqs = [init, refine, commit]
    for req_id, req in enumerate(reqs):
        req.req_id = req_id
        req.maybe_activate_block()
    assert [req.forward_kind() for req in reqs] == [ForwardKind.INIT, ForwardKind.REFINE, ForwardKind.COMMIT]
    return reqs, [(req, req.sample_targets()) for req in reqs]


def peaky_logits(rows: int, seed: int) -> torch.Tensor:
    """Some rows confident (one id far above the rest), others flat-ish."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen)
    logits[::3, 5] = 12.0
    return logits


def test_each_sub_block_takes_its_confident_masks_else_its_best_one():
    sampler = FastDllmV2Sampler(SamplerSettings(VOCAB, MASK, THRESHOLD, 0))
    reqs, work = mixed_batch()
    assert [len(t.positions) for _, targets in work for t in targets] == [3, 2, 1]
    logits = peaky_logits(6, seed=1)
    tokens, conf = propose_greedy(logits.clone(), VOCAB, MASK)
    writes = sampler(logits.clone(), work)
    row = 0
    for req, targets in work:
        (target,) = targets
        n = len(target.positions)
        chosen = accept_confident(conf[row : row + n].tolist(), THRESHOLD, force_allowed=True)
        assert writes[req.req_id] == [(target.positions[i], int(tokens[row + i])) for i in chosen]
        assert writes[req.req_id], "every forward decodes a token"
        row += n


def test_the_graphs_greedy_step_writes_what_the_eager_sampler_writes():
    sampler = FastDllmV2Sampler(SamplerSettings(VOCAB, MASK, THRESHOLD, 0))
    _, work = mixed_batch()
    layout = sampler.row_layout(work)
    assert layout.greedy and layout.force == [1, 1, 1]
    for seed in range(4):
        logits = peaky_logits(6, seed)
        eager = sampler.launch(logits.clone(), work).result()
        # the graph's view: logits of every padded row, the sampled ones picked by index, padding rows -1 in an
        # extra segment that never forces
        padded = torch.cat([torch.randn(2, VOCAB), logits, torch.randn(3, VOCAB)])
        source = torch.tensor([2 + r for r in range(6)] + [-1, -1])
        segment = torch.tensor(layout.segments + [3, 3])
        force = torch.tensor(layout.force + [0])
        starts = torch.tensor(layout.starts + [6])
        result = sampler.greedy_result(padded, source, segment, force, starts, max_block_rows=8)
        graph = layout.pending(result[:, :6]).result()
        assert graph == eager
