"""On a GPU, Fast-dLLM v2 replays captured decode CUDA graphs (the Triton attention reading refinement steps' cached
key tails, greedy sampling inside the graph) and decodes, in float32, exactly the oracle's tokens, block cache on
and off. Skipped without CUDA (the CPU runs the same static path
uncaptured: `test_fast_dllm_v2_graphs.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffulex.strategy.fast_dllm_v2.request import ForwardKind
from diffulex.testing.checkpoints import write_tiny_checkpoint
from tests.engine.test_fast_dllm_v2_engine import (
    MIXED_LENGTHS,
    assert_matches_reference,
    make_engine,
    random_prompts,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module")
def fdv2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "fdv2", family="fast_dllm_v2", seed=1, init_std=1.0)


def replayed_steps(llm) -> list[set[ForwardKind]]:
    """Per step replayed by the captured graphs (the full ones or the refinements' short ones), the forward kinds
    of its requests."""
    kinds: list[set[ForwardKind]] = []
    for graphs in (llm.runner.graphs, llm.runner.short_graphs):

        def run(step, bucket, buffer=0, sampled=None, graphs=graphs, original=graphs.run):
            assert graphs.capture_graphs and sampled is not None, "a greedy step replays the sampling graph"
            kinds.append({req.forward_kind() for req, _ in step.work})
            return original(step, bucket, buffer, sampled)

        graphs.run = run
    return kinds


@pytest.mark.parametrize(("sub_block", "sub_blocks", "use_block_cache"), [(4, 2, True), (4, 2, False), (8, 4, True)])
def test_float32_graphs_decode_the_oracle_tokens(fdv2_dir: Path, sub_block, sub_blocks, use_block_cache) -> None:
    with make_engine(fdv2_dir, sub_block, sub_blocks, use_block_cache, accept_threshold=0.7, dtype="float32",
                     max_num_reqs=8) as llm:  # fmt: skip
        assert llm.policy.cuda_graphs and llm.policy.key_tails
        kinds = replayed_steps(llm)
        assert_matches_reference(llm, random_prompts(llm, MIXED_LENGTHS, seed=40 + sub_block))
    assert kinds, "decode steps should replay the graphs"
    assert (ForwardKind.REFINE in set().union(*kinds)) == use_block_cache
    assert any(len(k) > 1 for k in kinds), "requests in different modes should share a replayed step"



@pytest.mark.parametrize(("threshold", "lengths", "seed"), [(1.0, [7], 34), (0.9, [7], 34), (1.0, [8, 8, 8], 1)])
def test_float32_graphs_continue_refinements_with_the_oracle_tokens(fdv2_dir: Path, threshold, lengths, seed) -> None:
    """Captured graphs with continuations (`diffulex.engine.continuation`): refinements replay the short graphs
    again on inputs the Triton advance kernel prepared, and the tokens stay the oracle's."""
    from diffulex import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=60)
    with make_engine(fdv2_dir, 8, 4, accept_threshold=threshold, dtype="float32", max_num_reqs=8) as llm:
        assert llm.policy.cuda_graphs and llm.policy.continues
        assert_matches_reference(llm, random_prompts(llm, lengths, seed=seed), params)
        assert llm.num_continuations > 0 and llm.num_dropped_continuations == 0
