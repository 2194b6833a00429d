"""Continuation steps (``async_scheduling``): a decode step queued before its predecessor's result, its inputs
advanced on the device, must be exactly the step the host would have launched, so every request decodes as it
does with one step in flight.

On the CPU the graphs' static buffers run through the eager forward (``capture=False``); the advance of the
inputs then runs in its reference implementation (`tests/kernels/test_step_advance.py` ties the kernel to it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from diffulex import SamplingParams
from diffulex.engine.continuation import ContinuationRefusal
from diffulex.engine.prefill_graphs import MIN_DECODERS_PER_SPLIT_PROMPT
from diffulex.strategy.multi_bd import MultiBD
from diffulex.testing.checkpoints import write_tiny_checkpoint
from tests.engine.test_cuda_graph import every_bucket, with_static_decode
from tests.engine.test_engine_matches_reference import assert_matches_reference, make_engine, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=30)


def _answers(outputs) -> list[tuple]:
    return [
        (t.token_ids, t.nfe, t.completion_reason, [(s.num_new_tokens, s.running_token_ids) for s in t.steps])
        for t in outputs.trajectories
    ]


@dataclasses.dataclass(frozen=True)
class _Steps:
    """What an engine's steps were: how many, continued on the device, of those dropped, blocks opened there."""

    steps: int
    continued: int
    dropped: int
    opened: int


def _generate(model: Path, prompts, params, async_scheduling: bool, stop_token: int | None = None, **fields):
    with make_engine(model, async_scheduling=async_scheduling, **fields) as llm:
        with_static_decode(llm)
        if stop_token is not None:  # a stop token the tiny model really produces
            llm.settings = dataclasses.replace(llm.settings, stop_token_ids=frozenset({stop_token}))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert not llm._in_flight, "nothing stays in flight once every request has finished"
        steps = _Steps(llm.num_steps, llm.num_continuations, llm.num_dropped_continuations, llm.num_opened_blocks)
        return _answers(outputs), steps


@pytest.mark.parametrize("lengths", [[9], [3, 6, 9, 12, 5]], ids=["one-request", "five-requests"])
def test_continued_steps_decode_every_request_as_one_step_in_flight_does(peaky_sdar_dir: Path, lengths) -> None:
    fields = dict(accept_threshold=0.8)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, lengths, seed=31)
    expected, synchronous = _generate(peaky_sdar_dir, prompts, GREEDY, False, **fields)
    got, run = _generate(peaky_sdar_dir, prompts, GREEDY, True, **fields)
    assert synchronous.continued == 0
    assert got == expected
    assert run.continued > 0 and run.dropped == 0


@pytest.mark.parametrize("buffer_size", [2, 4])
def test_several_running_blocks_are_continued_as_one_step_in_flight_decodes_them(sdar_dir: Path,
                                                                                 buffer_size: int) -> None:
    """A running set of several blocks computes the same rows next step unless a block joins it: the device lets a
    block force once the one before it is decoded far enough and stores decoded blocks in order (`BlockGates`);
    once its leading block is stored, the device moves the blocks on by one (`BlockOpening`). A random model
    accepts only what its blocks force, so the guess that a block which may not force gains no token holds: every
    request decodes exactly as with one step in flight, most steps are continued, blocks open, none is dropped."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    fields = dict(buffer_size=buffer_size, page_size=16)
    with make_engine(sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, [9], seed=17)
    expected, _ = _generate(sdar_dir, prompts, params, False, **fields)
    got, run = _generate(sdar_dir, prompts, params, True, **fields)
    assert got == expected
    assert run.continued > 3 * run.steps // 4 and run.opened > 2 and run.dropped == 0


@pytest.mark.parametrize("buffer_size", [2, 4])
def test_a_running_set_that_reaches_its_answers_end_drains_on_the_device(sdar_dir: Path, buffer_size: int) -> None:
    """Once a request's newest block is its answer's last no block joins, and each stored leading block leaves the
    blocks after it to decode alone: the device moves the set on all the same, a placeholder block last (never
    sampled nor stored), so the drain is continued like any other step, with the tokens of one step in flight
    (answers ending inside a block and at its end). Only the prompts' step is followed by one of the host's: it
    computed the short prompts with their blocks in one chunk graph."""
    load = _greedy_answers_continued(sdar_dir, [5, 9, 12], [21, 24, 30], buffer_size=buffer_size, page_size=16)
    assert dict(load.refused_continuations) == {"prefill_in_step": 1} and load.dropped_continuations == 0
    assert load.continued_steps == load.steps - 2


def _greedy_answers_continued(model: Path, prompt_lengths: list[int], max_tokens: list[int], **fields):
    """Greedy answers of the given lengths (``ignore_eos``) to random prompts, with continuations on graphs' static
    buffers, checked against one step in flight; the continued engine's load."""
    with make_engine(model, **fields) as llm:
        prompts = random_prompts(llm, prompt_lengths, seed=17)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    expected, _ = _generate(model, prompts, params, False, **fields)
    with make_engine(model, async_scheduling=True, **fields) as llm:
        with_static_decode(llm)
        got = _answers(llm.generate(prompts, params, use_tqdm=False))
        load = llm.load()
    assert got == expected
    return load


def test_a_family_that_forces_in_every_block_forces_in_the_blocks_the_device_opens(tmp_path: Path) -> None:
    """Stable-DiffCoder's sampler forces its best row in every block, whatever the block before it holds
    (`Family.force_every_block`); a block the device opens must force too. Confident weights and two running
    blocks, so blocks open on the device with the block before them partly decoded: the tokens, and the tokens of
    every step, are those of one step in flight (the device's gate rule once left such a block unforced)."""
    model = write_tiny_checkpoint(tmp_path / "stable", family="stable_diffcoder", seed=5, init_std=1.0)
    fields = dict(buffer_size=2, page_size=8, accept_threshold=0.8)
    with make_engine(model, **fields) as llm:
        prompts = random_prompts(llm, [3, 6, 9, 12, 14, 5, 7, 2], seed=22)
    params = SamplingParams(temperature=0.0, max_tokens=30)
    expected, _ = _generate(model, prompts, params, False, **fields)
    got, run = _generate(model, prompts, params, True, **fields)
    assert got == expected
    assert run.opened > len(prompts) and run.dropped == 0


def test_requests_out_of_step_move_several_running_blocks_on(sdar_dir: Path) -> None:
    """Requests whose blocks are stored at different steps (prompts of different lengths: their first blocks hold
    different numbers of positions to decode): at buffer 2 each moves its blocks on by one on the device when its
    leading block is stored, so the others' steps go on being continued; tokens are those of one step in flight."""
    fields = dict(buffer_size=2, page_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with make_engine(sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, [3, 6, 9, 13, 17, 21], seed=5)
    expected, _ = _generate(sdar_dir, prompts, params, False, **fields)
    got, run = _generate(sdar_dir, prompts, params, True, **fields)
    assert got == expected
    assert run.opened > len(prompts), "requests moved their blocks on on the device"
    assert run.continued > run.steps // 2 and run.dropped == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured CUDA graphs need a GPU")
@pytest.mark.parametrize("buffer_size", [2, 4])
def test_captured_graphs_continue_several_running_blocks_as_one_step_in_flight_decodes_them(
    sdar_dir: Path, buffer_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on captured graphs, whose sampling graph ends with the advance kernel (gates included); at a buffer
    of 4 the two running blocks replay the graphs sized for two blocks a request (`Strategy.short_step_rows`)."""
    monkeypatch.setattr(MultiBD, "short_step_buckets", every_bucket)  # short graphs for this test's few requests
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    answers = {}
    for async_scheduling in (False, True):
        with make_engine(sdar_dir, buffer_size=buffer_size, async_scheduling=async_scheduling) as llm:
            prompts = random_prompts(llm, [5, 9, 12], seed=23)
            answers[async_scheduling] = _answers(llm.generate(prompts, params, use_tqdm=False))
            replays, continued = llm.runner.graph_replays, llm.num_continuations
            short_replays = llm.runner.short_graphs.num_replays if llm.runner.short_graphs is not None else 0
            assert llm.num_dropped_continuations == 0
    assert answers[True] == answers[False]
    assert replays > 0 and continued > 0
    assert (short_replays > 0) == (buffer_size > 2)


@pytest.mark.parametrize("buffer_size", [2, 3])
def test_a_confident_model_decodes_several_running_blocks_as_one_step_in_flight_does(peaky_sdar_dir: Path,
                                                                                     buffer_size: int) -> None:
    """Blocks that accept above the threshold, join the running set and finish out of order (a decoded block
    waiting for the one before it): continuations whose guess fails are dropped, the rest decode as one step in
    flight does, token for token."""
    fields = dict(accept_threshold=0.95, buffer_size=buffer_size, semi_complete_threshold=0.7)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, [4, 9, 13], seed=17)
    expected, _ = _generate(peaky_sdar_dir, prompts, params, False, **fields)
    got, run = _generate(peaky_sdar_dir, prompts, params, True, **fields)
    assert got == expected
    assert run.continued > 0


def test_with_an_add_block_threshold_of_0_a_block_joins_every_step_and_nothing_is_guessed(peaky_sdar_dir: Path) -> None:
    """``add_block_threshold=0``: a running set with room gains a block at every schedule, so its rows never stay
    the same (no continuation is launched only to be dropped), and every request decodes as one step in flight."""
    fields = dict(accept_threshold=0.95, buffer_size=3, add_block_threshold=0.0, page_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, [3, 5, 7, 9], seed=9)
    expected, _ = _generate(peaky_sdar_dir, prompts, params, False, **fields)
    got, run = _generate(peaky_sdar_dir, prompts, params, True, **fields)
    assert got == expected
    assert run.continued > 0 and run.dropped == 0


def test_a_saturated_engine_keeps_continuing_and_admits_what_waits_one_step_later(sdar_dir: Path) -> None:
    """Ten prompts for four request slots: while every slot is taken nobody could be admitted, so steps go on
    being continued; a request that finishes in the step in flight frees its slot for the step after the
    continuation. Every request's steps and tokens are those of one step in flight, with at most one step more in
    all for each admission the continuation put off."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fields = dict(max_num_reqs=4)
    with make_engine(sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, [3, 5, 7, 9, 11, 4, 6, 8, 10, 12], seed=9)
    expected, synchronous = _generate(sdar_dir, prompts, params, False, **fields)
    got, run = _generate(sdar_dir, prompts, params, True, **fields)
    assert got == expected
    assert run.continued > run.steps // 2 and run.dropped == 0
    assert synchronous.steps <= run.steps <= synchronous.steps + len(prompts) - fields["max_num_reqs"]


def test_continued_steps_match_the_reference_decoder(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir) as llm:
        with_static_decode(llm)
        trajectories = assert_matches_reference(llm, random_prompts(llm, [7, 10], seed=4), GREEDY)
        assert llm.num_continuations > sum(t.nfe for t in trajectories) // 4, "most decode steps are continued"


def test_requests_out_of_step_are_continued_across_their_blocks(peaky_sdar_dir: Path) -> None:
    """Twelve requests whose blocks end at different steps (prompts of different lengths, a confident model): at
    every step some request stores its decoded block, so without opening the next block on the device
    (`BlockOpening`) a step could rarely be continued for all of them. They decode exactly as with one step in
    flight, most steps are continued, and no continuation is dropped for it."""
    fields = dict(accept_threshold=0.8, page_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, [3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18], seed=21)
    expected, _ = _generate(peaky_sdar_dir, prompts, params, False, **fields)
    got, run = _generate(peaky_sdar_dir, prompts, params, True, **fields)
    assert got == expected
    assert run.opened > len(prompts), "requests moved on to their next block on the device"
    assert run.continued > run.steps // 2 and run.dropped == 0


def _continued_block_by_block(model: Path, prompt_len: int, max_tokens: int) -> list[tuple]:
    """One request of ``prompt_len`` prompt tokens and ``max_tokens`` answer tokens (blocks of 4, one page, so that
    no opening waits for a page), decoded with and without continuations: the same answer, every answer block after
    the first opened on the device, every step after the prefill continued. Returns the answers."""
    fields = dict(accept_threshold=0.8, page_size=32)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with make_engine(model, **fields) as llm:
        prompts = random_prompts(llm, [prompt_len], seed=21)
    expected, _ = _generate(model, prompts, params, False, **fields)
    got, run = _generate(model, prompts, params, True, **fields)
    assert got == expected
    answer_blocks = -(-(prompt_len + max_tokens) // 4) - prompt_len // 4
    assert run.opened == answer_blocks - 1, "every answer block after the first was opened on the device"
    assert run.continued == run.steps - 1 and run.dropped == 0
    return expected


@pytest.mark.parametrize("max_tokens", [17, 18, 19])
def test_an_answer_ending_inside_its_last_block_is_continued_into_that_block(peaky_sdar_dir: Path,
                                                                            max_tokens: int) -> None:
    """A prompt of 8 (two blocks of 4) and 17-19 answer tokens: the answer's last block (24-27) ends at 25-27, and
    the device opens it like the blocks before it (sampling it up to the answer's end), so every step after the
    prefill is continued, as at 16 tokens, and the request decodes exactly as with one step in flight. (With
    requests arriving at their own times some request is always at its last block: a step that could not be
    continued for it was a step continued for nobody.)"""
    expected = _continued_block_by_block(peaky_sdar_dir, 8, max_tokens)
    assert len(expected[0][0]) == max_tokens


@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(5, 19), (6, 18)])
def test_an_answer_whose_first_block_holds_prompt_positions_is_continued_out_of_it(peaky_sdar_dir: Path,
                                                                                  prompt_len: int,
                                                                                  max_tokens: int) -> None:
    """A prompt that ends inside a block (5 or 6 of positions 4-7): the answer's first block holds the prompt's
    last positions, which are no candidates, and once it is stored the device opens the block after it like any
    other, so every answer block after the first is opened on the device, every step after the prefill is
    continued, and the request decodes exactly as with one step in flight."""
    _continued_block_by_block(peaky_sdar_dir, prompt_len, max_tokens)


def test_the_engines_load_reports_its_steps_and_those_continued_on_the_device(peaky_sdar_dir: Path) -> None:
    """What the server exports (`diffulex_continued_steps_total`) and the serving sweep reads: steps applied, and of
    them the continued ones (launched continuations less dropped ones, less one queued after the last request's
    final step, which has nobody left to apply it to)."""
    with make_engine(peaky_sdar_dir, accept_threshold=0.8) as llm:
        with_static_decode(llm)
        prompts = random_prompts(llm, [3, 6, 9], seed=5)
        before = llm.load()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        after = llm.load()
        assert after.steps - before.steps == llm.num_steps > 0
        launched = llm.num_continuations - llm.num_dropped_continuations
        assert launched - 1 <= after.continued_steps - before.continued_steps <= launched
        assert after.continued_steps > 0


def test_every_step_the_host_launches_itself_is_counted_with_its_reason(peaky_sdar_dir: Path) -> None:
    """Each applied step was either queued as a continuation or launched by the host for a reason the load names
    (`ContinuationRefusal`, `diffulex_continuation_refusals_total`): a request that arrives while another decodes,
    with a request slot free, is an admission the host's step must make."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with make_engine(peaky_sdar_dir, accept_threshold=0.8, max_num_reqs=4) as llm:
        with_static_decode(llm)
        first, second = random_prompts(llm, [6, 9], seed=3)
        llm.add_request(first, params)
        for _ in range(3):
            llm.step()
        llm.add_request(second, params)
        while not llm.is_finished():
            llm.step()
        load = llm.load()
    assert load.refused_continuations["admission"] >= 1
    assert set(load.refused_continuations) <= {str(reason) for reason in ContinuationRefusal}
    assert load.steps == llm.num_continuations + sum(load.refused_continuations.values())
    assert 0 < load.continued_steps <= llm.num_continuations - llm.num_dropped_continuations


def _staggered(model: Path, prompts, arrivals: list[int], max_tokens: list[int], async_scheduling: bool,
               **fields):
    """Requests added at the given engine steps (while the others decode), run to the end: their answers and the
    engine's load."""
    with make_engine(model, async_scheduling=async_scheduling, accept_threshold=0.8, page_size=32, **fields) as llm:
        with_static_decode(llm)
        ids, step = {}, 0
        pending = sorted(zip(arrivals, range(len(prompts)), strict=True))
        while pending or not llm.is_finished():
            while pending and pending[0][0] <= step:
                _, i = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)
                ids[llm.add_request(prompts[i], params)] = i
            updates = llm.step() if not llm.is_finished() else []
            step += 1
            for update in updates:
                if update.finished:
                    ids[update.req_id] = (ids[update.req_id], update.trajectory.token_ids)
        return sorted(ids.values()), llm.load()


def test_a_prompt_admitted_beside_decoders_and_a_finished_request_leave_the_others_continuing(
        peaky_sdar_dir: Path) -> None:
    """A prompt of 70 tokens admitted while another request decodes: its prefix runs in a prefill graph of its own
    before the step's decode graph, which computes its first block after the prefix, as the host's next step does,
    so the step after the admission is continued. A request that finishes rides along in the continuations of the
    others (nobody waits for its slot). Only the admission is the host's; every request decodes as with one step in
    flight."""
    with make_engine(peaky_sdar_dir) as llm:
        prompts = random_prompts(llm, [9, 70], seed=12)
    args = (peaky_sdar_dir, prompts, [0, 3], [12, 40])
    expected, _ = _staggered(*args, async_scheduling=False)
    got, load = _staggered(*args, async_scheduling=True)
    assert got == expected
    # the host's steps: the first prompt's, the admission's, and the one after the first prompt's step, which
    # computed that prompt's 9 tokens with its block in one chunk graph (a continuation would compute them again)
    assert dict(load.refused_continuations) == {"admission": 1, "prefill_in_step": 1}
    assert load.continued_steps == load.steps - 3


@pytest.mark.parametrize("buffer_size", [1, 2])
def test_a_shifted_family_continues_with_its_tokens_one_row_later(tmp_path: Path, buffer_size: int) -> None:
    """Dream reads position p from row p - 1: its continuations write tokens one row later, and a request's blocks
    moved on by the device start one row before the first, at the stored block's last token."""
    model = write_tiny_checkpoint(tmp_path / "dream", family="dream", seed=2, init_std=1.0)
    fields = dict(accept_threshold=0.7, buffer_size=buffer_size, page_size=16)
    with make_engine(model, **fields) as llm:
        prompts = random_prompts(llm, [4, 9, 13, 6, 11], seed=7)
    expected, _ = _generate(model, prompts, GREEDY, False, **fields)
    got, run = _generate(model, prompts, GREEDY, True, **fields)
    assert got == expected and run.continued > 0 and run.opened > 0


def test_a_stop_token_in_the_middle_of_a_block_drops_the_continuation(peaky_sdar_dir: Path) -> None:
    """A stop token decoded before a block's last mask moves the decoding limit: the continuation, which samples
    every mask of the block, is not the host's next step. It is dropped and the right step is launched."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    fields = dict(accept_threshold=0.95)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, [5], seed=0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        mask, block_size = llm.mask_token_id, llm.config.block_size
    answer, steps = outputs.trajectories[0].token_ids, outputs.trajectories[0].steps
    # a token decoded for the first time in a later block (not the prompt's, decoded by the eager prefill step),
    # at a step that left an earlier position of its block masked
    stop_token = None
    for before, after in zip(steps, steps[1:], strict=False):
        (block,) = after.running_block_ids
        if before.running_block_ids != after.running_block_ids or block < 3:
            continue
        pairs = zip(before.running_token_ids, after.running_token_ids, strict=True)
        new = [i for i, (a, b) in enumerate(pairs) if a != b]
        token = after.running_token_ids[new[0]] if new else None
        at = block * block_size + (new[0] if new else 0) - 5
        if new and mask in after.running_token_ids[: new[0]] and token not in answer[:at]:
            stop_token = token
            break
    assert stop_token is not None, "the tiny model should fill some block out of order"
    expected, _ = _generate(peaky_sdar_dir, prompts, params, False, stop_token, **fields)
    got, run = _generate(peaky_sdar_dir, prompts, params, True, stop_token, **fields)
    assert got == expected
    assert expected[0][2] == "eos_token_generated"
    assert run.dropped > 0


def test_waiting_requests_and_aborts_fall_back_to_launching_after_the_result(peaky_sdar_dir: Path) -> None:
    """A request added or aborted while a continuation is in flight: the newcomer joins the next scheduled step,
    the aborted request's continued result is dropped, the others decode as without continuations."""

    def run(async_scheduling: bool) -> tuple[dict[int, list[int]], int]:
        with make_engine(peaky_sdar_dir, accept_threshold=0.8, async_scheduling=async_scheduling) as llm:
            with_static_decode(llm)
            prompts = random_prompts(llm, [6, 8, 10], seed=12)
            ids = [llm.add_request(prompts[0], GREEDY), llm.add_request(prompts[1], GREEDY)]
            finished: dict[int, list[int]] = {}
            for i in range(200):
                if i == 6:
                    ids.append(llm.add_request(prompts[2], GREEDY))
                if i == 9:
                    llm.abort_request(ids[1])
                for update in llm.step():
                    if update.finished:
                        finished[update.req_id] = update.trajectory.token_ids
                if llm.is_finished():
                    break
            return finished, llm.num_continuations

    expected, _ = run(False)
    got, continued = run(True)
    assert got == expected and continued > 0
    assert {0, 2} <= set(got), "the first request and the newcomer finish"
    assert 1 not in got or len(got[1]) < len(got[0]), "the aborted request stops early"


def test_a_continuation_that_only_stores_is_applied_without_waiting_for_it(peaky_sdar_dir: Path) -> None:
    """Once the host knows a continuation only stores decoded blocks (it samples nothing), it applies it without
    reading its result and launches the next step at once; the tokens stay those of the reference decoder."""
    with make_engine(peaky_sdar_dir) as llm:
        with_static_decode(llm)
        launched = []
        original = llm.runner.launch_continuation

        def launch_continuation(micro_batch, opened=()):
            pending = original(micro_batch, opened)
            launched.append(pending)
            return pending

        llm.runner.launch_continuation = launch_continuation
        assert_matches_reference(llm, random_prompts(llm, [7], seed=4), GREEDY)
    never_read = [p for p in launched if p.accepted_tokens is not None]  # `result()` clears it
    assert never_read, "some continuations only stored their block"
    assert all(not any(p.accepted_tokens[0].tolist()) for p in never_read), "and accepted nothing"


def test_a_request_waiting_for_pages_does_not_hold_back_the_continuations_of_the_others(sdar_dir: Path) -> None:
    """Eight request slots but pages for about two requests: the others wait while slots are free. Only a request
    the next schedule would admit makes the host plan the step (`Scheduler.admits_waiting`), so each admission
    (preempted requests come back too) costs at most one step that is not continued, and every request decodes
    as with one step in flight."""
    fields = dict(num_pages=8, page_size=8, max_num_reqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with make_engine(sdar_dir, **fields) as llm:
        prompts = random_prompts(llm, [9, 12, 7, 10], seed=3)
    expected, _ = _generate(sdar_dir, prompts, params, False, **fields)
    with make_engine(sdar_dir, async_scheduling=True, **fields) as llm:
        with_static_decode(llm)
        llm.scheduler.limits.reserve_running_pages = True  # as on a GPU
        outputs = llm.generate(prompts, params, use_tqdm=False)
        load = llm.load()
    assert _answers(outputs) == expected
    admissions = len(prompts) + sum(t.num_preemptions for t in outputs.trajectories)
    assert load.refused_continuations.get("admission", 0) <= admissions
    assert load.continued_steps > load.steps // 3


def test_a_block_without_a_page_to_lend_is_named_as_why_the_step_was_not_continued(peaky_sdar_dir: Path) -> None:
    """Continuations store blocks in pages lent ahead; where none is free to lend (here no loans at all) the
    step that would store into one is the host's, and the load says why (`no_page`)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with make_engine(peaky_sdar_dir, accept_threshold=0.8, page_size=8) as llm:
        with_static_decode(llm)
        llm.scheduler.limits.reserve_running_pages = False
        llm.generate(random_prompts(llm, [9, 6], seed=3), params, use_tqdm=False)
        load = llm.load()
    assert load.refused_continuations.get("no_page", 0) > 0


def test_requests_that_could_be_admitted_wait_up_to_admission_delay_steps_to_be_admitted_together(
        peaky_sdar_dir: Path) -> None:
    """Two prompts arriving one step apart while another request decodes: admitted at the next steps, each
    admission is a step of the host's; allowed to wait two continued steps, both are admitted in one. Every request
    decodes as with one step in flight."""
    with make_engine(peaky_sdar_dir) as llm:
        prompts = random_prompts(llm, [9, 11, 7], seed=5)
    args = (peaky_sdar_dir, prompts, [0, 3, 4], [40, 12, 12])
    expected, _ = _staggered(*args, async_scheduling=False)
    at_once, load_at_once = _staggered(*args, async_scheduling=True, admission_delay_steps=0)
    delayed, load_delayed = _staggered(*args, async_scheduling=True, admission_delay_steps=2)
    assert at_once == delayed == expected
    assert load_at_once.refused_continuations["admission"] == 2
    assert load_delayed.refused_continuations["admission"] == 1
    assert load_delayed.steps - load_delayed.continued_steps < load_at_once.steps - load_at_once.continued_steps


def test_answers_that_neither_start_nor_end_on_a_block_boundary_are_continued_to_their_end(sdar_dir: Path) -> None:
    """Prompts whose last positions share the answer's first block, and answers whose end falls inside their last
    block: each running set still holds whole blocks of rows (the prompt's positions and those past the answer's end
    no candidates), so the device moves it on through the drain to the answer's end; the tokens are those of one
    step in flight. The one step the host launches is where the longest answer's chain of continuations reached past
    the pages lent at its start (one page past the running set's next block)."""
    load = _greedy_answers_continued(sdar_dir, [41, 83, 6], [30, 61, 21], buffer_size=4, page_size=16)
    assert dict(load.refused_continuations) == {"host_opens_block": 1}
    assert load.continued_steps == load.steps - 2


@pytest.mark.parametrize("decoders", [2, MIN_DECODERS_PER_SPLIT_PROMPT])
def test_a_short_prompt_beside_many_decoders_runs_apart_so_the_step_after_its_admission_is_continued(
        peaky_sdar_dir: Path, decoders: int) -> None:
    """A 9-token prompt and its first block fit a chunk graph beside the decoders, one forward for the step; but then
    the prompt's rows are in the layout a continuation would replay, and the step after the admission is the host's
    (`prefill_in_step`). Beside `MIN_DECODERS_PER_SPLIT_PROMPT` decoders or more, whose idle GPU during a host's step
    costs more than the prompt's own forward, the prompt replays a prefill graph of its own and that step is
    continued. The tokens are those of one step in flight either way. (The decoders' own prompts, in the first step,
    have no decoder beside them: they ride whole, and the step after them is the host's.)"""
    with make_engine(peaky_sdar_dir) as llm:
        prompts = random_prompts(llm, [6] * decoders + [9], seed=31)
    args = (peaky_sdar_dir, prompts, [0] * decoders + [4], [40] * decoders + [12])
    expected, _ = _staggered(*args, async_scheduling=False, max_num_reqs=16)
    got, load = _staggered(*args, async_scheduling=True, max_num_reqs=16)
    assert got == expected and load.dropped_continuations == 0
    split = decoders >= MIN_DECODERS_PER_SPLIT_PROMPT
    assert load.refused_continuations[ContinuationRefusal.PREFILL_IN_STEP] == (1 if split else 2)
