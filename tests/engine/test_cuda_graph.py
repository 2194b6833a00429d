"""Decode steps served from the padded static buffers of the CUDA-graph path give exactly the eager tokens.

On the CPU the buffers are run through the eager forward instead of a captured graph (``capture=False``): that
is the part of the graph path that can go wrong in our code (padding, bucket choice, page-table widths, host
buffers reused across steps); the GPU check script compares captured replays with eager runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffulex import SamplingParams
from diffulex.engine import cuda_graph
from diffulex.engine.cuda_graph import request_buckets
from diffulex.engine.step_inputs import StepInputs
from diffulex.kernels import host_publish
from diffulex.strategy.fast_dllm_v2 import FastDllmV2
from diffulex.strategy.multi_bd import MultiBD
from tests.engine.test_engine_matches_reference import make_engine, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def with_static_decode(llm):
    llm.enable_static_decode(capture=False)
    return llm


def count_static_steps(llm, sampled_steps: list[bool] | None = None, graphs=None) -> list[int]:
    """Wrap the static path (the full graphs unless ``graphs`` names another set) so the test can see which steps
    took it (and, in ``sampled_steps``, which of them sampled in the graph path too)."""
    graphs = graphs if graphs is not None else llm.runner.graphs
    used: list[int] = []
    original = graphs.run

    def run(step, bucket, buffer=0, sampled=None):
        used.append(bucket)
        if sampled_steps is not None:
            sampled_steps.append(sampled is not None)
        return original(step, bucket, buffer, sampled)

    graphs.run = run
    return used


def test_request_buckets_double_then_grow_by_sixteen() -> None:
    assert request_buckets(1) == [1]
    assert request_buckets(5) == [1, 2, 4, 5]
    assert request_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert request_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize("buffer_size", [1, 2])
def test_padded_static_steps_give_the_eager_tokens(peaky_sdar_dir: Path, buffer_size: int) -> None:
    lengths = [1, 3, 5, 8, 11, 21, 2]
    with make_engine(peaky_sdar_dir, buffer_size=buffer_size, accept_threshold=0.7, max_num_reqs=6) as eager:
        prompts = random_prompts(eager, lengths, seed=10 + buffer_size)
        expected = eager.generate(prompts, GREEDY, use_tqdm=False)
    with make_engine(peaky_sdar_dir, buffer_size=buffer_size, accept_threshold=0.7, max_num_reqs=6) as llm:
        used = count_static_steps(with_static_decode(llm))
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories]
    assert [t.nfe for t in got.trajectories] == [t.nfe for t in expected.trajectories]
    # (a continuation replays the static path's graphs without a launch of its own)
    static_steps = len(used) + llm.num_continuations
    assert static_steps > got.num_engine_steps // 2, "most steps are decode-shaped and should take the static path"
    assert set(used) - {1, 2, 4, 6} == set(), "buckets come from request_buckets(max_num_reqs)"
    assert any(b > 1 for b in used)


def test_short_graphs_take_the_power_of_two_buckets_from_16_requests_unless_the_strategy_says_otherwise() -> None:
    assert MultiBD().short_step_buckets(request_buckets(128)) == [16, 32, 64, 128]
    assert MultiBD().short_step_buckets(request_buckets(100)) == [16, 32, 64]
    assert MultiBD().short_step_buckets(request_buckets(8)) == []
    assert FastDllmV2().short_step_buckets(request_buckets(128)) == request_buckets(128)


def every_bucket(self, buckets: list[int]) -> list[int]:
    return buckets


def test_a_buffer_of_four_replays_two_block_graphs_where_the_step_fits_them_with_the_eager_tokens(
    peaky_sdar_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past two blocks a running set mostly holds two, so a second graph set whose buckets hold two blocks per
    request serves those steps; a step with more rows replays the full set. Either way the eager tokens."""
    monkeypatch.setattr(MultiBD, "short_step_buckets", every_bucket)  # short graphs for this test's few requests
    fields = dict(buffer_size=4, accept_threshold=0.7, max_num_reqs=6)
    with make_engine(peaky_sdar_dir, **fields) as eager:
        prompts = random_prompts(eager, [1, 3, 5, 8, 11, 21], seed=40)
        expected = eager.generate(prompts, GREEDY, use_tqdm=False)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        with_static_decode(llm)
        assert llm.runner.short_graphs.shape.rows_per_request == 2 * llm.config.block_size
        assert llm.runner.graphs.shape.rows_per_request == 4 * llm.config.block_size
        full = count_static_steps(llm)
        short = count_static_steps(llm, graphs=llm.runner.short_graphs)
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories]
    assert [t.nfe for t in got.trajectories] == [t.nfe for t in expected.trajectories]
    assert short, "steps of at most two blocks a request replay the short graphs"
    assert full, "steps with more rows than the short buckets hold replay the full graphs"


def test_at_the_default_buckets_sixteen_requests_replay_the_short_graphs_through_a_preemption(
    peaky_sdar_dir: Path,
) -> None:
    """Without any test's help the short graphs serve the power-of-two buckets from 16 requests: a batch of 18
    requests at a buffer of 4 replays them while 16 or more run, the full graphs otherwise (fewer requests, or steps
    whose rows the short buckets do not hold), and a pool too small for all of them preempts some; the tokens are
    the eager engine's."""
    fields = dict(buffer_size=4, accept_threshold=0.7, max_num_reqs=20, num_pages=40)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    with make_engine(peaky_sdar_dir, **fields) as eager:
        prompts = random_prompts(eager, [1 + (5 * i) % 19 for i in range(18)], seed=50)
        expected = eager.generate(prompts, params, use_tqdm=False)
    assert sum(t.num_preemptions for t in expected.trajectories) > 0, "the pool should be too small for all 18"
    with make_engine(peaky_sdar_dir, **fields) as llm:
        with_static_decode(llm)
        assert llm.runner.short_graphs.buckets == [16]
        full = count_static_steps(llm)
        short = count_static_steps(llm, graphs=llm.runner.short_graphs)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories]
    assert short and full


def test_greedy_steps_sample_in_the_graph_path_and_steps_with_a_drawing_request_sample_eagerly(
    peaky_sdar_dir: Path,
) -> None:
    """The sampling graph (LM head, top-1, acceptance on padded rows) serves steps whose requests are all greedy;
    a step with a request at temperature > 0 needs its seeded generator and samples after the forward graph.
    Both give the eager engine's tokens."""
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.9, seed=4, max_tokens=12)]
    with make_engine(peaky_sdar_dir, buffer_size=2, accept_threshold=0.7, max_num_reqs=6) as eager:
        prompts = random_prompts(eager, [3, 7, 12], seed=31)
        expected = eager.generate(prompts, params, use_tqdm=False)
    with make_engine(peaky_sdar_dir, buffer_size=2, accept_threshold=0.7, max_num_reqs=6) as llm:
        sampled_steps: list[bool] = []
        count_static_steps(with_static_decode(llm), sampled_steps)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories]
    # the drawing request has the fewest tokens: the steps after it finished are greedy only
    assert True in sampled_steps and False in sampled_steps
    assert sampled_steps.index(True) > sampled_steps.index(False), "with the drawing request running: eager"


def test_shifted_family_and_d2f_take_the_static_path_with_the_same_tokens(tmp_path: Path) -> None:
    from diffulex.testing.checkpoints import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "dream", family="dream", seed=2, init_std=1.0)
    for strategy in ("multi_bd", "d2f"):
        fields = dict(decoding_strategy=strategy, buffer_size=2, accept_threshold=0.7)
        with make_engine(model, **fields) as eager:
            prompts = random_prompts(eager, [4, 9, 13], seed=7)
            expected = eager.generate(prompts, GREEDY, use_tqdm=False)
        with make_engine(model, **fields) as llm:
            used = count_static_steps(with_static_decode(llm))
            got = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories], strategy
        assert used, strategy


def test_preempted_requests_rebuild_eagerly_then_return_to_the_static_path(peaky_sdar_dir: Path) -> None:
    fields = dict(buffer_size=2, accept_threshold=0.7, num_pages=12, max_num_reqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    with make_engine(peaky_sdar_dir, **fields) as eager:
        prompts = random_prompts(eager, [9, 14, 6, 11], seed=21)
        expected = eager.generate(prompts, params, use_tqdm=False)
    assert sum(t.num_preemptions for t in expected.trajectories) > 0, "the pool should be too small for all four"
    with make_engine(peaky_sdar_dir, **fields) as llm:
        used = count_static_steps(with_static_decode(llm))
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories]
    assert used


def test_steps_larger_than_the_graph_shape_run_eagerly(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, buffer_size=1, max_num_reqs=4) as llm:
        graphs = with_static_decode(llm).runner.graphs
        q = graphs.shape.max_query_len

        def step(query_lens: list[int], pages: int = 1) -> StepInputs:
            s = StepInputs(query_lens=query_lens, page_tables=[[0] * pages for _ in query_lens])
            return s

        assert graphs.bucket_for(step([q, q, 1])) == 4
        assert graphs.bucket_for(step([q + 1])) is None, "a prefill chunk longer than the running set"
        assert graphs.bucket_for(step([1] * 5)) is None, "more requests than the largest bucket"
        assert graphs.bucket_for(step([1], pages=graphs.shape.max_pages + 1)) is None
        assert graphs.bucket_for(step([])) is None


def test_memory_profile_forward_stays_within_the_models_positions(tmp_path: Path) -> None:
    """The planner's profile covers max(max_num_batched_tokens, max_model_len) rows; one request can never be
    longer than max_model_len, so neither are the profile's (the RoPE table ends there)."""
    from diffulex.testing.checkpoints import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "short", family="sdar", max_position_embeddings=64)
    with make_engine(model, max_model_len=64, max_num_batched_tokens=200) as llm:
        assert llm.model.model.rotary_emb.max_position == 64
        llm.runner.profile_run(200, llm.config.max_model_len, 16)  # IndexError if a position passed the table


class TestKernelStoreHome:
    """The sampling graphs store their result home by a kernel only where a probe store lands; anything else
    (a launch that fails, a store that does not arrive) falls back to the copy."""

    def test_a_failing_store_falls_back_to_the_copy(self, monkeypatch, caplog):
        def fails(src, dst):
            raise RuntimeError("pointer argument cannot be accessed")

        monkeypatch.setattr(host_publish, "publish_to_host", fails)
        with caplog.at_level("WARNING", logger="diffulex"):
            assert cuda_graph._host_publisher(torch.device("cpu")) is None
        assert "copying them instead" in caplog.text

    def test_a_store_that_does_not_land_falls_back_to_the_copy(self, monkeypatch):
        monkeypatch.setattr(host_publish, "publish_to_host", lambda src, dst: None)
        assert cuda_graph._host_publisher(torch.device("cpu")) is None

    def test_a_store_that_lands_is_used(self, monkeypatch):
        def copies(src, dst):
            dst.copy_(src)

        monkeypatch.setattr(host_publish, "publish_to_host", copies)
        assert cuda_graph._host_publisher(torch.device("cpu")) is copies


def test_small_buckets_capture_the_forward_into_their_sampling_graphs(peaky_sdar_dir: Path, monkeypatch) -> None:
    """A greedy step of a bucket with at most `FUSED_STEP_MAX_ROWS` rows is one graph (forward and sampling),
    larger buckets replay their forward graph and then a sampling graph that reads it; without a sampling graph
    nothing fuses."""
    with make_engine(peaky_sdar_dir, block_size=4, buffer_size=1, max_num_reqs=8) as llm:
        graphs = with_static_decode(llm).runner.graphs
        rows = graphs.shape.max_query_len
        assert graphs.samples and rows == 4
        fused = [b for b in graphs.buckets if graphs.fuses_forward(b)]
        assert fused == [b for b in graphs.buckets if b * rows <= cuda_graph.FUSED_STEP_MAX_ROWS] == [1, 2, 4]
        monkeypatch.setattr(graphs, "greedy_sample", None)
        assert not any(graphs.fuses_forward(b) for b in graphs.buckets)


def test_the_forward_is_told_which_rows_the_step_reads(peaky_sdar_dir: Path) -> None:
    """The graphs hand the forward the step's rows to sample as its readers (padded with -1), drawing or greedy:
    the last layer may skip its work after attention when there are none, as in a step that only stores a
    finished block. Tokens stay the eager engine's."""
    params = [GREEDY, SamplingParams(temperature=0.9, seed=3, max_tokens=16)]
    fields = dict(buffer_size=1, max_num_reqs=4, async_scheduling=False)
    with make_engine(peaky_sdar_dir, **fields) as eager:
        prompts = random_prompts(eager, [5, 9], seed=8)
        expected = eager.generate(prompts, params, use_tqdm=False)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        graphs = with_static_decode(llm).runner.graphs
        staged: list[list[int]] = []
        readers_seen: list[list[int]] = []
        run, forward = graphs.run, graphs.forward

        def recording_run(step, bucket, buffer=0, sampled=None):
            staged.append(list(step.sample_rows))
            return run(step, bucket, buffer, sampled)

        def recording_forward(ids, positions, meta, readers):
            readers_seen.append(readers.tolist())
            return forward(ids, positions, meta, readers)

        graphs.run, graphs.forward = recording_run, recording_forward
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories]
    assert len(staged) == len(readers_seen) > 0
    for rows, readers in zip(staged, readers_seen, strict=True):
        assert readers == rows + [-1] * (len(readers) - len(rows))
    assert any(not rows for rows in staged), "a step that only stores a finished block reads no row"
    assert any(rows for rows in staged)


def test_graph_replays_count_only_captured_replays(peaky_sdar_dir: Path) -> None:
    """The static path run without capture (the CPU's) is not a replay: a benchmark reading `graph_replays` around
    its steps must not report eager steps as graphed."""
    with make_engine(peaky_sdar_dir, max_num_reqs=4) as llm:
        used = count_static_steps(with_static_decode(llm))
        llm.generate(random_prompts(llm, [3, 5], seed=3), GREEDY, use_tqdm=False)
        assert used and llm.runner.graph_replays == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured CUDA graphs need a GPU")
def test_graph_replays_count_the_decode_steps_that_replay_a_graph(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, max_num_reqs=4, device_start=0) as llm:
        used = count_static_steps(llm)
        got = llm.generate(random_prompts(llm, [3, 5], seed=3), GREEDY, use_tqdm=False)
        # every launch of the static path replays (continuations replay without it): at least one per such step
        assert 0 < len(used) <= llm.runner.graph_replays <= got.num_engine_steps + len(used)


def test_in_a_dry_pass_the_pinned_store_probe_is_launched_but_never_read_back(monkeypatch, caplog):
    parallel_compile = pytest.importorskip("diffulex.kernels.parallel_compile")
    stores = []
    monkeypatch.setattr(host_publish, "publish_to_host", lambda result, home: stores.append(result.clone()))
    monkeypatch.setattr(parallel_compile, "HOST_DEVICE_TYPES", ("meta",))  # a read of the probe's home would raise
    with parallel_compile.dry_pass():
        publisher = cuda_graph._host_publisher(torch.device("cpu"))
    assert [store.tolist() for store in stores] == [[7, -3]]  # launched, so that its variant is recorded
    assert publisher is host_publish.publish_to_host and not caplog.records  # and trusted without a read back
    assert cuda_graph._host_publisher(torch.device("cpu")) is None  # outside a dry pass the store that did not land
    assert "did not land" in caplog.text  # is found out
