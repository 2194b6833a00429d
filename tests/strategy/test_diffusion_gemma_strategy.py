"""The ``diffusion_gemma`` strategy on the engine, on a tiny random DiffusionGemma checkpoint (float32, CPU).

At temperature 0 the engine's answers are compared with `greedy_generate` (the generation algorithm written
plainly over the model; tests/models/test_diffusion_gemma.py holds it to transformers' own loop) given the same
initial canvases: the engine draws canvas ``c`` of a request from its seed (`initial_canvas`), so the reference
gets exactly those tokens. The reference returns whole canvases with padding after the first stop token; the
engine's answer is the same tokens cut before the first stop token and at ``max_tokens``.
"""

from __future__ import annotations

import json
import math
import shutil
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from diffulex import Diffulex, SamplingParams
from diffulex.models.diffusion_gemma import load_diffusion_gemma
from diffulex.strategy.diffusion_gemma.canvas import initial_canvas
from diffulex.strategy.diffusion_gemma.pending import PendingCanvases
from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint
from diffulex.testing.diffusion_gemma_canvas_reference import per_request_launch
from diffulex.testing.diffusion_gemma_reference import greedy_generate

FIRST_TOKEN = 7  # prompts avoid the special ids (0-6)
STEPS = 8  # max_denoising_steps: canvases that do not settle stop here (keeps the tests short)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: one thread is much faster than two on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers that only nudge the residual: greedy canvases settle after a few steps (some, not all)."""
    path = tmp_path_factory.mktemp("dgemma") / "settling"
    return write_tiny_diffusion_gemma_checkpoint(path, seed=0, layer_output_scale=0.5)


@pytest.fixture(scope="module")
def model(folder: Path):
    return load_diffusion_gemma(folder)


def engine(folder: Path, **fields) -> object:
    settings = dict(
        max_model_len=256, max_num_reqs=8, num_pages=64, dtype="float32",  # the reference's dtype, on any device
        strategy_options={"diffusion_gemma_max_denoising_steps": STEPS},
    )
    settings.update(fields)
    return Diffulex(str(folder), **settings)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 13, 9, 21, 5, 16, 11, 30][:count]  # some longer than the sliding window (8), one a whole canvas
    return [torch.randint(FIRST_TOKEN, 300, (n,), generator=g).tolist() for n in lengths]


def reference_answer(llm, model, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[list[int]]]:
    """What the engine must answer for ``prompt`` at temperature 0, and the reference's steps per canvas."""
    canvas_length = model.config.canvas_length
    num_canvases = math.ceil(params.max_tokens / canvas_length)
    noise = [initial_canvas(params.seed, c, canvas_length, llm.vocab_limit, torch.device("cpu"))[None]
             for c in range(num_canvases)]  # fmt: skip
    options = llm.config.strategy_options
    stops = tuple(sorted(llm.settings.stop_token_ids))
    generation = greedy_generate(
        model, torch.tensor([prompt]), noise, params.max_tokens, options.diffusion_gemma_max_denoising_steps,
        options.diffusion_gemma_stability_threshold, stops, pad_token_id=0, vocab_limit=llm.vocab_limit,
    )  # fmt: skip
    answer = generation.tokens[0, len(prompt) :].tolist()[: params.max_tokens]
    first_stop = next((i for i, t in enumerate(answer) if t in stops), len(answer))
    return answer[:first_stop], [row_steps for row_steps in generation.steps]


def test_greedy_answers_equal_the_reference_generation_loop(folder: Path, model) -> None:
    """Four prompts in one batch, 40 tokens each (three canvases of 16, the last cut at 8): every answer equals
    the reference's tokens, and the engine ran exactly as many decoder passes per request as the reference's
    canvases took steps (adaptive stopping ends canvases at the same step)."""
    with engine(folder) as llm:
        assert llm.config.block_size == model.config.canvas_length == 16
        batch = prompts(4)
        params = [SamplingParams(temperature=0.0, max_tokens=40, seed=100 + i, ignore_eos=True) for i in range(4)]
        outputs = llm.generate(batch, params, use_tqdm=False)
        settled = 0
        for prompt, sp, traj in zip(batch, params, outputs.trajectories, strict=True):
            sp_stops = SamplingParams(temperature=0.0, max_tokens=40, seed=sp.seed)
            expected, steps = reference_answer_ignoring_stops(llm, model, prompt, sp_stops)
            assert traj.token_ids == expected
            assert traj.completion_reason == "max_new_tokens_reached"
            assert traj.nfe == sum(s[0] for s in steps)
            settled += sum(s[0] < STEPS for s in steps)
        assert settled > 0  # some canvases stopped early: the stopping rule was exercised


def reference_answer_ignoring_stops(llm, model, prompt, params) -> tuple[list[int], list[list[int]]]:
    """`reference_answer` with no stop token (the engine's ``ignore_eos``)."""
    canvas_length = model.config.canvas_length
    num_canvases = math.ceil(params.max_tokens / canvas_length)
    noise = [initial_canvas(params.seed, c, canvas_length, llm.vocab_limit, torch.device("cpu"))[None]
             for c in range(num_canvases)]  # fmt: skip
    options = llm.config.strategy_options
    generation = greedy_generate(
        model, torch.tensor([prompt]), noise, params.max_tokens, options.diffusion_gemma_max_denoising_steps,
        options.diffusion_gemma_stability_threshold, (), pad_token_id=0, vocab_limit=llm.vocab_limit,
    )  # fmt: skip
    return generation.tokens[0, len(prompt) :].tolist()[: params.max_tokens], generation.steps


def test_a_stop_token_ends_the_answer_at_the_canvas_that_holds_it(folder: Path, model, tmp_path: Path) -> None:
    """A stop token (``eos_token_id`` of generation_config.json) produced in the second canvas ends the answer
    before it, after that canvas: no third canvas is denoised, as in the reference loop."""
    prompt = prompts(2)[1]
    with engine(folder) as llm:
        free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48, seed=5, ignore_eos=True),
                            use_tqdm=False).trajectories[0].token_ids  # fmt: skip
    stop = next(t for i, t in enumerate(free) if i >= 16 and t not in free[:i])  # first seen in canvas 2
    copy = tmp_path / "stopping"
    shutil.copytree(folder, copy)
    generation_config = json.loads((copy / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [stop]
    (copy / "generation_config.json").write_text(json.dumps(generation_config))
    with engine(copy) as llm:
        assert stop in llm.settings.stop_token_ids
        params = SamplingParams(temperature=0.0, max_tokens=48, seed=5)
        traj = llm.generate([prompt], params, use_tqdm=False).trajectories[0]
        expected, steps = reference_answer(llm, model, prompt, params)
    assert traj.token_ids == expected == free[: free.index(stop)]
    assert traj.completion_reason == "eos_token_generated"
    assert traj.nfe == sum(s[0] for s in steps[:2])


def run_requests(llm, batch: list[list[int]], params: list[SamplingParams]) -> tuple[list, list]:
    """Add every request, step until all finish; their trajectories and request objects, in order."""
    ids = [llm.add_request(prompt, sp) for prompt, sp in zip(batch, params, strict=True)]
    requests = {req.req_id: req for req in llm.scheduler.waiting}
    finished = {}
    while not llm.is_finished():
        finished.update({u.req_id: u.trajectory for u in llm.step() if u.finished})
    return [finished[i] for i in ids], [requests[i] for i in ids]


def test_mixed_batch_prefix_hit_and_preemption_give_the_tokens_of_single_runs(folder: Path) -> None:
    """Eight requests (greedy and sampled, different lengths and budgets) in one engine whose page pool is too
    small for all of them at once, after a request whose 30-token prompt left its first page in the prefix cache:
    the request with the same prompt and one that shares its first 16 tokens find that page, at least one request
    is preempted and encodes its K/V again, and every answer equals the answer of the same request run alone in
    an engine of its own, without prefix caching."""
    batch = prompts(8)
    cached = batch[7]  # 30 tokens: one full page of 16
    batch[0] = list(cached)
    batch[1] = cached[:16] + batch[1]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=[40, 24, 33, 16, 48, 20, 30, 40][i], seed=i,
                       ignore_eos=True)
        for i in range(8)
    ]  # fmt: skip
    alone = []
    for prompt, sp in zip(batch, params, strict=True):
        with engine(folder, enable_prefix_caching=False) as llm:
            alone.append(llm.generate([prompt], sp, use_tqdm=False).trajectories[0])
    with engine(folder, num_pages=9) as llm:
        llm.generate([cached], SamplingParams(max_tokens=8, seed=99), use_tqdm=False)
        together, requests = run_requests(llm, batch, params)
    assert [req.prefix_hit_len for req in requests[:2]] == [16, 16]
    assert sum(t.num_preemptions for t in together) >= 1
    for single, joint in zip(alone, together, strict=True):
        assert joint.token_ids == single.token_ids
        assert joint.nfe == single.nfe
        assert joint.error is None


def test_a_conversation_that_continues_an_answer_reuses_its_encoded_canvases(folder: Path) -> None:
    """A 13-token prompt answered with three canvases leaves its prompt and first two canvases (45 positions, the
    third is never encoded) in its pages; a follow-up whose prompt is that prompt and answer finds the two full
    pages (32 positions: prompt and canvas K/V) and answers as it does without prefix caching."""
    first = prompts(2)[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, seed=1, ignore_eos=True)
    with engine(folder) as llm:
        answer = llm.generate([first], greedy, use_tqdm=False).trajectories[0].token_ids
        follow_up = [*first, *answer, 7, 8, 9]
        params = SamplingParams(temperature=0.0, max_tokens=20, seed=2, ignore_eos=True)
        (traj,), (req,) = run_requests(llm, [follow_up], [params])
    with engine(folder, enable_prefix_caching=False) as llm:
        expected = llm.generate([follow_up], params, use_tqdm=False).trajectories[0]
    assert req.prefix_hit_len == 32
    assert traj.token_ids == expected.token_ids


def test_the_batched_canvas_rule_gives_the_tokens_of_the_rule_run_per_request(folder: Path) -> None:
    """Six requests in one engine, greedy and sampled at several temperatures and seeds, of different budgets (so
    their canvases are at different steps), some canvases settling before the schedule ends beside ones that do not,
    three prompts finding the first page of an earlier request's in the prefix cache: every answer and step count
    equals that of the same engine whose step runs the canvas rule request by request (`per_request_launch`)."""
    batch = prompts(6)
    batch[0] = list(batch[3])  # 21 tokens: one full page of 16
    batch[1] = batch[3][:16] + batch[1]
    temperatures = [0.0, 0.6, 1.0, 0.02, 1.3, 0.0]
    params = [
        SamplingParams(temperature=t, max_tokens=m, seed=20 + i, ignore_eos=True)
        for i, (t, m) in enumerate(zip(temperatures, [40, 24, 33, 16, 48, 20], strict=True))
    ]
    results = []
    for per_request in (False, True):
        with engine(folder) as llm:
            if per_request:
                llm.runner.launch = types.MethodType(per_request_launch, llm.runner)
            llm.generate([batch[3]], SamplingParams(max_tokens=8, seed=99), use_tqdm=False)  # leaves its first page
            results.append(run_requests(llm, batch, params))
    (batched, requests), (reference, _) = results
    assert [req.prefix_hit_len for req in requests[:2]] == [16, 16]
    for ours, theirs in zip(batched, reference, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert ours.nfe == theirs.nfe
        assert ours.error is None
    steps = [req.nfe / req.canvases_done for req in requests]
    assert min(steps) < STEPS and max(steps) == STEPS  # canvases that settled early beside ones that ran it all


def test_a_step_reads_nothing_on_the_host_until_it_is_applied(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The canvas rule of a step and the copy of its outcome read no tensor on the host (no ``item``, ``tolist``,
    ``bool``, ``torch.equal``, ``torch.multinomial``): the host queues the whole step and waits once, when the
    engine applies it. Greedy and sampled canvases, at steps with and without a full stability history."""
    read = []

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host during the step's launch")

    def refusing(method):
        def wrapper(*args, **kwargs):
            with pytest.MonkeyPatch.context() as guard:
                for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
                    guard.setattr(torch.Tensor, name, refuse)
                guard.setattr(torch, "equal", refuse)
                guard.setattr(torch, "multinomial", refuse)
                read.append(method.__name__)
                return method(*args, **kwargs)

        return wrapper

    params = [SamplingParams(temperature=t, max_tokens=32, seed=3, ignore_eos=True) for t in (0.0, 1.0, 0.02)]
    with engine(folder) as llm:
        expected = run_requests(llm, prompts(3), params)[0]
        scale = llm.runner.model._embed_scale(torch.float32)  # a host constant the model makes from a host tensor
        monkeypatch.setattr(llm.runner.model, "_embed_scale", lambda dtype: scale)
        monkeypatch.setattr(llm.runner, "_rule", refusing(llm.runner._rule))
        monkeypatch.setattr(PendingCanvases, "launch", classmethod(refusing(PendingCanvases.launch.__func__)))
        got = run_requests(llm, prompts(3), params)[0]
    assert {"_rule", "launch"} <= set(read)
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]


def test_sampled_canvases_follow_the_request_seed(folder: Path) -> None:
    """At temperature > 0 a request's answer depends on its seed only: the same seed gives the same answer in
    another batch, another seed (almost surely) another answer."""
    prompt = prompts(1)[0]
    with engine(folder) as llm:
        first = llm.generate([prompt, prompt], [SamplingParams(max_tokens=32, seed=1, ignore_eos=True),
                                                 SamplingParams(max_tokens=32, seed=2, ignore_eos=True)],
                             use_tqdm=False).trajectories  # fmt: skip
        again = llm.generate([prompt], SamplingParams(max_tokens=32, seed=1, ignore_eos=True), use_tqdm=False)
    assert again.trajectories[0].token_ids == first[0].token_ids
    assert first[0].token_ids != first[1].token_ids


def test_a_greedy_answer_without_a_seed_depends_on_its_prompt_alone(folder: Path) -> None:
    """A greedy canvas still starts from noise; without a seed of its own every greedy request takes the engine's
    seed, so the same prompt gets the same answer in another call and at another place in a batch."""
    prompt, other = prompts(2)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with engine(folder) as llm:
        first = llm.generate([other, prompt], greedy, use_tqdm=False).trajectories[1]
        again = llm.generate([prompt], greedy, use_tqdm=False).trajectories[0]
    assert again.token_ids == first.token_ids


def test_abort_and_a_bad_request_leave_the_others_untouched(folder: Path, model, tmp_path: Path) -> None:
    """A request aborted mid-canvas is gone at once; one whose prompt holds the image placeholder (text only is
    supported) fails alone, with a message that says so; the third still answers as the reference does."""
    copy = tmp_path / "image-id-in-vocabulary"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["image_token_id"] = image = 299  # the real id is past the tiny vocabulary; prompts draw below it
    (copy / "config.json").write_text(json.dumps(config))
    good, other = prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=32, seed=9, ignore_eos=True)
    finished = {}
    with engine(copy) as llm:
        keep = llm.add_request(good, params)
        drop = llm.add_request(other, params)
        bad = llm.add_request([*other[:3], image, *other[3:]], params)
        for step in range(200):
            if llm.is_finished():
                break
            finished.update({u.req_id: u.trajectory for u in llm.step() if u.finished})
            if step == 2:
                assert llm.abort_request(drop)
                assert drop not in {r.req_id for r in (*llm.scheduler.running, *llm.scheduler.waiting)}
        expected, _ = reference_answer_ignoring_stops(llm, model, good, params)
    assert finished[keep].token_ids == expected
    assert drop not in finished
    assert finished[bad].completion_reason == "error"
    assert "image_token_id" in finished[bad].error


def test_a_canvas_without_a_distribution_fails_its_request_alone(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled request whose logits turn non-finite (injected into its canvas's rows, found by its seed) fails
    with a message that says so, when its step is read; the requests of the same steps answer as they do without
    it."""
    bad_seed = 666
    params = [SamplingParams(temperature=t, max_tokens=24, seed=s, ignore_eos=True) for t, s in
              ((1.0, 1), (1.0, bad_seed), (0.0, 2))]  # fmt: skip
    batch = prompts(3)
    with engine(folder) as llm:
        expected = run_requests(llm, [batch[0], batch[2]], [params[0], params[2]])[0]
        rule = llm.runner._rule

        def poisoned(logits, states, temperatures, seeds):
            for b, seed in enumerate(seeds):
                if seed == bad_seed:
                    logits[b, 0, 0] = float("nan")
            return rule(logits, states, temperatures, seeds)

        monkeypatch.setattr(llm.runner, "_rule", poisoned)
        got = run_requests(llm, batch, params)[0]
    assert got[1].completion_reason == "error" and "no distribution to draw from" in got[1].error
    assert [got[0].token_ids, got[2].token_ids] == [t.token_ids for t in expected]
    assert got[0].error is None and got[2].error is None


def test_top_p_and_top_k_are_refused_by_name(folder: Path) -> None:
    """The canvas sampler has no top-p/top-k: such a request is refused when added, naming the field, and the
    engine serves the next one."""
    with engine(folder) as llm:
        assert (llm.config.model_name, llm.config.decoding_strategy) == ("diffusion_gemma", "diffusion_gemma")
        for bad in (SamplingParams(top_p=0.9), SamplingParams(top_k=5)):
            with pytest.raises(ValueError, match="top_p=0.9 is not supported|top_k=5 is not supported"):
                llm.add_request(prompts(1)[0], bad)
        out = llm.generate([prompts(1)[0]], SamplingParams(temperature=0.0, max_tokens=8, seed=1), use_tqdm=False)
        assert out.trajectories[0].error is None and len(out.trajectories[0].token_ids) <= 8
