"""Fast-dLLM v2's refinements continued on the device (`diffulex.engine.continuation`): with the block cache, a
refinement that leaves masks in its sub-block is followed by a refinement of the same rows, which the engine queues
before the host has read the first one's result. Every request must decode exactly as with one step in flight and
as the reference decoder does; a wrong guess (the sub-block completed after all) is dropped.

On the CPU the graphs' static buffers run through the eager forward (``capture=False``) and the inputs advance in
the reference implementation (`tests/kernels/test_step_advance.py` ties the kernel to it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from diffulex import SamplingParams
from diffulex.strategy.fast_dllm_v2 import request as fdv2_request
from diffulex.strategy.fast_dllm_v2.request import ForwardKind
from diffulex.testing.checkpoints import write_tiny_checkpoint
from tests.engine.test_fast_dllm_v2_engine import assert_matches_reference, make_engine, random_prompts, reference

LONG = SamplingParams(temperature=0.0, max_tokens=60)
SUB_BLOCK, SUB_BLOCKS = 8, 4  # the checkpoints' geometry: refinements compute 8 rows, whole-block forwards 32


@pytest.fixture(scope="module")
def fdv2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine tests' confident tiny checkpoint (thresholds below 1 accept several tokens at once)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "fdv2", family="fast_dllm_v2", seed=1, init_std=1.0)


def static_engine(model: Path, async_scheduling: bool = True, **fields):
    llm = make_engine(model, SUB_BLOCK, SUB_BLOCKS, async_scheduling=async_scheduling, **fields)
    llm.enable_static_decode(capture=False)
    return llm


def record_continued_kinds(llm) -> list[set[ForwardKind]]:
    """Per continuation launched: the forward kinds of the step it continues, read when it is launched (before
    that step's result is applied)."""
    kinds: list[set[ForwardKind]] = []
    original = llm.runner.launch_continuation

    def launch_continuation(micro_batch, opened=()):
        kinds.append({req.forward_kind() for req in llm._in_flight[-1].batch})
        return original(micro_batch, opened)

    llm.runner.launch_continuation = launch_continuation
    return kinds


def answers(trajectories) -> list[tuple]:
    return [(t.token_ids, t.nfe, t.completion_reason, [s.num_new_tokens for s in t.steps]) for t in trajectories]


def one_step_in_flight(model: Path, prompts, params: SamplingParams, **fields) -> list[tuple]:
    with static_engine(model, async_scheduling=False, **fields) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.num_continuations == 0
        return answers(outputs.trajectories)


@pytest.mark.parametrize(
    ("threshold", "lengths", "seed"),
    [(1.0, [7], 34), (0.9, [7], 34), (1.0, [8, 8, 8], 1), (1.0, [5, 8, 13], 2)],
    ids=["one-token-per-step", "several-tokens-per-step", "batch", "mixed-lengths"],
)
def test_continued_refinements_decode_as_one_step_in_flight_and_the_reference(
    fdv2_dir: Path, threshold, lengths, seed
) -> None:
    """A batch is continued only while all its requests refine: more often when they run in step (same lengths)."""
    with static_engine(fdv2_dir, accept_threshold=threshold) as llm:
        kinds = record_continued_kinds(llm)
        prompts = random_prompts(llm, lengths, seed=seed)
        got = assert_matches_reference(llm, prompts, LONG)
        continued, dropped = llm.num_continuations, llm.num_dropped_continuations
    assert answers(got) == one_step_in_flight(fdv2_dir, prompts, LONG, accept_threshold=threshold)
    assert continued > 0 and dropped == 0
    assert all(k == {ForwardKind.REFINE} for k in kinds), "only refinements are continued"


def test_every_refinement_but_its_sub_blocks_last_is_continued_at_one_token_per_step(fdv2_dir: Path) -> None:
    """Accepting one token per forward, a refinement with two masks or more left is always followed by another:
    each refinement that follows a refinement is a continuation, and no whole-block forward (32 rows) is."""
    with static_engine(fdv2_dir, accept_threshold=1.0) as llm:
        kinds = record_continued_kinds(llm)
        (traj,) = assert_matches_reference(llm, random_prompts(llm, [7], seed=3), LONG)
        continued = llm.num_continuations
    rows = [s.query_len for s in traj.steps]
    assert set(rows) >= {SUB_BLOCK, SUB_BLOCK * SUB_BLOCKS}, "both refinements and whole-block forwards ran"
    assert continued == sum(a == b == SUB_BLOCK for a, b in zip(rows, rows[1:], strict=False)) > 0
    assert len(kinds) == continued and all(k == {ForwardKind.REFINE} for k in kinds)


def test_without_the_block_cache_nothing_is_continued(fdv2_dir: Path) -> None:
    """Without the block cache every forward computes the whole block: no step is a refinement to continue."""
    with static_engine(fdv2_dir, use_block_cache=False, accept_threshold=1.0) as llm:
        assert not llm.policy.continues
        assert_matches_reference(llm, random_prompts(llm, [7, 12], seed=0), LONG)
        assert llm.num_continuations == 0


def test_a_refinement_that_completes_its_sub_block_drops_its_continuation(fdv2_dir: Path, monkeypatch) -> None:
    """Continuing every refinement with two masks left, whatever the last forward accepted, guesses wrong when a
    refinement accepts them all: the continuation (which stores nothing) is dropped, the whole-block forward the
    host chose runs instead, and the tokens stay the reference's."""
    monkeypatch.setattr(fdv2_request, "CONTINUE_ACCEPTANCE_FACTOR", 0)
    fields = dict(accept_threshold=0.5)
    with static_engine(fdv2_dir, **fields) as llm:
        prompts = random_prompts(llm, [5, 5], seed=4)
        got = assert_matches_reference(llm, prompts, LONG)
        assert llm.num_dropped_continuations > 0
    assert answers(got) == one_step_in_flight(fdv2_dir, prompts, LONG, **fields)


def test_a_stop_token_in_the_middle_of_a_sub_block_ends_as_without_continuations(fdv2_dir: Path) -> None:
    """A stop token decoded in the middle of a sub-block: the sub-block is still refined to its end (the
    algorithm's rule), continued on the device, and the request ends with the reference's tokens."""
    fields = dict(accept_threshold=1.0)
    with static_engine(fdv2_dir, **fields) as llm:
        (prompt,) = random_prompts(llm, [7], seed=3)
        (free,) = llm.generate([prompt], LONG, use_tqdm=False).trajectories
    answer = free.token_ids
    # a token first decoded strictly inside a sub-block, past the prompt's sub-block
    at = next(
        i for i, token in enumerate(answer)
        if i > SUB_BLOCK and (len(prompt) + i) % SUB_BLOCK not in (0, SUB_BLOCK - 1) and token not in answer[:i]
    )  # fmt: skip
    stop = frozenset({answer[at]})

    def run(async_scheduling: bool):
        with static_engine(fdv2_dir, async_scheduling=async_scheduling, **fields) as llm:
            llm.settings = dataclasses.replace(llm.settings, stop_token_ids=stop)
            (traj,) = llm.generate([prompt], LONG, use_tqdm=False).trajectories
            return traj, llm.num_continuations

    got, continued = run(True)
    expected, _ = run(False)
    with static_engine(fdv2_dir, **fields) as llm:
        ref = reference(llm, prompt, LONG, stop_token_ids=stop)
    assert answers([got]) == answers([expected])
    assert got.completion_reason == ref.completion_reason == "eos_token_generated"
    assert got.token_ids == ref.token_ids and len(got.token_ids) < len(answer)
    assert continued > 0


def test_an_abort_and_a_new_arrival_while_continuations_run(fdv2_dir: Path) -> None:
    """A request added while a continuation is in flight joins the next scheduled step; one aborted while its
    continuation is in flight has that result dropped; the others decode as with one step in flight (the same
    calls at the same steps)."""
    events: dict[str, int] = {}

    def run(async_scheduling: bool) -> tuple[dict[int, list[int]], int]:
        with static_engine(fdv2_dir, async_scheduling=async_scheduling, accept_threshold=1.0) as llm:
            prompts = random_prompts(llm, [8, 8, 6], seed=1)
            ids = [llm.add_request(prompts[0], LONG), llm.add_request(prompts[1], LONG)]
            finished: dict[int, list[int]] = {}
            for i in range(400):
                continuing = bool(llm._in_flight) and llm._in_flight[0].continuation
                for event, after in (("arrival", 8), ("abort", 16)):
                    if async_scheduling and event not in events and i >= after and continuing:
                        events[event] = i
                if i == events.get("arrival"):
                    ids.append(llm.add_request(prompts[2], LONG))
                if i == events.get("abort"):
                    assert llm.abort_request(ids[1])
                for update in llm.step():
                    if update.finished:
                        finished[update.req_id] = update.trajectory.token_ids
                if llm.is_finished():
                    break
            assert not llm._in_flight
            return finished, llm.num_continuations

    got, continued = run(True)
    assert set(events) == {"arrival", "abort"}, "both happen while a continuation is in flight"
    expected, _ = run(False)
    assert got == expected and continued > 0
    assert set(got) == {0, 2} and len(got[0]) == len(got[2]) == LONG.max_tokens, "the others finish"
