"""An engine split over two tensor-parallel ranks (the engine's process and one spawned worker, gloo on the CPU)
generates exactly the tokens of the same engine on one rank, in float32, through batching, preemption and a
prefix-cache hit; its worker is ended on exit, and a worker that dies fails the engine with an error naming it.

Each rank holds half of every attention head group, MLP and vocabulary, so a slice taken from the wrong rows, a
missing all-reduce or a worker running a different step than rank 0 changes the tokens (or hangs: every build has
a short collective timeout).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.errors import EngineDeadError
from diffulex.models.family import FAMILIES, register_family
from diffulex.strategy.diffusion_gemma import DiffusionGemma
from diffulex.testing.checkpoints import (
    write_tiny_checkpoint,
    write_tiny_diffusion_gemma_checkpoint,
    write_tiny_lora_adapter,
)
from diffulex.testing.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
TIMEOUT_S = 120  # any collective left waiting by a bug fails the test instead of hanging it
REAP_WAIT_S = 30.0


def make_engine(model_dir: Path, model_name: str, tensor_parallel_size: int, **overrides) -> Diffulex:
    fields = dict(
        model_name=model_name, decoding_strategy="multi_bd", block_size=4, page_size=8, buffer_size=2,
        max_model_len=64, max_num_batched_tokens=512, max_num_reqs=8, accept_threshold=0.8, dtype="float32",
        enable_prefix_caching=True, tensor_parallel_size=tensor_parallel_size, master_addr="127.0.0.1",
        master_port=free_port(), distributed_timeout_seconds=TIMEOUT_S,
    )  # fmt: skip
    fields.update(overrides)
    return Diffulex(str(model_dir), **fields)


def random_prompts(llm: Diffulex, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    banned = set(llm.settings.stop_token_ids) | {llm.mask_token_id}
    allowed = [t for t in range(llm.vocab_limit) if t not in banned]
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


@dataclass
class Run:
    """What a scenario generated, per request: tokens, NFE, tokens per step, preemptions."""

    batch: list[tuple]
    follow_up: tuple
    follow_up_cached: int  # more prompt tokens than the follow-up's first step computed: its cached prefix
    preemptions: int


def describe(trajectory) -> tuple:
    return (
        trajectory.token_ids, trajectory.completion_reason, trajectory.nfe,
        [s.num_new_tokens for s in trajectory.steps], trajectory.num_preemptions,
    )  # fmt: skip


def run_scenario(model_dir: Path, model_name: str, tensor_parallel_size: int, **overrides) -> Run:
    """A prompt, then one that repeats its prompt and answer and so reuses its cached pages, then eight requests
    over 10 pages of 8 tokens, some of which are preempted and rebuilt."""
    with make_engine(model_dir, model_name, tensor_parallel_size, num_pages=10, **overrides) as llm:
        first, *prompts = random_prompts(llm, [16, 3, 6, 9, 12, 14, 5, 7, 2], seed=8)
        (done,) = llm.generate([first], GREEDY, use_tqdm=False).trajectories
        follow_up = first + done.token_ids[:8] + first[:3]
        (again,) = llm.generate([follow_up], GREEDY, use_tqdm=False).trajectories
        batch = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False).trajectories
    return Run(
        [describe(done), *(describe(t) for t in batch)], describe(again), len(follow_up) - again.steps[0].query_len,
        sum(t.num_preemptions for t in batch),
    )  # fmt: skip


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SDAR (the dense decoder every dense family shares), 4 query and 2 K/V heads: one K/V head per rank."""
    path = tmp_path_factory.mktemp("tp") / "sdar"
    return write_tiny_checkpoint(path, "sdar", seed=1, init_std=1.0, num_key_value_heads=2)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SDAR-MoE with one K/V head, which both ranks then hold whole (replicated)."""
    path = tmp_path_factory.mktemp("tp") / "sdar_moe"
    return write_tiny_checkpoint(path, "sdar_moe", seed=1, init_std=1.0, num_key_value_heads=1)


@pytest.mark.parametrize(("fixture", "model_name"), [("dense_dir", "sdar"), ("moe_dir", "sdar_moe")])
def test_two_ranks_generate_the_tokens_of_one_with_preemption_and_a_prefix_hit(request, fixture, model_name):
    model_dir = request.getfixturevalue(fixture)
    one = run_scenario(model_dir, model_name, 1)
    assert one.preemptions > 0, "the scenario must preempt"
    assert one.follow_up_cached >= 16, "the follow-up must hit the prefix cache"
    two = run_scenario(model_dir, model_name, 2)
    assert two == one


@pytest.mark.parametrize("family", ["llada", "llada2"])
def test_families_with_their_own_layers_split_over_two_ranks(tmp_path: Path, family: str) -> None:
    """LLaDA names its blocks and config fields its own way; LLaDA2 fuses q/k/v in one matrix (each part split on
    its own) and adds a shared expert to the routed ones."""
    model_dir = write_tiny_checkpoint(tmp_path / family, family, seed=1, init_std=1.0, num_key_value_heads=2)
    outputs = {}
    for size in (1, 2):
        with make_engine(model_dir, family, size) as llm:
            prompts = random_prompts(llm, [5, 11, 3], seed=3)
            outputs[size] = [describe(t) for t in llm.generate(prompts, GREEDY, use_tqdm=False).trajectories]
    assert outputs[2] == outputs[1]


def generated(model_dir: Path, model_name: str, tensor_parallel_size: int, **overrides) -> list[tuple]:
    """Three prompts' answers (greedy), with their NFE and steps."""
    with make_engine(model_dir, model_name, tensor_parallel_size, **overrides) as llm:
        prompts = random_prompts(llm, [5, 11, 3], seed=3)
        return [describe(t) for t in llm.generate(prompts, GREEDY, use_tqdm=False).trajectories]


@pytest.mark.parametrize("merged", [False, True])
def test_a_lora_adapter_over_two_ranks_gives_the_tokens_of_one(dense_dir: Path, tmp_path: Path, merged: bool) -> None:
    """Each rank keeps its rows of B where its layer holds output features (q/k/v, gate/up) and its columns of A
    where it holds input features (o, down: a partial delta, summed over the ranks like the layer's product);
    added at every forward or merged into the rank's weights."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = write_tiny_lora_adapter(tmp_path / "lora", dense_dir, "sdar", targets=targets, init_std=1.0)
    lora = dict(use_lora=True, lora_path=str(adapter), pre_merge_lora=merged)
    one = generated(dense_dir, "sdar", 1, **lora)
    assert one != generated(dense_dir, "sdar", 1), "the adapter must change the answers"
    assert generated(dense_dir, "sdar", 2, **lora) == one


def diffusion_gemma_scenario(model_dir: Path, tensor_parallel_size: int, expert_parallel_size: int) -> Run:
    """A sampled prompt, whose steps are continued on the device (each continuation's decoder pass announced to
    the workers as any pass); one that repeats it and its first canvas (a prefix-cache hit); then three requests,
    one sampled (self-conditioned on its softmax, which rank 0 makes and the workers receive), over 5 pages of 16
    positions, which preempts one of them."""
    with Diffulex(
        str(model_dir), tensor_parallel_size=tensor_parallel_size, expert_parallel_size=expert_parallel_size,
        dtype="float32", max_model_len=96, num_pages=5, seed=3, master_addr="127.0.0.1", master_port=free_port(),
        distributed_timeout_seconds=TIMEOUT_S,
    ) as llm:  # fmt: skip
        first = list(range(5, 22))
        (done,) = llm.generate([first], SamplingParams(temperature=1.0, max_tokens=32, seed=5),
                               use_tqdm=False).trajectories  # fmt: skip
        assert llm.num_continuations > 0 and llm.num_dropped_continuations == 0
        follow_up = first + done.token_ids[:16]
        greedy = SamplingParams(temperature=0.0, max_tokens=16)
        (again,) = llm.generate([follow_up], greedy, use_tqdm=False).trajectories
        params = [SamplingParams(temperature=t, max_tokens=48, seed=7) for t in (0.0, 1.0, 0.0)]
        prompts = [list(range(30, 30 + n)) for n in (3, 9, 20)]
        batch = llm.generate(prompts, params, use_tqdm=False).trajectories
        canvas = llm.settings.block_size
    # a canvas's first step computes the prompt's uncached rows and the canvas
    cached = len(follow_up) + canvas - again.steps[0].query_len
    return Run([describe(done), *(describe(t) for t in batch)], describe(again), cached,
               sum(t.num_preemptions for t in batch))  # fmt: skip


@pytest.fixture(scope="module")
def diffusion_gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query heads, 2 K/V heads in the sliding layers and 1 in the global ones (replicated at TP=2), 4 experts."""
    return write_tiny_diffusion_gemma_checkpoint(tmp_path_factory.mktemp("tp") / "dgemma", layer_output_scale=0.3)


@pytest.fixture(scope="module")
def diffusion_gemma_one_rank(diffusion_gemma_dir: Path) -> Run:
    run = diffusion_gemma_scenario(diffusion_gemma_dir, 1, 1)
    assert run.preemptions > 0, "the scenario must preempt"
    assert run.follow_up_cached >= 16, "the follow-up must hit the prefix cache"
    return run


@pytest.mark.parametrize(("tensor_parallel_size", "expert_parallel_size"), [(2, 1), (1, 2), (2, 2)])
def test_diffusion_gemma_over_two_ranks_generates_the_tokens_of_one(
    diffusion_gemma_dir: Path, diffusion_gemma_one_rank: Run, tensor_parallel_size: int, expert_parallel_size: int
) -> None:
    """DiffusionGemma's own runner: the workers repeat its encoder and decoder passes on their shards (heads, MLP
    width, experts), while rank 0 alone runs the LM head and the canvas rule over the whole vocabulary."""
    run = diffusion_gemma_scenario(diffusion_gemma_dir, tensor_parallel_size, expert_parallel_size)
    assert run == diffusion_gemma_one_rank


@pytest.mark.parametrize("buffer_size", [1, 2])
def test_graph_path_steps_and_their_continuations_follow_on_the_worker(dense_dir: Path, buffer_size: int) -> None:
    """The decode graphs' padded path (uncaptured on the CPU), with its in-graph greedy sampler and steps continued
    on the device (at buffer 2 also blocks moved on there): the worker replays each of them as rank 0 does
    (`MessageKind.GRAPH`, `CONTINUATION`)."""
    results = {}
    for size in (1, 2):
        with make_engine(dense_dir, "sdar", size, buffer_size=buffer_size) as llm:
            llm.enable_static_decode(capture=False)
            prompts = random_prompts(llm, [4, 9, 13], seed=5)
            trajectories = llm.generate(prompts, GREEDY, use_tqdm=False).trajectories
            results[size] = ([describe(t) for t in trajectories], llm.num_continuations)
    assert results[1][1] > 0, "the scenario must continue steps on the device"
    assert results[2] == results[1]


def test_fast_dllm_v2_refinements_continued_in_the_short_graphs_follow_on_the_worker(tmp_path: Path) -> None:
    """Fast-dLLM v2's lone refinements replay the short graphs and are continued there: the worker replays each
    continuation in the same graphs as rank 0 (`StepMessage.graph_set`)."""
    model_dir = write_tiny_checkpoint(tmp_path / "fdv2", "fast_dllm_v2", seed=1, init_std=1.0, num_key_value_heads=2)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    results = {}
    for size in (1, 2):
        with make_engine(model_dir, "fast_dllm_v2", size, decoding_strategy="fast_dllm_v2", block_size=8,
                         buffer_size=4, page_size=32, max_model_len=96, accept_threshold=1.0) as llm:  # fmt: skip
            llm.enable_static_decode(capture=False)
            (trajectory,) = llm.generate(random_prompts(llm, [7], seed=3), params, use_tqdm=False).trajectories
            results[size] = (describe(trajectory), llm.num_continuations)
    assert results[1][1] > 0, "the scenario must continue refinements on the device"
    assert results[2] == results[1]


def arrivals_counting_replays(dense_dir: Path, graphs: str) -> dict[int, tuple]:
    """At TP=1 and TP=2 (uncaptured graph path, chunked prefill), five prompts arriving two steps apart: the tokens,
    the replays of the runner's ``graphs`` ("prefill_graphs" or "chunk_graphs"; with the former the chunk graphs
    are put aside, so that every step carrying a prompt splits) and the eager steps, by TP size."""
    from diffulex.testing.arrivals import serve_arrivals

    results = {}
    for size in (1, 2):
        with make_engine(dense_dir, "sdar", size, buffer_size=1, num_pages=40, enable_chunked_prefill=True,
                         max_num_batched_tokens=24) as llm:
            llm.enable_static_decode(capture=False)
            if graphs == "prefill_graphs":
                llm.runner.chunk_graphs = None
            runs = []
            run = getattr(llm.runner, graphs).run

            def counted(*args, run=run, runs=runs):
                runs.append(args[1])
                return run(*args)

            getattr(llm.runner, graphs).run = counted
            prompts = random_prompts(llm, [40, 6, 13, 9, 21], seed=6)
            tokens = serve_arrivals(llm, prompts, GREEDY, gap=2)
            results[size] = (tokens, len(runs), llm.runner.eager_steps)
    return results


def test_prompts_arriving_while_others_decode_replay_prefill_graphs_on_the_worker_too(dense_dir: Path) -> None:
    """A step carrying a prompt on the graph path: the prompt's store-only rows replay a prefill graph, then the
    decode graph replays the rest (`StepMessage.prefills`); the worker repeats both in that order, or its half of
    the prompt's K/V would be missing (other tokens) or its collectives would not match rank 0's (a time-out).
    The first prompt, alone and chunked, has steps of prefill replays only. (Rank 0's chunk graphs are put aside,
    so that every such step splits; the next test replays them.)"""
    results = arrivals_counting_replays(dense_dir, "prefill_graphs")
    assert results[1][1] >= 4, "the prompts must replay prefill graphs"
    assert results[1][2] == 0
    assert results[2] == results[1]


def test_a_lone_prompt_sampled_in_its_prefill_replay_follows_on_the_worker(dense_dir: Path) -> None:
    """A request alone: the smallest prefill bucket that holds its prompt and first block replays over the whole
    step and the block's rows are sampled after it (`ModelRunner._lone_prompt_plan`; a bucket holds 32 prompt rows and
    a block's 4, so the 21- and the 32-token prompt take the same one); the worker replays the same bucket and joins
    the LM head's gather (else the step would time out), with TP=1's tokens. (The chunk graphs, which take a prompt
    this short whole, are put aside.)"""
    results = {}
    for size in (1, 2):
        with make_engine(dense_dir, "sdar", size, buffer_size=1) as llm:
            llm.enable_static_decode(capture=False)
            llm.runner.chunk_graphs = None
            sampled_in_prefill = []
            run = llm.runner.prefill_graphs.run

            def counted(part, rows, run=run, sampled_in_prefill=sampled_in_prefill):
                sampled_in_prefill.append((bool(part.sample_rows), rows))
                return run(part, rows)

            llm.runner.prefill_graphs.run = counted
            tokens = []
            for length in (21, 32):
                prompts = random_prompts(llm, [length], seed=length)
                tokens += [t.token_ids for t in llm.generate(prompts, GREEDY, use_tqdm=False).trajectories]
            results[size] = (tokens, sampled_in_prefill, llm.runner.eager_steps)
    assert results[1][1] == [(True, 36), (True, 36)], "each prompt and its block in one prefill replay"
    assert results[1][2] == 0
    assert results[2] == results[1]


def test_prompts_beside_decoders_replay_the_chunk_graphs_on_the_worker_too(dense_dir: Path) -> None:
    """A step whose prompt rides with the decoders in one chunk-graph forward (`StepMessage.graph_set`): the worker
    replays its own chunk graphs, with TP=1's tokens (its collectives match rank 0's, or the step would time out)."""
    results = arrivals_counting_replays(dense_dir, "chunk_graphs")
    assert results[1][1] >= 3, "prompts beside decoders must replay the chunk graphs"
    assert results[1][2] == 0
    assert results[2] == results[1]


def test_decode_steps_continued_on_the_straggler_graphs_follow_on_the_worker(dense_dir: Path, monkeypatch) -> None:
    """Decode steps among a context that stands out replay the straggler graphs and are continued there: the worker
    replays each step and continuation in its own straggler graphs (`StepMessage.graph_set`), with TP=1's tokens.
    Both ranks build those graphs at this model length; the length that counts as long is lowered to the tiny
    model's scale on rank 0, which alone decides where a step runs."""
    import diffulex.engine.prefill_graphs as prefill_graphs

    max_model_len = prefill_graphs.CHUNK_CONTEXT_MIN_KEYS  # a context may stand out: the worker builds them too
    monkeypatch.setattr(prefill_graphs, "CHUNK_CONTEXT_MIN_KEYS", 64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for size in (1, 2):
        with make_engine(dense_dir, "sdar", size, buffer_size=1, accept_threshold=1.0, max_model_len=max_model_len,
                         max_num_batched_tokens=max_model_len, max_num_reqs=12) as llm:  # fmt: skip
            llm.enable_static_decode(capture=False)
            straggler, continued = llm.runner.straggler_graphs, []
            replay = straggler.replay_continuation
            straggler.replay_continuation = lambda *args, replay=replay, seen=continued: (seen.append(args)
                                                                                        or replay(*args))  # fmt: skip
            prompts = random_prompts(llm, [250] + [4] * 8, seed=9)
            trajectories = llm.generate(prompts, params, use_tqdm=False).trajectories
            results[size] = ([describe(t) for t in trajectories], len(continued))
    assert results[1][1] >= 5, "the scenario must continue steps on the straggler graphs"
    assert results[2] == results[1]


def test_each_step_reaches_the_worker_in_one_broadcast(dense_dir: Path, monkeypatch) -> None:
    """Rank 0 talks to the worker once per launched step, whatever the batch: no per-request conversation."""
    import torch.distributed as dist

    with make_engine(dense_dir, "sdar", 2) as llm:
        broadcasts = []
        real = dist.broadcast

        def counted(tensor, *args, **kwargs):
            broadcasts.append(tensor.numel())
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, "broadcast", counted)
        launches = llm._num_launches
        prompts = random_prompts(llm, [5, 9, 3, 12], seed=2)
        llm.generate(prompts, GREEDY, use_tqdm=False)
        steps = llm._num_launches - launches
        assert steps > len(prompts)
        assert len(broadcasts) == steps


@pytest.mark.parametrize(
    ("geometry", "size", "field"),
    [
        (dict(num_attention_heads=4, num_key_value_heads=2), 3, "num_attention_heads=4"),
        (dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48), 2, "num_key_value_heads=3"),
        (dict(num_attention_heads=4, intermediate_size=90), 4, "intermediate_size=90"),
    ],
)
def test_a_model_that_does_not_split_over_the_ranks_is_refused_naming_the_field(tmp_path, geometry, size, field):
    model_dir = write_tiny_checkpoint(tmp_path / "odd", "sdar", **geometry)
    with pytest.raises(ValueError, match=f"{field} .*tensor_parallel_size={size}"):
        make_engine(model_dir, "sdar", size)


def test_a_family_that_runs_on_one_device_is_refused_by_name(dense_dir: Path) -> None:
    """A family registered without split layers (a plugin's, say): refused before any worker starts."""
    name = "sdar_on_one_device"
    if name not in FAMILIES:
        register_family(dataclasses.replace(FAMILIES.get("sdar").renamed(name), tensor_parallel=False))
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 is invalid for model_name='{name}'"):
        make_engine(dense_dir, name, 2)


def test_diffusion_gemma_global_kv_heads_that_do_not_split_are_refused_by_name(tmp_path: Path) -> None:
    """The global layers count their K/V heads in a field of their own, which the error names."""
    model_dir = write_tiny_diffusion_gemma_checkpoint(
        tmp_path / "dgemma", num_attention_heads=6, num_key_value_heads=6, num_global_key_value_heads=3
    )
    with pytest.raises(ValueError, match="num_global_key_value_heads=3 is invalid for tensor_parallel_size=2"):
        Diffulex(str(model_dir), tensor_parallel_size=2)


def test_a_runner_that_does_not_follow_rank_0_is_refused_by_name(diffusion_gemma_dir: Path, monkeypatch) -> None:
    """A strategy whose own runner cannot repeat rank 0's passes on the workers (``runner_follows_ranks`` off)."""
    monkeypatch.setattr(DiffusionGemma, "runner_follows_ranks", False)
    with pytest.raises(ValueError, match="expert_parallel_size=2 is invalid with decoding_strategy='diffusion_gemma'"):
        Diffulex(str(diffusion_gemma_dir), expert_parallel_size=2)


@pytest.mark.parametrize("static", [False, True])
def test_dmax_token_merge_over_two_ranks_gives_the_tokens_of_one(tmp_path: Path, static: bool) -> None:
    """DMax's soft inputs mix rows of the embedding, which each rank holds a slice of: every rank looks the
    candidates up through its sharded embedding (the ranks' rows summed). Eagerly (the soft rows travel in the step's
    message) and on the graph path (uncaptured on the CPU), whose steps continued on the device write the next soft
    inputs from the sampler every rank runs on the gathered logits."""
    model_dir = write_tiny_checkpoint(tmp_path / "llada2", "llada2", seed=1, init_std=1.0, num_key_value_heads=2)
    results = {}
    for size, weight in ((1, 0.5), (2, 0.5), (1, 0.0)):
        dmax = dict(decoding_strategy="dmax", sampling_mode="edit", token_merge_weight=weight, buffer_size=1)
        with make_engine(model_dir, "llada2", size, **dmax) as llm:
            if static:
                llm.enable_static_decode(capture=False)
            prompts = random_prompts(llm, [5, 11, 3], seed=3)
            trajectories = llm.generate(prompts, GREEDY, use_tqdm=False).trajectories
            results[size, weight] = ([describe(t) for t in trajectories], llm.num_continuations)
    assert results[1, 0.5][0] != results[1, 0.0][0], "the soft inputs must change the answers"
    assert results[2, 0.5] == results[1, 0.5]
    if static:
        assert results[1, 0.5][1] > 0, "the scenario must continue steps on the device"


def test_exit_ends_the_worker_and_a_second_engine_can_split_again(dense_dir: Path) -> None:
    llm = make_engine(dense_dir, "sdar", 2)
    (pid,) = llm.workers.pids
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm.exit()
    assert not pid_alive(pid)
    with make_engine(dense_dir, "sdar", 2) as again:  # the process left its group: it can join a new one
        assert again.generate([[5, 6, 7]], GREEDY, use_tqdm=False).trajectories[0].token_ids


def test_an_engine_beside_an_open_split_one_is_refused_at_once_and_the_open_one_serves_on(dense_dir: Path) -> None:
    """The engine's process is rank 0 of its group, which every layer built in that process would join: a second
    engine there (split or not) is refused naming the field, instead of running a worker's build inside the open
    engine's group (a collective its worker never joins: a hang until the timeout, and the open engine killed)."""
    timeout = 20
    with make_engine(dense_dir, "sdar", 2, distributed_timeout_seconds=timeout) as llm:
        prompts = random_prompts(llm, [5, 3], seed=4)
        before = [describe(t) for t in llm.generate(prompts, GREEDY, use_tqdm=False).trajectories]
        started = time.monotonic()
        for size in (2, 1):
            with pytest.raises(ValueError, match=f"tensor_parallel_size={size} is invalid here: .*exit\\(\\) that"):
                make_engine(dense_dir, "sdar", size, distributed_timeout_seconds=timeout)
        assert time.monotonic() - started < timeout / 2, "refused at once, not after the collective timeout"
        assert [describe(t) for t in llm.generate(prompts, GREEDY, use_tqdm=False).trajectories] == before


def test_a_worker_that_dies_fails_the_engine_with_an_error_naming_it(dense_dir: Path) -> None:
    llm = make_engine(dense_dir, "sdar", 2)
    (pid,) = llm.workers.pids
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="tensor-parallel worker rank 1"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < TIMEOUT_S / 2, "found by the liveness check, not the collective timeout"
    llm.exit()


class Unloadable:
    """Pickles, but fails to load: a worker process handed one dies before it joins the group."""

    def __reduce__(self):
        return (fail_to_load, ())


def fail_to_load():
    raise RuntimeError("this object cannot be loaded")


def test_a_worker_that_dies_before_joining_fails_the_start_at_once(dense_dir: Path) -> None:
    from diffulex.config import Config
    from diffulex.engine.assembly import assemble
    from diffulex.engine.tensor_parallel import WorkerDiedError, start_tensor_parallel

    config = Config(str(dense_dir), model_name="sdar", tensor_parallel_size=2, master_addr="127.0.0.1",
                    master_port=free_port(), distributed_timeout_seconds=TIMEOUT_S)  # fmt: skip
    config.unloadable = Unloadable()
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 exited with code 1"):
        start_tensor_parallel(config, assemble)
    assert time.monotonic() - started < TIMEOUT_S / 2, "found by watching the worker, not the rendezvous timeout"


@pytest.mark.parametrize(
    ("fixture", "broken_part"), [("dense_dir", "_eager_forward"), ("diffusion_gemma_dir", "_decode")]
)
def test_a_step_failing_on_rank_0_after_the_broadcast_fails_the_engine_and_ends_the_worker(
    request, fixture: str, broken_part: str
) -> None:
    """The worker already runs the step and waits in its collectives: the ranks cannot go on in step. The engine's
    runner and a strategy's own (DiffusionGemma's decoder pass) alike."""
    model_dir = request.getfixturevalue(fixture)
    if fixture == "dense_dir":
        llm = make_engine(model_dir, "sdar", 2)
    else:
        llm = Diffulex(
            str(model_dir), tensor_parallel_size=2, dtype="float32", max_model_len=96, master_addr="127.0.0.1",
            master_port=free_port(), distributed_timeout_seconds=TIMEOUT_S,
        )  # fmt: skip
    (pid,) = llm.workers.pids

    def broken(*args):
        raise RuntimeError("injected failure")

    setattr(llm.runner, broken_part, broken)
    with pytest.raises(EngineDeadError, match="injected failure.*out of step"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert not pid_alive(pid)
    llm.exit()


def test_a_sampling_failure_on_rank_0_fails_only_its_request_and_the_ranks_serve_on(dense_dir: Path, monkeypatch):
    """Rank 0 samples after the step's last collective (the LM head's gather): a request that cannot be drawn from
    fails alone, as at one rank, and the worker is kept: the next call gets the tokens of an untouched engine."""
    import diffulex.sampler.rows as rows

    real_sample = rows.sample

    def failing(logits, temperature, *args):
        if temperature > 0:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_sample(logits, temperature, *args)

    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    with make_engine(dense_dir, "sdar", 2) as llm:
        (pid,) = llm.workers.pids
        before = [describe(t) for t in llm.generate(prompts, GREEDY, use_tqdm=False).trajectories]
        monkeypatch.setattr(rows, "sample", failing)
        params = [GREEDY, SamplingParams(temperature=1.0, seed=3, max_tokens=24)]
        greedy, sampled = llm.generate(prompts, params, use_tqdm=False).trajectories
        monkeypatch.setattr(rows, "sample", real_sample)
        assert (sampled.completion_reason, greedy.error) == ("error", None)
        assert "sampling failed for request" in sampled.error
        assert describe(greedy) == before[0]
        assert pid_alive(pid)
        assert [describe(t) for t in llm.generate(prompts, GREEDY, use_tqdm=False).trajectories] == before


def test_an_interrupt_inside_a_step_fails_the_engine_at_once_instead_of_hanging_the_next_step(dense_dir: Path) -> None:
    """Ctrl-C while rank 0 runs a step the worker already received: the worker waits in a collective rank 0 never
    joins, so the next step's collectives would pair with it (a hang until the timeout). The interrupt reaches the
    caller; the worker is ended and every later call raises EngineDeadError at once."""
    from diffulex.layers.linear import RowParallelLinear

    timeout = 30
    llm = make_engine(dense_dir, "sdar", 2, distributed_timeout_seconds=timeout)
    (pid,) = llm.workers.pids
    real, calls = RowParallelLinear.forward, []

    def interrupted(self, *args, **kwargs):  # rank 0's second all-reduced projection: the worker joined the first
        calls.append(None)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    RowParallelLinear.forward = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        RowParallelLinear.forward = real
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="interrupted.*out of step"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < timeout / 2, "refused at once, not after the collective timeout"
    assert not pid_alive(pid)
    llm.exit()


@pytest.mark.parametrize("ending", ["killed", "returns without exit()"])
def test_no_worker_outlives_its_engine_process(dense_dir: Path, ending: str) -> None:
    """No orphan: a worker whose rank 0 vanished (SIGKILL) sees its channel break and exits; a program that ends
    without calling exit() ends its worker on the way out (and is not kept waiting for it)."""
    script = textwrap.dedent(
        f"""
        import time
        from tests.engine.test_tensor_parallel_engine import make_engine
        from pathlib import Path

        if __name__ == "__main__":
            llm = make_engine(Path({str(dense_dir)!r}), "sdar", 2)
            print("WORKER", llm.workers.pids[0], flush=True)
            if {ending == "killed"}:
                time.sleep(600)
        """
    )
    engine = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    try:
        line = engine.stdout.readline()
        assert line.startswith("WORKER"), line
        pid = int(line.split()[1])
        if ending == "killed":
            engine.kill()
        engine.wait(timeout=REAP_WAIT_S)
        deadline = time.monotonic() + REAP_WAIT_S
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not pid_alive(pid), "the worker outlived its engine"
    finally:
        engine.kill()


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie awaiting its parent counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
