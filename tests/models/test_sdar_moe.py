"""SDAR-MoE: SDAR's network with Qwen3-MoE's sparse MLP. That it equals the network written out by hand (router
and experts token by token), and that the engine decodes it as the reference decoder does, is checked in
test_families.py; here, what is particular to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_harness import TRANSFORMERS_CONFIG_KEYS, assert_matches_transformers
from safetensors.torch import load_file

from diffulex.layers.moe import SparseMoE
from diffulex.models.dense import DenseMLP
from diffulex.models.family import model_type_to_model_name
from diffulex.models.hf_config import SDARMoeConfig
from diffulex.models.loader import build_model
from diffulex.testing import write_tiny_checkpoint
from diffulex.testing.checkpoints import tiny_tokenizer_len

FAMILY = "sdar_moe"
MOE_KEYS = ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
            "mlp_only_layers"]  # fmt: skip


def test_layers_listed_as_mlp_only_keep_the_dense_mlp(ckpt: Path):
    model = build_model(FAMILY, ckpt, torch.float32, "cpu")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["mlp_only_layers"] == [1]
    assert isinstance(model.model.layers[0].mlp, SparseMoE)
    assert isinstance(model.model.layers[1].mlp, DenseMLP)
    moe = model.model.layers[0].mlp
    assert (moe.num_experts, moe.top_k, moe.gate.normalize) == (4, 2, True)


def test_the_experts_are_stacked_after_loading(ckpt: Path):
    moe = build_model(FAMILY, ckpt, torch.float32, "cpu").model.layers[0].mlp
    assert moe.stack.gate_up is not None
    assert moe.experts[2].down_proj.weight.data_ptr() == moe.stack.down[2].data_ptr()


def test_forward_equals_transformers_qwen3_moe_of_the_same_tensors(tmp_path: Path):
    """transformers keeps each layer's experts fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj``):
    the checkpoint's per-expert tensors are stacked into that layout for it."""
    ckpt = write_tiny_checkpoint(tmp_path / "moe", family=FAMILY, seed=4, init_std=0.1)
    model = build_model(FAMILY, ckpt, torch.float32, "cpu")
    cfg = json.loads((ckpt / "config.json").read_text())
    config_kwargs = {k: cfg[k] for k in [*TRANSFORMERS_CONFIG_KEYS["Qwen3"], *MOE_KEYS]}
    tensors = load_file(str(ckpt / "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        experts = range(cfg["num_experts"])
        fused[p + "gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}{e}.gate_proj.weight"], tensors[f"{p}{e}.up_proj.weight"]]) for e in experts]
        )
        fused[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in experts])
    assert_matches_transformers(model, "Qwen3Moe", config_kwargs, fused, tiny_tokenizer_len(FAMILY))


def test_the_family_is_recognised_from_its_config(ckpt: Path):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert model_type_to_model_name(cfg["model_type"], cfg["architectures"]) == "sdar_moe"
    assert model_type_to_model_name("sdar_moe", None) == "sdar_moe"


def _config(**changes) -> dict:
    base = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # fmt: skip
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize("key", ["num_experts", "num_experts_per_tok", "moe_intermediate_size"])
def test_a_config_without_its_expert_sizes_is_refused_by_name(key):
    with pytest.raises(ValueError, match=f"config field '{key}' is missing"):
        SDARMoeConfig.from_dict(_config(**{key: None}))


def test_more_experts_per_token_than_experts_is_refused():
    with pytest.raises(ValueError, match="'num_experts_per_tok' \\(5\\) must be at most 'num_experts' \\(4\\)"):
        SDARMoeConfig.from_dict(_config(num_experts_per_tok=5))


@pytest.mark.parametrize("layers", [[2], [-1], ["0"], 1])
def test_mlp_only_layers_must_name_existing_layers(layers):
    with pytest.raises(ValueError, match="config field 'mlp_only_layers' must list layer indices in \\[0, 2\\)"):
        SDARMoeConfig.from_dict(_config(mlp_only_layers=layers))


def test_decoder_sparse_step_makes_every_nth_layer_sparse():
    config = SDARMoeConfig.from_dict(_config(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [config.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]


def test_moe_gemm_impl_naive_takes_the_reference_path_and_vllm_is_refused(ckpt: Path):
    from diffulex import Diffulex

    with Diffulex(str(ckpt), moe_gemm_impl="naive", block_size=4, max_model_len=64) as llm:
        impls = {m.impl for m in llm.model.modules() if isinstance(m, SparseMoE)}
    assert impls == ({"dense"} if torch.cuda.is_available() else {"loop"})  # the device's reference path
    with pytest.raises(ValueError, match="moe_gemm_impl='vllm'"):
        Diffulex(str(ckpt), moe_gemm_impl="vllm")
