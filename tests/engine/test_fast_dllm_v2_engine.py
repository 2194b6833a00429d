"""The ``fast_dllm_v2`` strategy in the engine (paged KV cache with the kept block, batching, prefix caching,
preemption) produces exactly the tokens of the Fast-dLLM v2 reference decoder, which keeps no cache and recomputes
the whole sequence every forward."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from diffulex import Diffulex, SamplingParams
from diffulex.engine.graph_policy import GraphPolicy
from diffulex.testing.checkpoints import write_tiny_checkpoint
from diffulex.testing.reference_fast_dllm_v2 import FDv2Result, reference_generate_fast_dllm_v2

GREEDY = SamplingParams(temperature=0.0, max_tokens=30)
MIXED_LENGTHS = [1, 3, 5, 8, 9, 13, 16, 21]
# The oracle's closest decision must be this far from flipping (`FDv2Result.min_margin`): well above float32
# rounding, so that the comparison means the same under other kernels (the GPU's) as on the CPU.
WELL_POSED_MARGIN = 1e-5


@pytest.fixture(scope="module")
def fdv2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Fast-dLLM v2 checkpoint with confident predictions, so thresholds accept several tokens at once."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "fdv2", family="fast_dllm_v2", seed=1, init_std=1.0)


@pytest.fixture(scope="module")
def one_layer_fdv2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "fdv2-1layer"
    return write_tiny_checkpoint(path, family="fast_dllm_v2", seed=2, init_std=1.0, num_hidden_layers=1)


def make_engine(model_dir: Path, sub_block: int, sub_blocks: int, use_block_cache: bool = True, **overrides):
    fields = dict(
        decoding_strategy="fast_dllm_v2", block_size=sub_block, buffer_size=sub_blocks,
        page_size=min(32, max(8, sub_block * sub_blocks)), max_model_len=96, max_num_batched_tokens=512,
        max_num_reqs=16, accept_threshold=0.9, strategy_options={"fdv2_use_block_cache": use_block_cache},
    )  # fmt: skip
    fields.update(overrides)
    with pytest.warns(UserWarning, match="trained with 32-token blocks") if sub_block * sub_blocks != 32 else _quiet():
        return Diffulex(str(model_dir), **fields)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def random_prompts(llm, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    banned = set(llm.settings.stop_token_ids) | {llm.mask_token_id}
    allowed = [t for t in range(llm.vocab_limit) if t not in banned]
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def reference(llm, prompt: list[int], params: SamplingParams, stop_token_ids=None) -> FDv2Result:
    """The oracle under exactly the engine's settings: its block is the engine's ``block_size * buffer_size``."""
    cfg = llm.config
    return reference_generate_fast_dllm_v2(
        llm.model, prompt, mask_token_id=llm.mask_token_id, block_size=cfg.block_size * cfg.buffer_size,
        sub_block_size=cfg.block_size, max_tokens=params.max_tokens, max_model_len=cfg.max_model_len,
        threshold=cfg.accept_threshold, use_block_cache=cfg.strategy_options.fdv2_use_block_cache,
        stop_token_ids=llm.settings.stop_token_ids if stop_token_ids is None else stop_token_ids,
        ignore_eos=params.ignore_eos, vocab_limit=llm.vocab_limit, max_nfe=params.max_nfe,
    )  # fmt: skip


def assert_matches_reference(llm, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    """The batch through the engine, each prompt alone through the oracle: same tokens, reason, forwards and
    tokens per forward. A forward that only rebuilds kept K/V after a preemption writes nothing and has no
    counterpart in the oracle."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, traj in zip(prompts, outputs.trajectories, strict=True):
        ref = reference(llm, prompt, params)
        assert ref.min_margin > WELL_POSED_MARGIN, f"prompt of length {len(prompt)}: a decision is a coin toss"
        assert traj.token_ids == ref.token_ids, f"prompt of length {len(prompt)}"
        assert traj.completion_reason == ref.completion_reason
        rebuilds = sum(s.num_new_tokens == 0 for s in traj.steps)
        assert rebuilds <= traj.num_preemptions
        assert traj.nfe == ref.nfe + rebuilds
        assert [s.num_new_tokens for s in traj.steps if s.num_new_tokens] == [len(s.written) for s in ref.steps]
    return outputs.trajectories


@pytest.mark.parametrize(
    ("sub_block", "sub_blocks", "use_block_cache"),
    [(4, 2, True), (4, 2, False), (8, 4, True), (8, 4, False), (4, 4, True), (16, 4, True)],
)
def test_a_mixed_batch_matches_the_reference(fdv2_dir: Path, sub_block, sub_blocks, use_block_cache) -> None:
    """8 prompts of mixed lengths (some ending on a block boundary) share every step; (16, 4) makes a block of 64
    positions, wider than a page."""
    with make_engine(fdv2_dir, sub_block, sub_blocks, use_block_cache, accept_threshold=0.7) as llm:
        trajectories = assert_matches_reference(llm, random_prompts(llm, MIXED_LENGTHS, seed=sub_block))
    assert max(s.num_new_tokens for t in trajectories for s in t.steps) >= 2, "some forward should take several"


def test_a_threshold_no_probability_exceeds_takes_one_token_per_forward(fdv2_dir: Path) -> None:
    with make_engine(fdv2_dir, 4, 2, accept_threshold=1.0) as llm:
        trajectories = assert_matches_reference(llm, random_prompts(llm, [3, 8, 11], seed=3))
    assert {s.num_new_tokens for t in trajectories for s in t.steps} == {1}


def test_refinement_forwards_compute_one_sub_block_and_whole_block_forwards_the_block(fdv2_dir: Path) -> None:
    """Block cache on: a forward computes B rows (a sub-block refined against the kept K/V) or the whole block of
    B*K (plus uncached prompt rows); off: never B rows."""
    prompt_len, sub_block, block = 16, 4, 8
    with make_engine(fdv2_dir, sub_block, 2, accept_threshold=1.0) as on:
        (prompt,) = random_prompts(on, [prompt_len], seed=4)
        (cached,) = assert_matches_reference(on, [prompt])
    with make_engine(fdv2_dir, sub_block, 2, use_block_cache=False, accept_threshold=1.0) as off:
        (uncached,) = assert_matches_reference(off, [prompt])
    on_rows = [s.query_len for s in cached.steps]
    assert on_rows[0] == prompt_len  # the prompt ends on a block boundary: its last row seeds the answer
    assert set(on_rows[1:]) == {sub_block, block}
    assert sub_block not in {s.query_len for s in uncached.steps[1:]}
    assert sum(on_rows) < sum(s.query_len for s in uncached.steps)


def test_with_two_layers_the_block_cache_is_an_approximation_each_mode_equal_to_its_oracle(fdv2_dir: Path) -> None:
    """The kept K/V of the rest of the block is stale after the first layer, so cache on and off may decode
    differently: here one prompt does, and each mode still equals the oracle of that mode."""
    answers = []
    for use_block_cache in (True, False):
        with make_engine(fdv2_dir, 4, 2, use_block_cache, accept_threshold=0.7) as llm:
            prompts = random_prompts(llm, MIXED_LENGTHS, seed=4)[5:7]
            answers.append([t.token_ids for t in assert_matches_reference(llm, prompts)])
    assert answers[0][0] == answers[1][0] and answers[0][1] != answers[1][1]


def test_with_one_attention_layer_the_block_cache_changes_no_token(one_layer_fdv2_dir: Path) -> None:
    """One layer: a position's K/V depends on its own token only, so the kept K/V is exact and both modes agree."""
    runs = []
    for use_block_cache in (True, False):
        with make_engine(one_layer_fdv2_dir, 4, 2, use_block_cache, accept_threshold=0.8) as llm:
            prompts = random_prompts(llm, [5, 12, 16], seed=5)
            runs.append(llm.generate(prompts, GREEDY, use_tqdm=False).trajectories)
    assert [t.token_ids for t in runs[0]] == [t.token_ids for t in runs[1]]
    assert [t.nfe for t in runs[0]] == [t.nfe for t in runs[1]]


def test_a_second_request_reuses_the_cached_prefix_and_matches_the_reference(fdv2_dir: Path) -> None:
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.7) as llm:
        (first,) = random_prompts(llm, [26], seed=6)
        assert_matches_reference(llm, [first])
        second = first[:24] + first[:5]
        (traj,) = assert_matches_reference(llm, [second])
    # 24 shared tokens are 3 pages of 8: the first forward computes the block after them only
    assert traj.steps[0].query_len == 8


def test_preempted_requests_are_rebuilt_and_match_the_reference(fdv2_dir: Path) -> None:
    """Too few pages for 8 requests: some are preempted, also while their block's K/V is kept; rebuilt from the
    tokens it was computed from, they decode exactly as if never preempted."""
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.9, num_pages=8, max_model_len=64) as llm:
        prompts = random_prompts(llm, MIXED_LENGTHS, seed=8)
        trajectories = assert_matches_reference(llm, prompts)
    assert sum(t.num_preemptions for t in trajectories) > 0
    assert any(s.num_new_tokens == 0 for t in trajectories for s in t.steps), "no kept K/V was rebuilt"


def test_max_tokens_max_model_len_and_max_nfe_match_the_reference(fdv2_dir: Path) -> None:
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.7, max_model_len=40) as llm:
        prompts = random_prompts(llm, [6, 13, 30, 35], seed=9)
        trajectories = assert_matches_reference(llm, prompts, SamplingParams(temperature=0, max_tokens=7))
        limited = assert_matches_reference(llm, prompts[:2], SamplingParams(temperature=0, max_tokens=20, max_nfe=4))
    assert [len(t.token_ids) for t in trajectories] == [7, 7, 7, 40 - 35]
    assert [t.completion_reason for t in trajectories] == ["max_new_tokens_reached"] * 3 + ["max_model_len_reached"]
    assert {t.completion_reason for t in limited} == {"max_nfe_reached"}


def test_a_stop_token_ends_the_request_as_in_the_reference(fdv2_dir: Path) -> None:
    """The token the model decodes most often is made a stop token: requests end at its first occurrence once
    its sub-block is complete, each as the oracle says."""
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.7) as llm:
        prompts = random_prompts(llm, [3, 7, 10, 16], seed=10)
        free = llm.generate(prompts, GREEDY, use_tqdm=False).trajectories
        counts: dict[int, int] = {}
        for traj in free:
            for token in traj.token_ids[1:]:
                counts[token] = counts.get(token, 0) + 1
        stop = max(counts, key=counts.get)
        # random weights rarely decode the checkpoint's own stop tokens: requests from now on stop at this one
        llm.settings = dataclasses.replace(llm.settings, stop_token_ids=frozenset({stop}))
        trajectories = assert_matches_reference(llm, prompts)
    stopped = [t for t in trajectories if t.completion_reason == "eos_token_generated"]
    assert stopped, "the stop token should end some request"
    assert all(stop not in t.token_ids for t in stopped)


def test_an_aborted_request_frees_its_pages_and_leaves_the_others_exact(fdv2_dir: Path) -> None:
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.9) as llm:
        prompts = random_prompts(llm, [5, 9], seed=11)
        kept = llm.add_request(prompts[0], GREEDY)
        dropped = llm.add_request(prompts[1], GREEDY)
        for _ in range(3):
            llm.step()
        assert llm.scheduler.kv_cache.num_used_pages > 0
        assert llm.abort_request(dropped) is True
        finished = {}
        while not llm.is_finished():
            for update in llm.step():
                if update.finished:
                    finished[update.req_id] = update.trajectory
        assert llm.scheduler.kv_cache.num_used_pages == 0
        expected = reference(llm, prompts[0], GREEDY)
    assert set(finished) == {kept}
    assert finished[kept].token_ids == expected.token_ids and finished[kept].nfe == expected.nfe


def test_the_strategy_replays_graphs_with_key_tails_and_asks_shifted_logits(fdv2_dir: Path, sdar_dir: Path) -> None:
    """On CUDA its steps would replay the decode graphs (key ends staged, greedy sampling inside), its refinements
    continued on the device with the block cache only; the graphs' rows cover a whole block plus the shifted row."""
    with make_engine(fdv2_dir, 8, 4) as llm:
        assert llm.settings.block_size == 32  # the attention span: a block of 4 sub-blocks
        cuda = GraphPolicy.decide(llm.config, torch.device("cuda"), llm.runner, True)
        assert cuda.cuda_graphs and cuda.key_tails and cuda.continues and cuda.staging_buffers == 2
        assert cuda.max_rows_per_request == 33  # the full graphs: a whole block plus the shifted row
        assert cuda.short_rows_per_request == 16  # the short ones: two sub-blocks per request on average
    with make_engine(fdv2_dir, 8, 4, use_block_cache=False) as llm:
        assert not GraphPolicy.decide(llm.config, torch.device("cuda"), llm.runner, True).continues
    with pytest.raises(ValueError, match="decoding_strategy='fast_dllm_v2' is invalid: requires a model family with "
                                         "shifted logits"):  # fmt: skip
        Diffulex(str(sdar_dir), decoding_strategy="fast_dllm_v2", block_size=8, buffer_size=4)


def test_two_micro_batches_and_the_static_step_buffers_give_the_reference_tokens(fdv2_dir: Path) -> None:
    """Micro-batches interleave the requests' steps; with the graphs' static buffers (replayed eagerly on the CPU),
    commit, whole-block and refinement forwards (whose keys go on past their rows) all take the static path. Each
    request still decodes as the oracle says."""
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.7, micro_batches=2) as llm:
        llm.enable_static_decode(capture=False)
        static_steps = []
        for graphs in (llm.runner.graphs, llm.runner.short_graphs):  # the full graphs and the refinements' own

            def counting_run(step, *args, run=graphs.run, **kwargs):
                static_steps.append(step.has_cached_tail)
                return run(step, *args, **kwargs)

            graphs.run = counting_run
        assert_matches_reference(llm, random_prompts(llm, MIXED_LENGTHS, seed=12))
    assert any(static_steps) and not all(static_steps)


def test_a_seeded_request_at_a_temperature_draws_the_same_answer_twice(fdv2_dir: Path) -> None:
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=24)
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.7) as llm:
        prompts = random_prompts(llm, [5, 11], seed=13)
        first = llm.generate(prompts, params, use_tqdm=False).trajectories
        second = llm.generate(prompts[::-1], params, use_tqdm=False).trajectories[::-1]
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False).trajectories
    assert [t.token_ids for t in first] == [t.token_ids for t in second]
    assert all(len(t.token_ids) == 24 or t.completion_reason == "eos_token_generated" for t in first)
    assert [t.token_ids for t in first] != [t.token_ids for t in greedy]
