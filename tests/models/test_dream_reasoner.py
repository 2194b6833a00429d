"""The Dream reasoner: Qwen3 layout under model_type "Dream", told apart by its architectures; no shift."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_harness import (
    assert_forward_matches_reference,
    assert_matches_transformers,
    check_d2f,
    check_multi_bd_batch_with_preemption,
    check_prefix_cache_hit,
    make_engine,
)
from safetensors.torch import load_file

from diffulex.models.dream_reasoner import DreamReasonerForDiffusionLM
from diffulex.models.hf_config import DreamReasonerConfig, load_hf_config, model_type_to_model_name
from diffulex.models.loader import build_model
from diffulex.registry import AutoSampler
from diffulex.sampler import ConfidenceSampler
from diffulex.testing.checkpoints import tiny_special_token_ids, write_tiny_checkpoint

VOCAB = 382


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reasoner") / "biased"
    return write_tiny_checkpoint(path, family="dream_reasoner", seed=1, init_std=0.1, attention_bias=True)


@pytest.fixture(scope="module")
def peaky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reasoner") / "peaky"
    return write_tiny_checkpoint(path, family="dream_reasoner", seed=4, init_std=1.0)


def test_architectures_tell_the_reasoner_from_dream_v0(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "Dream" and raw["architectures"] == ["DreamForCausalLM"]
    assert model_type_to_model_name("Dream", ["DreamForCausalLM"]) == "dream_reasoner"
    assert model_type_to_model_name("Dream", ["DreamModel"]) == "dream"
    assert model_type_to_model_name("Dream", []) == "dream"
    config = load_hf_config(ckpt, "dream_reasoner")
    assert isinstance(config, DreamReasonerConfig) and config.attention_bias
    assert config.mask_token_id == tiny_special_token_ids("dream_reasoner")["<|MASK|>"]
    assert DreamReasonerForDiffusionLM.logits_shift is False
    assert DreamReasonerForDiffusionLM.family_defaults == {"mask_token_id": 151669, "decoding_strategy": "multi_bd"}
    assert AutoSampler.get("dream_reasoner") is ConfidenceSampler


def test_weights_round_trip_with_qk_norms_and_biases_on_all_four_projections(ckpt):
    model = build_model("dream_reasoner", ckpt, torch.float32, "cpu")
    saved = load_file(str(ckpt / "model.safetensors"))
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.o_proj.bias"} <= set(saved)
    assert set(model.state_dict()) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_a_dream_v0_checkpoint_loaded_as_the_reasoner_says_which_family_it_is(tmp_path):
    dream = write_tiny_checkpoint(tmp_path / "d", family="dream")
    with pytest.raises(ValueError, match="missing tensors.*q_norm.*model_name='dream'"):
        build_model("dream_reasoner", dream, torch.float32, "cpu")


def test_forward_equals_a_plain_torch_qwen3(ckpt):
    assert_forward_matches_reference(build_model("dream_reasoner", ckpt, torch.float32, "cpu"), ckpt, VOCAB)


def test_forward_equals_transformers_qwen3(ckpt):
    model = build_model("dream_reasoner", ckpt, torch.float32, "cpu")
    cfg = json.loads((ckpt / "config.json").read_text())
    keys = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
        "head_dim rms_norm_eps max_position_embeddings tie_word_embeddings attention_bias rope_theta"
    ).split()
    weights = load_file(str(ckpt / "model.safetensors"))
    assert_matches_transformers(model, "Qwen3", {k: cfg[k] for k in keys}, weights, VOCAB)


def test_engine_matches_reference_with_preemption(peaky):
    with make_engine(peaky, decoding_strategy=None) as llm:
        assert llm.config.decoding_strategy == "multi_bd" and not llm.settings.logits_shift
    check_multi_bd_batch_with_preemption(peaky)


def test_engine_matches_reference_with_a_prefix_cache_hit(peaky):
    check_prefix_cache_hit(peaky)


def test_engine_matches_reference_under_d2f(peaky):
    check_d2f(peaky)


def test_the_real_qwen3_tokenizer_gives_the_reasoner_its_mask_id(tmp_path):
    ckpt = write_tiny_checkpoint(
        tmp_path / "real-vocab", family="dream_reasoner", real_tokenizer=True, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
    )  # fmt: skip
    raw = json.loads((ckpt / "config.json").read_text())
    assert (raw["vocab_size"], raw["mask_token_id"]) == (151936, 151669)
    del raw["mask_token_id"]  # the tokenizer's <|MASK|> must give the same id
    (ckpt / "config.json").write_text(json.dumps(raw))
    with make_engine(ckpt, max_model_len=64) as llm:
        assert llm.mask_token_id == 151669 == llm.tokenizer.mask_token_id
        assert len(llm.tokenizer) == 151670
