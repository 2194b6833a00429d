"""Built over a tensor-parallel rank count, a model holds on each rank exactly that rank's slice of the weights one
rank holds, loaded from a checkpoint or drawn as dummy weights; and a model that cannot be split says which field.

The ranks are simulated in one process (`using_tensor_parallel_group` with no process group): building and loading
run no collective, so each rank's model can be built here and compared with the whole one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffulex.layers.parallel_state import TensorParallelGroup, using_tensor_parallel_group
from diffulex.models.loader import build_model
from diffulex.testing.checkpoints import write_tiny_checkpoint

RANKS = 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SDAR-MoE with 4 query heads and 1 K/V head (replicated on both ranks), a vocabulary of odd size."""
    path = tmp_path_factory.mktemp("tp") / "sdar_moe"
    return write_tiny_checkpoint(path, "sdar_moe", num_key_value_heads=1)


def build(model_dir: Path, rank: int | None, load_format: str) -> torch.nn.Module:
    group = TensorParallelGroup() if rank is None else TensorParallelGroup(rank, RANKS)
    with using_tensor_parallel_group(group):
        return build_model("sdar_moe", model_dir, torch.float32, "cpu", load_format=load_format, seed=3)


def rows(tensor: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
    length = tensor.shape[dim] // RANKS
    return tensor.narrow(dim, rank * length, length)


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_each_rank_holds_its_slice_of_the_weights_one_rank_holds(moe_dir: Path, load_format: str) -> None:
    whole = dict(build(moe_dir, None, load_format).named_parameters())
    for rank in range(RANKS):
        shard = dict(build(moe_dir, rank, load_format).named_parameters())

        def expect(name: str, dim: int | None, rank: int = rank, shard: dict = shard) -> None:
            """``name`` on this rank: its slice along ``dim`` of the whole tensor (None: the whole tensor)."""
            expected = whole[name] if dim is None else rows(whole[name], rank, dim)
            torch.testing.assert_close(shard[name], expected, msg=f"{name} on rank {rank}")

        attention, expert = "model.layers.0.self_attn.", "model.layers.0.mlp.experts.1."
        expect(attention + "q_proj.weight", 0)
        expect(attention + "k_proj.weight", None)  # one K/V head for two ranks: both hold it whole
        expect(attention + "o_proj.weight", 1)
        expect(expert + "gate_proj.weight", 0)
        expect(expert + "down_proj.weight", 1)
        expect("model.layers.0.mlp.gate.weight", None)  # the router and the norms are replicated
        expect("model.norm.weight", None)
        vocab = whole["model.embed_tokens.weight"].shape[0]
        start, length, _ = TensorParallelGroup(rank, RANKS).padded_shard(vocab)
        embedding = shard["model.embed_tokens.weight"]
        torch.testing.assert_close(embedding[:length], whole["model.embed_tokens.weight"][start : start + length])
        assert not embedding[length:].any(), "padding rows of the vocabulary slice are zero"


def test_a_checkpoint_of_another_geometry_is_still_refused_by_shape_when_sharded(moe_dir: Path, tmp_path) -> None:
    """Shapes are compared whole (the checkpoint's) against whole (the model's), not against a rank's slice."""
    wider = write_tiny_checkpoint(tmp_path / "wider", "sdar_moe", num_key_value_heads=1, moe_intermediate_size=64)
    config = (moe_dir / "config.json").read_text()
    (wider / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"down_proj.weight in .*: checkpoint \[64, 64\] vs model \[64, 32\]"):
        build(wider, 0, "safetensors")
