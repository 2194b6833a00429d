"""DMax's soft inputs as static inputs of the decode graphs: staged per row, merged inside the padded forward, and
giving the eager engine's tokens.

On the CPU the padded buffers run through the eager forward (``capture=False``); the GPU test at the end replays
captured graphs and compares them with the eager engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffulex import SamplingParams
from diffulex.engine.static_soft_inputs import StaticSoftInputs
from diffulex.layers.token_merge import SoftInput, TokenMerge, TokenMergeSettings
from diffulex.testing import write_tiny_checkpoint
from tests.engine.test_cuda_graph import count_static_steps, with_static_decode
from tests.engine.test_engine_matches_reference import make_engine, random_prompts

MASK = 9
PARAMS = SamplingParams(temperature=0.0, max_tokens=16)
# the two merge modes, each as the engine options that pick it
MERGE_MODES = {
    "dmax_topk": dict(token_merge_mode="dmax_topk"),
    "iter_smooth_topk": dict(token_merge_mode="iter_smooth_topk", token_merge_top_k=3, token_merge_weight=0.5),
}


@pytest.fixture(scope="module")
def llada2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llada2"), family="llada2", init_std=1.0, seed=9)


def dmax_fields(mode: str, **extra) -> dict:
    fields = dict(decoding_strategy="dmax", sampling_mode="edit", accept_threshold=0.5, max_num_reqs=4)
    return {**fields, **MERGE_MODES[mode], **extra}


def staged_soft_rows(llm) -> list[int]:
    """Record, for every step staged on the static path, how many of its rows were soft."""
    soft_inputs = llm.runner.graphs.soft_inputs
    counts: list[int] = []
    stage = soft_inputs.stage

    def recording(soft_rows, num_rows, buffer):
        counts.append(len(soft_rows))
        return stage(soft_rows, num_rows, buffer)

    soft_inputs.stage = recording
    return counts


class TestStaging:
    settings = TokenMergeSettings("dmax_topk", 2, 1.0, True, MASK)

    def test_the_staged_records_merge_like_the_eager_rows_and_only_the_soft_rows_change(self) -> None:
        table = torch.randn(12, 16, generator=torch.Generator().manual_seed(3))
        embedding = torch.nn.Embedding.from_pretrained(table)
        hidden = table[torch.tensor([1, 2, 3, 4, 5, 6])]
        rows = [(1, SoftInput((3,), (0.75,), 0.25)), (4, SoftInput((4, 5), (0.5, 0.25), 0.25))]
        static = StaticSoftInputs(self.settings, max_rows=8, device=torch.device("cpu"), staging_buffers=1)
        static.stage(rows, num_rows=6, buffer=0)
        static.upload(6, buffer=0)
        got = static.merge(6).apply(hidden, embedding)
        expected = TokenMerge.of(rows, self.settings, torch.device("cpu")).apply(hidden, embedding)
        assert torch.equal(got, expected)
        assert torch.equal(got[[0, 2, 3, 5]], hidden[[0, 2, 3, 5]])

    def test_a_later_step_forgets_the_soft_rows_of_the_last(self) -> None:
        table = torch.randn(12, 16, generator=torch.Generator().manual_seed(4))
        embedding = torch.nn.Embedding.from_pretrained(table)
        hidden = table[torch.arange(6)]
        static = StaticSoftInputs(self.settings, max_rows=8, device=torch.device("cpu"), staging_buffers=2)
        static.stage([(2, SoftInput((3,), (0.5,), 0.5))], num_rows=6, buffer=1)
        static.upload(6, buffer=1)
        assert not torch.equal(static.merge(6).apply(hidden, embedding), hidden)
        static.stage([], num_rows=6, buffer=1)
        static.upload(6, buffer=1)
        assert torch.equal(static.merge(6).apply(hidden, embedding), hidden)

    def test_more_candidates_than_top_k_are_refused_by_name(self) -> None:
        static = StaticSoftInputs(self.settings, max_rows=4, device=torch.device("cpu"), staging_buffers=1)
        with pytest.raises(ValueError, match="3 token-merge candidates; token_merge_top_k is 2"):
            static.stage([(0, SoftInput((1, 2, 3), (0.2, 0.2, 0.2), 0.4))], num_rows=4, buffer=0)


@pytest.mark.parametrize("mode", sorted(MERGE_MODES))
def test_dmax_with_token_merge_on_the_static_path_gives_the_eager_tokens(llada2: Path, mode: str) -> None:
    """Float32, both merge modes: the padded static steps merge their soft rows themselves and decode exactly as
    the eager engine, whose tokens the merge does change (without it they differ)."""
    with make_engine(llada2, **dmax_fields(mode)) as eager:
        prompts = random_prompts(eager, [3, 7, 12], seed=5)
        expected = eager.generate(prompts, PARAMS, use_tqdm=False)
    with make_engine(llada2, **dmax_fields(mode)) as llm:
        sampled: list[bool] = []
        used = count_static_steps(with_static_decode(llm), sampled)
        soft_counts = staged_soft_rows(llm)
        got = llm.generate(prompts, PARAMS, use_tqdm=False)
    with make_engine(llada2, **dmax_fields(mode, token_merge_weight=0)) as plain:
        unmerged = plain.generate(prompts, PARAMS, use_tqdm=False)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert [t.nfe for t in got] == [t.nfe for t in expected]
    assert [t.token_ids for t in unmerged] != [t.token_ids for t in expected], "the merge should matter here"
    assert len(used) > got.num_engine_steps // 2, "decode steps take the static path"
    assert any(soft_counts), "some static steps have soft rows"
    # dmax_topk's rule runs in the sampling graph; iter_smooth_topk's candidates (a top-k) are found on the host
    assert any(sampled) if mode == "dmax_topk" else not any(sampled)


@pytest.mark.parametrize("extra", [dict(), dict(token_merge_weight=0)], ids=["token-merge", "no-merge"])
def test_greedy_dmax_steps_are_continued_on_the_device_as_one_step_in_flight_decodes(llada2: Path, extra) -> None:
    """``async_scheduling``: a greedy DMax step is queued before its predecessor's result, its inputs and soft-input
    records written by the sampling graph (`advance_dmax_inputs`); every request decodes exactly as with one step
    in flight (tokens, steps, each step's tokens), and the continuations of steps that finished a block are
    dropped. (Not with ``dmax_sampler_fast_path=False``: there the tiny model's blocks keep changing until
    ``max_nfe``, where a difference in the last bit of a CPU reduction, which the same inputs do not always give,
    flips a near tie; tests/strategy/test_dmax_acceptance.py checks that path's records exactly.)"""
    from tests.engine.test_continuation import _generate

    fields = dmax_fields("dmax_topk", **extra)
    with make_engine(llada2, **fields) as llm:
        prompts = random_prompts(llm, [3, 7, 12, 4], seed=5)
    expected, synchronous = _generate(llada2, prompts, PARAMS, False, **fields)
    got, run = _generate(llada2, prompts, PARAMS, True, **fields)
    assert synchronous.continued == 0
    assert got == expected
    assert run.continued > 0 and run.dropped > 0


def test_iter_smooth_topk_steps_are_not_continued(llada2: Path) -> None:
    from diffulex.engine.graph_policy import GraphPolicy

    for mode, continues in (("iter_smooth_topk", False), ("dmax_topk", True)):
        with make_engine(llada2, **dmax_fields(mode)) as llm:
            assert GraphPolicy.decide(llm.config, torch.device("cpu"), llm.runner, False).continues is continues


def test_two_micro_batches_with_soft_inputs_give_the_tokens_of_one_batch(llada2: Path) -> None:
    """With ``micro_batches=2`` (two host staging buffers, the halves taking turns) the static path's soft inputs
    still give one batch's tokens."""
    with make_engine(llada2, **dmax_fields("dmax_topk")) as single:
        prompts = random_prompts(single, [3, 7, 12, 5], seed=8)
        expected = single.generate(prompts, PARAMS, use_tqdm=False)
    with make_engine(llada2, micro_batches=2, **dmax_fields("dmax_topk")) as llm:
        used = count_static_steps(with_static_decode(llm))
        got = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert used


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", sorted(MERGE_MODES))
def test_captured_graphs_with_token_merge_give_the_eager_tokens_on_the_gpu(llada2: Path, mode: str) -> None:
    """Float32 on the GPU: dmax with token merge replays captured graphs (the soft inputs copied in as static
    inputs) and decodes exactly as the eager engine. Float32, because on random weights a bf16 rounding can flip
    a near tie between the two paths' differently shaped kernels."""
    fields = dmax_fields(mode, dtype="float32", attn_impl="triton", max_num_reqs=8)
    with make_engine(llada2, enforce_eager=True, **fields) as eager:
        prompts = random_prompts(eager, [3, 7, 12, 5, 9], seed=6)
        expected = eager.generate(prompts, PARAMS, use_tqdm=False)
    with make_engine(llada2, **fields) as llm:
        assert llm.policy.cuda_graphs, "token merge no longer turns CUDA graphs off"
        used = count_static_steps(llm)
        soft_counts = staged_soft_rows(llm)
        got = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert used and any(soft_counts)


def test_more_merge_candidates_than_the_vocabulary_holds_are_refused_at_build(llada2: Path) -> None:
    vocab = json.loads((llada2 / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError, match=rf"^token_merge_top_k={vocab + 1} is invalid: must be <= the model's voc"):
        make_engine(llada2, **dmax_fields("iter_smooth_topk", token_merge_top_k=vocab + 1))
