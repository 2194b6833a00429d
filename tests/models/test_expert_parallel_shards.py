"""Built over an expert-parallel rank count, a model holds on each rank exactly its range of the routed experts, with
the values one rank holding them all has (loaded from a checkpoint or drawn as dummy weights), and everything else
whole; the checkpoint check accepts the experts other ranks hold and still refuses an expert the model has none of.

The ranks are simulated in one process (`using_expert_parallel_group` with no process group): building and loading
run no collective.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffulex.layers.parallel_state import ExpertParallelGroup, using_expert_parallel_group
from diffulex.models.loader import build_model
from diffulex.testing.checkpoints import write_tiny_checkpoint

RANKS = 2
EXPERTS = 4
EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


@pytest.fixture(scope="module", params=["sdar_moe", "llada2"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family = request.param
    path = tmp_path_factory.mktemp("ep") / family
    return family, write_tiny_checkpoint(path, family, num_key_value_heads=2, num_experts=EXPERTS)


def build(family: str, model_dir: Path, rank: int | None, load_format: str) -> torch.nn.Module:
    group = ExpertParallelGroup() if rank is None else ExpertParallelGroup(rank, RANKS)
    with using_expert_parallel_group(group):
        return build_model(family, model_dir, torch.float32, "cpu", load_format=load_format, seed=3)


def copied(path: Path, to: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A copy of the checkpoint folder, and its tensors to edit and save back."""
    shutil.copytree(path, to)
    return to, load_file(to / "model.safetensors")


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_each_rank_holds_its_experts_as_one_rank_holds_them_and_the_rest_whole(moe_dir, load_format: str) -> None:
    family, path = moe_dir
    whole = dict(build(family, path, None, load_format).named_parameters())
    for rank in range(RANKS):
        held = dict(build(family, path, rank, load_format).named_parameters())
        mine = range(rank * EXPERTS // RANKS, (rank + 1) * EXPERTS // RANKS)
        expected = {n for n in whole if (m := EXPERT_NAME.search(n)) is None or int(m[1]) in mine}
        assert set(held) == expected, f"rank {rank}"
        for name, tensor in held.items():
            torch.testing.assert_close(tensor, whole[name], msg=f"{name} on rank {rank}")


def test_an_expert_past_the_global_count_is_still_refused(moe_dir, tmp_path: Path) -> None:
    """Rank 0 holds experts 0 and 1: the checkpoint's 2 and 3 are another rank's, but a 4th is nobody's."""
    family, path = moe_dir
    ckpt, tensors = copied(path, tmp_path / "extra")
    name = next(n for n in tensors if ".experts.3.up_proj" in n)
    tensors[name.replace(".experts.3.", f".experts.{EXPERTS}.")] = tensors[name].clone()
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=rf"unexpected tensors: .*\.experts\.{EXPERTS}\.up_proj\.weight"):
        build(family, ckpt, 0, "safetensors")


def test_a_missing_expert_of_this_rank_is_reported(moe_dir, tmp_path: Path) -> None:
    family, path = moe_dir
    ckpt, tensors = copied(path, tmp_path / "missing")
    name = next(n for n in tensors if ".experts.3.down_proj" in n)
    del tensors[name]
    save_file(tensors, ckpt / "model.safetensors")
    build(family, ckpt, 0, "safetensors")  # expert 3 is rank 1's
    with pytest.raises(ValueError, match=rf"missing tensors: {re.escape(name)}"):
        build(family, ckpt, 1, "safetensors")
