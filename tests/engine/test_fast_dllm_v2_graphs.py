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


def record_static_steps(llm, short_steps: list[tuple[set[ForwardKind], int]] | None = None):
    """Wrap the static paths (the full graphs and the short ones): per step that takes either, the forward kinds
    of its requests and whether it sampled in the graph path; in ``short_steps`` the kinds and rows of each step
    the short graphs took. A continuation step (`diffulex.engine.continuation`) replays its predecessor's graphs
    and rows: it is recorded as that step again."""
    steps: list[tuple[set[ForwardKind], bool]] = []
    for graphs in (llm.runner.graphs, llm.runner.short_graphs):
        last: list = []  # what the last step staged in these graphs computed, for its continuations

        def run(step, bucket, buffer=0, sampled=None, graphs=graphs, original=graphs.run, last=last):
            kinds = {req.forward_kind() for req, _ in step.work}
            last[:] = [(kinds, sampled is not None), (kinds, step.num_tokens)]
            record(graphs, last)
            return original(step, bucket, buffer, sampled)

        def replay_continuation(bucket, buffer, num_rows, graphs=graphs, original=graphs.replay_continuation,
                                last=last):  # fmt: skip
            record(graphs, last)
            return original(bucket, buffer, num_rows)

        graphs.run, graphs.replay_continuation = run, replay_continuation

    def record(graphs, last) -> None:
        steps.append(last[0])
        if graphs is llm.runner.short_graphs and short_steps is not None:
            short_steps.append(last[1])

    return steps


@pytest.mark.parametrize(("sub_block", "sub_blocks", "use_block_cache"), [(4, 2, True), (4, 2, False), (8, 4, True)])
def test_static_steps_give_the_eager_and_the_oracle_tokens(fdv2_dir: Path, sub_block, sub_blocks, use_block_cache):
    fields = dict(accept_threshold=0.7, max_num_reqs=8)
    with make_engine(fdv2_dir, sub_block, sub_blocks, use_block_cache, **fields) as eager:
        prompts = random_prompts(eager, MIXED_LENGTHS, seed=20 + sub_block)
        expected = eager.generate(prompts, GREEDY, use_tqdm=False).trajectories
    short: list[tuple[set[ForwardKind], int]] = []
    with make_engine(fdv2_dir, sub_block, sub_blocks, use_block_cache, **fields) as llm:
        llm.enable_static_decode(capture=False)
        full, narrow = llm.runner.graphs.shape, llm.runner.short_graphs.shape
        assert narrow.rows_per_request == min(2 * sub_block, sub_block * sub_blocks) < full.rows_per_request
        assert narrow.max_query_len == full.max_query_len == sub_block * sub_blocks + 1  # each request's bound
        steps = record_static_steps(llm, short)
        got = assert_matches_reference(llm, prompts)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert [t.nfe for t in got] == [t.nfe for t in expected]
    assert steps and all(sampled for _, sampled in steps), "greedy static steps sample in the graph path"
    kinds = set().union(*(k for k, _ in steps))
    assert (ForwardKind.REFINE in kinds) == use_block_cache
    assert any(len(k) > 1 for k, _ in steps), "requests in different modes should share a static step"
    assert short, "steps whose rows fit the short graphs replay them"


def test_a_lone_request_refines_in_the_short_graphs(fdv2_dir: Path) -> None:
    """At batch 1 a refinement (one sub-block of 8 rows) replays the short graphs' first bucket (16 rows) rather
    than the full graphs' 33; the tokens are the oracle's."""
    short: list[tuple[set[ForwardKind], int]] = []
    with make_engine(fdv2_dir, 8, 4, accept_threshold=0.9, max_num_reqs=4) as llm:
        llm.enable_static_decode(capture=False)
        record_static_steps(llm, short)
        (traj,) = assert_matches_reference(llm, random_prompts(llm, [7], seed=34))
        assert llm.runner.short_graphs.shape.bucket_rows(1) == 16
    refinements = sum(s.query_len == 8 for s in traj.steps)
    assert refinements > 0
    assert [rows for kinds, rows in short if kinds == {ForwardKind.REFINE}] == [8] * refinements


def test_a_step_takes_the_graphs_whose_bucket_computes_fewer_rows(fdv2_dir: Path) -> None:
    """Of the full graphs (33 rows per request) and the short ones (16 per request on average, each request up to
    33), a step replays the bucket that computes fewer rows: a lone whole block (32 rows) the short graphs' second
    bucket, three requests of 33 rows the short graphs' bucket of 8 (128 rows, against the full bucket of 4: 132),
    five whole blocks and three refinements (184 rows, more than the short graphs' 8 x 16) their bucket of 16
    requests, more than the engine runs (256 rows against the full bucket of 8: 264); eight whole blocks (264
    rows, more than any short bucket below the full graphs' rows) the full bucket of 8."""
    from diffulex.engine.step_inputs import StepInputs

    with make_engine(fdv2_dir, 8, 4, max_num_reqs=8) as llm:
        llm.enable_static_decode(capture=False)
        runner = llm.runner

        def step(query_lens: list[int]) -> StepInputs:
            return StepInputs(input_ids=[0] * sum(query_lens), query_lens=query_lens,
                              page_tables=[[0] for _ in query_lens])  # fmt: skip

        def chosen(query_lens):
            graphs, bucket = runner._graphs_for(step(query_lens))
            return ("short" if graphs is runner.short_graphs else "full"), graphs.shape.bucket_rows(bucket)

        assert chosen([8]) == ("short", 16)
        assert chosen([32]) == ("short", 32)
        assert chosen([33]) == ("full", 33)
        assert chosen([33, 33, 33]) == ("short", 128)
        assert runner.short_graphs.buckets == [1, 2, 4, 8, 16] and runner.graphs.buckets == [1, 2, 4, 8]
        assert chosen([32] * 5 + [8] * 3) == ("short", 256)
        assert chosen([33] * 8) == ("full", 264)
        assert chosen([8] * 7 + [32]) == ("short", 128)


def test_a_batch_wider_than_its_short_rows_replays_a_short_bucket_of_more_requests(fdv2_dir: Path) -> None:
    """Two requests whose step exceeds two short requests' rows (a whole block beside a refinement: 41 rows against
    32) replay the short bucket of 4 requests, past the engine's 2 (64 rows, against the full bucket's 66), padded
    with empty requests; the tokens are the oracle's."""
    short: list[tuple[set[ForwardKind], int]] = []
    with make_engine(fdv2_dir, 8, 4, accept_threshold=0.9, max_num_reqs=2) as llm:
        llm.enable_static_decode(capture=False)
        assert llm.runner.short_graphs.buckets == [1, 2, 4] and llm.runner.graphs.buckets == [1, 2]
        replayed: list[int] = []
        original = llm.runner.short_graphs.run

        def run(step, bucket, buffer=0, sampled=None):
            replayed.append(bucket)
            return original(step, bucket, buffer, sampled)

        llm.runner.short_graphs.run = run
        record_static_steps(llm, short)
        assert_matches_reference(llm, random_prompts(llm, [7, 12], seed=35))
    assert any(rows > 32 for _, rows in short), "a step wider than two short requests took the short graphs"
    assert 4 in replayed


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

