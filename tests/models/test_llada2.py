"""LLaDA2: the Ling-MoE decoder. That it equals the network written out by hand (fused q/k/v, partial rotary,
group-limited sigmoid routing, shared expert) and that the engine decodes it as the reference decoder does is
checked in test_families.py; here, what is particular to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffulex.layers.moe import GroupLimitedRouter, SparseMoE
from diffulex.models.dense import DenseMLP
from diffulex.models.family import FAMILIES, load_hf_config, model_type_to_model_name
from diffulex.models.hf_config import LLaDA2Config
from diffulex.models.llada2 import LLaDA2ForDiffusionLM
from diffulex.models.loader import build_model

FAMILY = "llada2"


def test_the_first_layers_are_dense_and_the_rest_experts_with_a_shared_one(ckpt: Path):
    model = build_model(FAMILY, ckpt, torch.float32, "cpu")
    layers = model.model.layers
    assert isinstance(layers[0].mlp, DenseMLP)
    moe = layers[1].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.gate, GroupLimitedRouter)
    assert moe.shared_experts is not None
    assert (moe.gate.n_group, moe.gate.topk_group, moe.gate.scaling) == (2, 1, 2.5)


def test_the_expert_bias_stays_float32_in_a_bfloat16_model(ckpt: Path):
    """The bias decides near-ties between experts; rounding it to bf16 would move choices."""
    model = build_model(FAMILY, ckpt, torch.bfloat16, "cpu")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16
    assert gate.expert_bias.dtype == torch.float32


def test_rotary_covers_half_of_each_head(ckpt: Path):
    config = load_hf_config(ckpt, FAMILY)
    model = build_model(FAMILY, ckpt, torch.float32, "cpu")
    assert config.rotary_dim == config.head_dim // 2 == model.model.rotary_emb.head_dim


def test_every_llada2_name_runs_the_same_model():
    names = ("llada2", "llada2_moe", "llada2_mini", "llada2dot1_mini", "llada2_mini_dmax")
    assert {FAMILIES.get(name).model for name in names} == {LLaDA2ForDiffusionLM}
    assert FAMILIES.get("llada2dot1_mini").sampling_modes == ("edit",)
    assert model_type_to_model_name("llada2_moe", ["LLaDA2MoeModelLM"]) == "llada2"


def _config(**changes) -> dict:
    base = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "partial_rotary_factor": 0.5}  # fmt: skip
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def test_defaults_of_a_minimal_config():
    config = LLaDA2Config.from_dict(_config())
    assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (1, 1, 1.0)
    assert (config.num_shared_experts, config.first_k_dense_replace, config.rope_theta) == (0, 0, 600_000.0)
    assert config.use_qk_norm and config.expert_bias


@pytest.mark.parametrize("key", ["num_experts", "num_experts_per_tok", "moe_intermediate_size"])
def test_a_config_without_its_expert_sizes_is_refused_by_name(key):
    with pytest.raises(ValueError, match=f"config field '{key}' is missing"):
        LLaDA2Config.from_dict(_config(**{key: None}))


def test_softmax_routing_is_refused_by_name():
    with pytest.raises(ValueError, match="config field 'score_function' must be 'sigmoid' for LLaDA2, got 'softmax'"):
        LLaDA2Config.from_dict(_config(score_function="softmax"))


@pytest.mark.parametrize("factor", [1.5, 0.03, 0.0])
def test_a_rotary_fraction_outside_the_head_is_refused(factor):
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        LLaDA2Config.from_dict(_config(partial_rotary_factor=factor))


@pytest.mark.parametrize(("key", "value"), [("num_shared_experts", -1), ("first_k_dense_replace", 1.5)])
def test_counts_must_be_non_negative_integers(key, value):
    with pytest.raises(ValueError, match=f"config field '{key}' must be a non-negative integer"):
        LLaDA2Config.from_dict(_config(**{key: value}))
