"""An engine whose routed experts are split over two ranks (the engine's process and one spawned worker, gloo on the
CPU) generates exactly the tokens of the same engine on one rank, in float32, through batching, preemption and a
prefix-cache hit: with the attention replicated (``tensor_parallel_size=1``) and with the attention split over the
same two ranks (``tensor_parallel_size=2``). Layouts the engine cannot run are refused before any worker starts,
naming the field.

Each rank holds half of each layer's experts and adds the other half's contribution by an all-reduce, so a rank
running another rank's experts, an expert loaded on the wrong rank or a worker missing a step changes the tokens
(or hangs: every build has a short collective timeout).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from diffulex.models.family import FAMILIES, register_family
from diffulex.testing.checkpoints import write_tiny_checkpoint, write_tiny_lora_adapter
from tests.engine.test_tensor_parallel_engine import (
    GREEDY,
    Run,
    describe,
    generated,
    make_engine,
    random_prompts,
    run_scenario,
)

EXPERTS = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SDAR-MoE (softmax router) and LLaDA2 (group-limited router, a shared expert beside the routed ones)."""
    root = tmp_path_factory.mktemp("ep")
    return {
        family: write_tiny_checkpoint(root / family, family, seed=1, init_std=1.0, num_key_value_heads=2,
                                      num_experts=EXPERTS)  # fmt: skip
        for family in ("sdar_moe", "llada2")
    }


@pytest.fixture(scope="module")
def one_rank(checkpoints: dict[str, Path]) -> dict[str, Run]:
    """Each family's scenario on one rank, the reference of every split."""
    runs = {family: run_scenario(path, family, 1) for family, path in checkpoints.items()}
    for family, run in runs.items():
        assert run.preemptions > 0, f"{family}: the scenario must preempt"
        assert run.follow_up_cached >= 16, f"{family}: the follow-up must hit the prefix cache"
    return runs


@pytest.mark.parametrize("family", ["sdar_moe", "llada2"])
def test_two_expert_ranks_generate_the_tokens_of_one(checkpoints, one_rank, family: str) -> None:
    assert run_scenario(checkpoints[family], family, 1, expert_parallel_size=2) == one_rank[family]


@pytest.mark.parametrize("family", ["sdar_moe", "llada2"])
def test_expert_and_tensor_parallel_over_the_same_two_ranks_generate_the_tokens_of_one(
    checkpoints, one_rank, family: str
) -> None:
    """The attention and the shared expert split by TP, each routed expert whole on its owner."""
    assert run_scenario(checkpoints[family], family, 2, expert_parallel_size=2) == one_rank[family]


def test_a_lora_adapter_on_the_experts_over_two_expert_ranks_gives_the_tokens_of_one(checkpoints, tmp_path) -> None:
    """Each rank adapts the experts it holds (the adapter's tensors of the others' experts are theirs to use)."""
    model_dir = checkpoints["sdar_moe"]
    targets = ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = write_tiny_lora_adapter(tmp_path / "lora", model_dir, "sdar_moe", targets=targets, init_std=1.0)
    lora = dict(use_lora=True, lora_path=str(adapter))
    one = generated(model_dir, "sdar_moe", 1, **lora)
    assert generated(model_dir, "sdar_moe", 1, expert_parallel_size=2, **lora) == one
    assert generated(model_dir, "sdar_moe", 2, expert_parallel_size=2, **lora) == one


def test_the_engine_process_holds_only_its_half_of_the_experts(checkpoints) -> None:
    with make_engine(checkpoints["sdar_moe"], "sdar_moe", 1, expert_parallel_size=2) as llm:
        mixtures = [layer.mlp for layer in llm.model.model.layers]
        assert [m.experts.owned for m in mixtures] == [range(0, EXPERTS // 2)] * len(mixtures)
        assert llm.workers is not None and len(llm.workers.pids) == 1


def test_dummy_weights_split_over_expert_ranks_are_those_of_one_rank(checkpoints) -> None:
    """Each rank draws only its experts, from per-tensor seeds: the model is the one a single rank draws."""
    outputs = {}
    for size in (1, 2):
        with make_engine(checkpoints["llada2"], "llada2", 1, expert_parallel_size=size, load_format="dummy") as llm:
            prompts = random_prompts(llm, [5, 11, 3], seed=4)
            outputs[size] = [describe(t) for t in llm.generate(prompts, GREEDY, use_tqdm=False).trajectories]
    assert outputs[2] == outputs[1]


def test_graph_path_steps_follow_on_the_expert_rank(checkpoints) -> None:
    """The decode graphs' padded path (uncaptured on the CPU) with its in-graph greedy sampler and continued steps:
    the worker, holding the other experts, replays each step as rank 0 does."""
    results = {}
    for size in (1, 2):
        with make_engine(checkpoints["sdar_moe"], "sdar_moe", 1, expert_parallel_size=size, buffer_size=1) as llm:
            llm.enable_static_decode(capture=False)
            prompts = random_prompts(llm, [4, 9, 13], seed=5)
            trajectories = llm.generate(prompts, GREEDY, use_tqdm=False).trajectories
            results[size] = ([describe(t) for t in trajectories], llm.num_continuations)
    assert results[1][1] > 0, "the scenario must continue steps on the device"
    assert results[2] == results[1]


def test_a_dense_family_is_refused_naming_the_field(tmp_path: Path) -> None:
    model_dir = write_tiny_checkpoint(tmp_path / "sdar", "sdar")
    with pytest.raises(ValueError, match="expert_parallel_size=2 is invalid for model_name='sdar': .*no routed"):
        make_engine(model_dir, "sdar", 1, expert_parallel_size=2)


def test_experts_that_do_not_split_over_the_ranks_are_refused_naming_the_field(tmp_path: Path) -> None:
    model_dir = write_tiny_checkpoint(tmp_path / "six", "sdar_moe", num_experts=6)
    with pytest.raises(ValueError, match=r"num_experts=6 \(config.json of .*\) is invalid for expert_parallel_size=4"):
        make_engine(model_dir, "sdar_moe", 1, expert_parallel_size=4)


def test_expert_ranks_beside_other_tensor_ranks_are_refused_naming_both_fields(checkpoints) -> None:
    with pytest.raises(ValueError, match="expert_parallel_size=4 is invalid: with tensor_parallel_size=2 must be 1"):
        make_engine(checkpoints["sdar_moe"], "sdar_moe", 2, expert_parallel_size=4)


def test_a_family_that_runs_on_one_device_is_refused_by_name(checkpoints) -> None:
    """A mixture family registered without split layers (a plugin's, say), asked for expert ranks alone."""
    name = "sdar_moe_on_one_device"
    if name not in FAMILIES:
        register_family(dataclasses.replace(FAMILIES.get("sdar_moe").renamed(name), tensor_parallel=False))
    with pytest.raises(ValueError, match=f"expert_parallel_size=2 is invalid for model_name='{name}'"):
        make_engine(checkpoints["sdar_moe"], name, 1, expert_parallel_size=2)
