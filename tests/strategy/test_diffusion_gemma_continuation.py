"""DiffusionGemma's denoising steps continued on the device (`CanvasRunner.launch_continuation`): the next step of
the same canvases queued from the states the step in flight proposes, before its result is read, wherever no canvas
is to end at the step in flight. The tokens and step counts are those of steps the host launches itself."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from diffulex import SamplingParams
from diffulex.strategy.diffusion_gemma import runner as canvas_runner
from tests.strategy.test_diffusion_gemma_strategy import engine, folder, one_thread, prompts  # noqa: F401

BUCKETS = (1, 2, 4)
CANVAS = 16  # the tiny checkpoint's canvas length


def generated(folder: Path, params: list[SamplingParams], alone: bool, **fields) -> tuple[list[tuple], int, int]:  # noqa: F811
    """Each request's tokens and steps (one engine, each request alone in it or all together), the steps continued
    on the device and those of them the host dropped. With ``buckets``, decoder passes from the buckets' static
    buffers (the graph path, uncaptured on the CPU)."""
    buckets = fields.pop("buckets", ())
    batch = prompts(len(params), seed=5)
    with engine(folder, **fields) as llm:
        llm.runner.settings = replace(llm.runner.settings, graph_buckets=buckets)
        if alone:
            trajectories = [
                llm.generate([p], sp, use_tqdm=False).trajectories[0] for p, sp in zip(batch, params, strict=True)
            ]
        else:
            trajectories = llm.generate(batch, params, use_tqdm=False).trajectories
        described = [(t.token_ids, t.nfe, t.completion_reason) for t in trajectories]
        return described, llm.num_continuations, llm.num_dropped_continuations


SAMPLED = [
    SamplingParams(temperature=t, max_tokens=m, seed=40 + i, ignore_eos=True)
    for i, (t, m) in enumerate([(1.0, 40), (0.7, 24), (1.3, 33)])
]


@pytest.mark.parametrize("buckets", [(), BUCKETS], ids=["eager", "static-buffers"])
@pytest.mark.parametrize("alone", [True, False], ids=["alone", "together"])
def test_continued_steps_give_the_tokens_of_steps_the_host_launches(folder: Path, buckets, alone: bool) -> None:  # noqa: F811
    """Sampled canvases far from confident (the checkpoint's stability threshold of 1): their steps are continued on
    the device, the one after a canvas's first (which encoded the context before it) too; none is dropped, and the
    answers are those of an engine without continuations (``async_scheduling=False``)."""
    expected, none, _ = generated(folder, SAMPLED, alone, async_scheduling=False, buckets=buckets)
    got, continued, dropped = generated(folder, SAMPLED, alone, buckets=buckets)
    assert none == 0
    assert continued > 0 and dropped == 0
    assert got == expected


def test_a_canvas_with_too_few_equal_argmaxes_to_be_stable_is_continued_even_greedy(folder: Path) -> None:  # noqa: F811
    """A canvas cannot end at a step unless the argmaxes of the steps before it repeated as often as the stability
    threshold: greedy canvases (entropy 0, confident at every step) are continued exactly where they cannot end, so
    no continuation is dropped. At a threshold of 2 that is also after a first step whose argmax changed; at a
    threshold of 1 only each canvas's first step (the one that encodes the context before it) is continued, since
    nothing says a later one will not end it."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=40, seed=i, ignore_eos=True) for i in range(2)]
    canvases = 2 * math.ceil(40 / CANVAS)
    for threshold in (2, 1):
        options = {"diffusion_gemma_max_denoising_steps": 8, "diffusion_gemma_stability_threshold": threshold}
        expected, _, _ = generated(folder, greedy, True, async_scheduling=False, strategy_options=options)
        got, continued, dropped = generated(folder, greedy, True, strategy_options=options)
        assert dropped == 0
        assert got == expected
        assert continued > canvases if threshold == 2 else continued == canvases


def test_a_canvas_that_ends_at_a_continued_step_drops_the_continuation(
    folder: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Where the guess is wrong (here forced: every canvas taken to be far from confident, greedy ones among them,
    which end as soon as their argmax repeats), the host finds the canvas ended, drops the continuation and
    launches the step it would have launched: the answers are still those of an engine without continuations."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, seed=i, ignore_eos=True) for i in range(2)]
    expected, _, _ = generated(folder, params, True, async_scheduling=False)
    monkeypatch.setattr(canvas_runner, "UNCONFIDENT_ENTROPY_FACTOR", 0.0)
    got, continued, dropped = generated(folder, params, True, buckets=BUCKETS)
    assert dropped > 0 and continued > dropped
    assert got == expected


def test_an_abort_or_an_arrival_while_a_continuation_is_in_flight_leaves_the_others_answers(folder: Path) -> None:  # noqa: F811
    """With a continued step in flight, one request is aborted and another arrives: nothing more of the aborted
    one is applied or reported, and the one that stays and the newcomer answer as each does alone in an engine
    without continuations."""
    prompt_a, prompt_b, prompt_c = prompts(3, seed=8)
    stays, newcomer = SAMPLED[0], SAMPLED[2]
    expected = []
    for prompt, params in ((prompt_b, stays), (prompt_c, newcomer)):
        with engine(folder, async_scheduling=False) as llm:
            expected.append(llm.generate([prompt], params, use_tqdm=False).trajectories[0].token_ids)
    with engine(folder) as llm:
        aborted = llm.add_request(prompt_a, SAMPLED[1])
        kept = llm.add_request(prompt_b, stays)
        finished = {}
        while not (llm._in_flight and llm._in_flight[-1].continuation):
            finished.update({u.req_id: u.trajectory for u in llm.step() if u.finished})
        assert llm.abort_request(aborted)
        arrived = llm.add_request(prompt_c, newcomer)
        while not llm.is_finished():
            finished.update({u.req_id: u.trajectory for u in llm.step() if u.finished})
        assert llm.num_continuations > 0
    assert aborted not in finished  # the abort is its end (its caller has its request)
    assert [finished[kept].token_ids, finished[arrived].token_ids] == expected
