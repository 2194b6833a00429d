"""Edit mode (``sampling_mode="edit"``, LLaDA2.1) through the engine, on a tiny LLaDA2 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffulex import Diffulex, SamplingParams
from diffulex.testing import write_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
PROMPTS = ["hello world", "a b c d e f"]


@pytest.fixture(scope="module")
def llada2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llada2"), family="llada2", init_std=1.0, seed=9)


def run(path: Path, **fields):
    fields = {"block_size": 4, "buffer_size": 1, "max_model_len": 256, "accept_threshold": 0.9, **fields}
    with Diffulex(str(path), **fields) as llm:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False, apply_chat_template=False), llm.mask_token_id


def test_without_edits_the_tokens_are_the_naive_modes(llada2):
    """With no edit ever confident enough, edit mode fills masks exactly as the naive mode does; each block then
    takes one more step, the one that finds it unchanged."""
    naive, _ = run(llada2)
    edit, _ = run(llada2, sampling_mode="edit", edit_threshold=1.0)
    for a, b in zip(naive, edit, strict=True):
        assert a.token_ids == b.token_ids
        assert b.nfe > a.nfe


def test_edits_rewrite_decoded_tokens_and_every_block_still_commits(llada2):
    out, mask = run(llada2, sampling_mode="edit", max_post_edit_steps=3)
    rewritten = 0
    for trajectory in out:
        assert trajectory.completion_reason != "max_nfe_reached"
        assert mask not in trajectory.token_ids
        seen: dict[tuple[int, int], int] = {}
        for record in trajectory.steps:
            for block, token_ids in _block_tokens(record):
                for i, token in enumerate(token_ids):
                    old = seen.get((block, i))
                    rewritten += old is not None and old != mask and token != old
                    seen[block, i] = token
    assert rewritten > 0


def test_a_request_max_nfe_caps_its_edit_forwards(llada2):
    """The automatic bound grows by every block's post-edit steps; a request's own ``max_nfe`` is a cap as asked,
    however many post-edit steps the engine allows."""
    from diffulex import SamplingParams

    fields = {"block_size": 4, "buffer_size": 1, "max_model_len": 256, "sampling_mode": "edit",
              "max_post_edit_steps": 1000}  # fmt: skip
    with Diffulex(str(llada2), **fields) as llm:
        (t,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=16, max_nfe=3), use_tqdm=False,
                            apply_chat_template=False)  # fmt: skip
    assert t.completion_reason == "max_nfe_reached" and t.nfe == 3


def _block_tokens(record):
    """(block index, its 4 tokens after the step) for each block of a step's running set."""
    tokens = record.running_token_ids
    return [(b, tokens[4 * i : 4 * i + 4]) for i, b in enumerate(record.running_block_ids)]


def test_edit_mode_under_another_strategy_is_refused_by_name(llada2):
    with pytest.raises(
        ValueError, match="^sampling_mode='edit' is invalid: decoding_strategy='d2f' runs with 'naive'$"
    ):
        Diffulex(str(llada2), sampling_mode="edit", decoding_strategy="d2f")


def test_edit_mode_is_for_the_llada2_family_only(tmp_path):
    sdar = write_tiny_checkpoint(tmp_path / "sdar")
    with pytest.raises(ValueError, match="sampling_mode"):
        Diffulex(str(sdar), sampling_mode="edit")


def test_two_blocks_at_once_and_a_preemption_still_finish_every_request(llada2):
    """Buffer 2 (a later block is edited while an earlier one still is), and a page pool so small that requests
    are preempted and rebuilt: every request completes with no mask in its answer."""
    out, mask = run(llada2, sampling_mode="edit", buffer_size=2, max_post_edit_steps=2, num_kvcache_blocks=10,
                    page_size=4, max_num_reqs=2)  # fmt: skip
    for trajectory in out:
        assert trajectory.completion_reason in ("max_new_tokens_reached", "eos_token_generated")
        assert mask not in trajectory.token_ids
    assert sum(t.num_preemptions for t in out) > 0


def test_dmax_without_token_merge_completes_every_request(llada2):
    out, mask = run(llada2, sampling_mode="edit", decoding_strategy="dmax", token_merge_weight=0, accept_threshold=0.5)
    for trajectory in out:
        assert trajectory.completion_reason in ("max_new_tokens_reached", "eos_token_generated")
        assert mask not in trajectory.token_ids


def test_dmax_with_token_merge_feeds_soft_inputs_and_completes(llada2, monkeypatch):
    from diffulex.engine.model_runner import ModelRunner

    # soft rows as the runner collects them: the eager step merges them itself, a graph step stages them
    merged_rows = []
    collect = ModelRunner.collect

    def recording(self, batch):
        step = collect(self, batch)
        merged_rows.append(len(step.soft_rows))
        return step

    monkeypatch.setattr(ModelRunner, "collect", recording)
    out, mask = run(llada2, sampling_mode="edit", decoding_strategy="dmax", accept_threshold=0.5)
    for trajectory in out:
        assert trajectory.completion_reason in ("max_new_tokens_reached", "eos_token_generated")
        assert mask not in trajectory.token_ids
    assert merged_rows and max(merged_rows) > 0


@pytest.mark.parametrize(
    "fields",
    [
        dict(max_post_edit_steps=2),
        dict(buffer_size=2, max_post_edit_steps=3, accept_threshold=0.3),
        dict(edit_threshold=0.5, max_post_edit_steps=0),
    ],
    ids=["post-edit-2", "two-blocks", "no-post-edit"],
)
def test_greedy_edit_steps_sample_in_the_graph_path_with_the_host_rules_tokens(llada2, fields):
    """The padded static path (`capture=False`) runs the edit rule on the device, in what the sampling graph
    captures; the requests end with the host rule's tokens after as many steps."""
    from tests.engine.test_cuda_graph import count_static_steps, with_static_decode
    from tests.engine.test_engine_matches_reference import make_engine, random_prompts

    fields = {"sampling_mode": "edit", "accept_threshold": 0.7, "max_num_reqs": 4, **fields}
    params = SamplingParams(temperature=0.0, max_tokens=20)
    with make_engine(llada2, **fields) as eager:
        prompts = random_prompts(eager, [3, 7, 12, 4], seed=5)
        expected = eager.generate(prompts, params, use_tqdm=False)
    with make_engine(llada2, **fields) as llm:
        sampled: list[bool] = []
        count_static_steps(with_static_decode(llm), sampled)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert [t.nfe for t in got] == [t.nfe for t in expected]
    assert len(sampled) > got.num_engine_steps // 2 and all(sampled), "greedy decode steps sample in the graph path"


@pytest.mark.parametrize(
    "fields",
    [
        dict(max_post_edit_steps=2),
        dict(edit_threshold=0.5, max_post_edit_steps=0),
        dict(accept_threshold=0.3, edit_threshold=0.3, max_post_edit_steps=16),
    ],
    ids=["post-edit-2", "no-post-edit", "eager-edits"],
)
def test_greedy_edit_steps_are_continued_on_the_device_as_one_step_in_flight_decodes(llada2, fields):
    """``async_scheduling``: a greedy edit step is queued before its predecessor's result, its inputs and each
    block's phase moved on by the sampling graph (`advance_edit_inputs`); every request decodes exactly as with one
    step in flight (tokens, steps, each step's tokens), and the continuations of steps that finished a block are
    dropped."""
    from tests.engine.test_continuation import _generate
    from tests.engine.test_engine_matches_reference import make_engine, random_prompts

    fields = {"sampling_mode": "edit", "accept_threshold": 0.7, "max_num_reqs": 4, **fields}
    params = SamplingParams(temperature=0.0, max_tokens=20)
    with make_engine(llada2, **fields) as llm:
        prompts = random_prompts(llm, [3, 7, 12, 4], seed=5)
    expected, synchronous = _generate(llada2, prompts, params, False, **fields)
    got, run = _generate(llada2, prompts, params, True, **fields)
    assert synchronous.continued == 0
    assert got == expected
    assert run.continued > 0 and run.dropped > 0


def test_continued_edit_steps_stop_where_one_step_in_flight_stops(llada2):
    """A stop token (the one the tiny model writes most, taken from a first run) cuts a block's sampled positions
    short, and edits may write or remove it: such steps are not continued, or their continuation is dropped, and
    every request still ends as with one step in flight."""
    import collections

    from tests.engine.test_continuation import _generate
    from tests.engine.test_engine_matches_reference import make_engine, random_prompts

    fields = {"sampling_mode": "edit", "accept_threshold": 0.7, "max_num_reqs": 4, "max_post_edit_steps": 2}
    params = SamplingParams(temperature=0.0, max_tokens=20)
    with make_engine(llada2, **fields) as llm:
        prompts = random_prompts(llm, [3, 7, 12, 4], seed=5)
    plain, _ = _generate(llada2, prompts, params, False, **fields)
    stop = collections.Counter(t for answer in plain for t in answer[0][-20:]).most_common(1)[0][0]
    expected, _ = _generate(llada2, prompts, params, False, stop_token=stop, **fields)
    got, run = _generate(llada2, prompts, params, True, stop_token=stop, **fields)
    assert got == expected
    assert run.continued > 0 and "eos_token_generated" in [answer[2] for answer in got]


def test_edit_steps_with_a_repetition_penalty_are_not_continued(llada2):
    from diffulex.engine.graph_policy import GraphPolicy
    from tests.engine.test_engine_matches_reference import make_engine

    with make_engine(llada2, sampling_mode="edit", penalty_lambda=2.0) as llm:
        assert not GraphPolicy.decide(llm.config, torch.device("cpu"), llm.runner, False).continues
    with make_engine(llada2, sampling_mode="edit") as llm:
        assert GraphPolicy.decide(llm.config, torch.device("cpu"), llm.runner, False).continues


def test_a_repetition_penalty_keeps_edit_sampling_on_the_host(llada2):
    """``penalty_lambda > 0`` changes the logits on the host first: those steps replay the forward only."""
    from tests.engine.test_cuda_graph import count_static_steps, with_static_decode
    from tests.engine.test_engine_matches_reference import make_engine, random_prompts

    fields = {"sampling_mode": "edit", "accept_threshold": 0.7, "max_num_reqs": 4, "penalty_lambda": 2.0}
    with make_engine(llada2, **fields) as eager:
        prompts = random_prompts(eager, [3, 7], seed=2)
        expected = eager.generate(prompts, GREEDY, use_tqdm=False)
    with make_engine(llada2, **fields) as llm:
        sampled: list[bool] = []
        count_static_steps(with_static_decode(llm), sampled)
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert sampled and not any(sampled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_edit_graphs_sample_on_the_gpu_with_the_eager_tokens(llada2):
    """Float32 on the GPU: edit decoding's greedy steps replay the forward and sampling graphs (the edit rule on
    the device) and decode exactly as the eager engine with the host rule."""
    from tests.engine.test_cuda_graph import count_static_steps
    from tests.engine.test_engine_matches_reference import make_engine, random_prompts

    fields = dict(sampling_mode="edit", accept_threshold=0.7, max_num_reqs=8, max_post_edit_steps=2,
                  dtype="float32", attn_impl="triton")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=20)
    with make_engine(llada2, enforce_eager=True, **fields) as eager:
        prompts = random_prompts(eager, [3, 7, 12, 5, 9], seed=6)
        expected = eager.generate(prompts, params, use_tqdm=False)
    with make_engine(llada2, **fields) as llm:
        assert llm.policy.cuda_graphs and llm.runner.graphs.samples
        sampled: list[bool] = []
        count_static_steps(llm, sampled)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert any(sampled)
