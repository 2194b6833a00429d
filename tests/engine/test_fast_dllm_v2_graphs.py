"""Fast-dLLM v2's steps on the CUDA-graph path: commit, whole-block and refinement forwards of different requests
share one padded static step (per-request query ranges and key ends), greedy steps sample inside it, and the
tokens are the eager engine's and the oracle's, in float32. On the CPU the static buffers run through the eager
forward (``capture=False``); the GPU test (`tests/engine/test_fast_dllm_v2_graphs_gpu.py`) replays captured graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diffulex.strategy.fast_dllm_v2.request import ForwardKind
from diffulex.testing.checkpoints import write_tiny_checkpoint
from tests.engine.test_fast_dllm_v2_engine import (
    GREEDY,
    MIXED_LENGTHS,
    assert_matches_reference,
    make_engine,
    random_prompts,
)


@pytest.fixture(scope="module")
def fdv2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine tests' confident tiny checkpoint (thresholds accept several tokens at once)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "fdv2", family="fast_dllm_v2", seed=1, init_std=1.0)


def record_static_steps(llm) -> list[tuple[set[ForwardKind], bool]]:
    """Wrap the static path: per step that takes it, the forward kinds of its requests and whether it sampled in
    the graph path."""
    graphs = llm.runner.graphs
    original = graphs.run
    steps: list[tuple[set[ForwardKind], bool]] = []

    def run(step, bucket, buffer=0, sampled=None):
        steps.append(({req.forward_kind() for req, _ in step.work}, sampled is not None))
        return original(step, bucket, buffer, sampled)

    graphs.run = run
    return steps


@pytest.mark.parametrize(("sub_block", "sub_blocks", "use_block_cache"), [(4, 2, True), (4, 2, False), (8, 4, True)])
def test_static_steps_give_the_eager_and_the_oracle_tokens(fdv2_dir: Path, sub_block, sub_blocks, use_block_cache):
    fields = dict(accept_threshold=0.7, max_num_reqs=8)
    with make_engine(fdv2_dir, sub_block, sub_blocks, use_block_cache, **fields) as eager:
        prompts = random_prompts(eager, MIXED_LENGTHS, seed=20 + sub_block)
        expected = eager.generate(prompts, GREEDY, use_tqdm=False).trajectories
    with make_engine(fdv2_dir, sub_block, sub_blocks, use_block_cache, **fields) as llm:
        llm.enable_static_decode(capture=False)
        steps = record_static_steps(llm)
        got = assert_matches_reference(llm, prompts)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert [t.nfe for t in got] == [t.nfe for t in expected]
    assert steps and all(sampled for _, sampled in steps), "greedy static steps sample in the graph path"
    kinds = set().union(*(k for k, _ in steps))
    assert (ForwardKind.REFINE in kinds) == use_block_cache
    assert any(len(k) > 1 for k, _ in steps), "requests in different modes should share a static step"


def test_a_step_mixing_commit_whole_block_and_refinement_forwards_replays_one_bucket(fdv2_dir: Path) -> None:
    """Requests one step apart: one refines a sub-block while another computes its whole block and a third
    commits the block before; all in one static step of one bucket."""
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.9, max_num_reqs=4) as llm:
        llm.enable_static_decode(capture=False)
        steps = record_static_steps(llm)
        prompts = random_prompts(llm, [5, 9, 14, 3], seed=30)
        assert_matches_reference(llm, prompts)
    assert any(k >= {ForwardKind.REFINE, ForwardKind.INIT} for k, _ in steps)
    assert any(k >= {ForwardKind.REFINE, ForwardKind.COMMIT} for k, _ in steps)


def test_a_drawing_request_samples_after_the_static_forward_with_the_eager_tokens(fdv2_dir: Path) -> None:
    from diffulex import SamplingParams

    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=12)]
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.7) as eager:
        prompts = random_prompts(eager, [6, 10], seed=31)
        expected = eager.generate(prompts, params, use_tqdm=False).trajectories
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.7) as llm:
        llm.enable_static_decode(capture=False)
        steps = record_static_steps(llm)
        got = llm.generate(prompts, params, use_tqdm=False).trajectories
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    sampled = [s for _, s in steps]
    assert False in sampled and True in sampled  # in the graph once the drawing request has finished

