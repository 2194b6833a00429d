"""Stable-DiffCoder: Llama under model_type "llama", found by its architectures; mask from the tokenizer
files; the acceptance rule forces the best position in every sampled block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_harness import (
    GREEDY,
    assert_engine_matches_reference,
    assert_forward_matches_reference,
    assert_matches_transformers,
    check_d2f,
    check_multi_bd_batch_with_preemption,
    check_prefix_cache_hit,
    make_engine,
    random_prompts,
)
from safetensors.torch import load_file

from diffulex.models.hf_config import StableDiffCoderConfig, load_hf_config, model_type_to_model_name
from diffulex.models.loader import build_model
from diffulex.models.stable_diffcoder import StableDiffCoderForDiffusionLM
from diffulex.registry import AutoSampler
from diffulex.sampler import AlwaysForceSampler
from diffulex.testing.checkpoints import write_tiny_checkpoint
from diffulex.testing.reference_decoder import reference_generate

VOCAB = 382


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sdc") / "biased"
    return write_tiny_checkpoint(
        path, family="stable_diffcoder", seed=1, init_std=0.1, attention_bias=True, mlp_bias=True, head_dim=8
    )


@pytest.fixture(scope="module")
def peaky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("sdc") / "peaky", family="stable_diffcoder", seed=5,
                                 init_std=1.0)


def test_architectures_select_the_family_and_the_mask_comes_from_the_tokenizer(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "llama" and raw["architectures"] == ["StableDiffcoderForCausalLM"]
    assert "mask_token_id" not in raw
    assert model_type_to_model_name("llama", raw["architectures"]) == "stable_diffcoder"
    assert model_type_to_model_name("llama", ["LlamaForCausalLM"]) is None
    config = load_hf_config(ckpt, "stable_diffcoder")
    assert isinstance(config, StableDiffCoderConfig)
    assert config.mask_token_id == 5 and (config.bos_token_id, config.pad_token_id, config.eos_token_id) == (0, 1, 2)
    assert config.attention_bias and config.mlp_bias and config.head_dim == 8
    assert StableDiffCoderForDiffusionLM.family_defaults == {"mask_token_id": 5, "decoding_strategy": "multi_bd"}
    assert AutoSampler.get("stable_diffcoder") is AlwaysForceSampler


def test_weights_round_trip_with_attention_and_mlp_biases(ckpt):
    model = build_model("stable_diffcoder", ckpt, torch.float32, "cpu")
    saved = load_file(str(ckpt / "model.safetensors"))
    assert {"model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.down_proj.bias"} <= set(saved)
    assert set(model.state_dict()) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_forward_equals_a_plain_torch_llama(ckpt):
    assert_forward_matches_reference(build_model("stable_diffcoder", ckpt, torch.float32, "cpu"), ckpt, VOCAB)


def test_forward_equals_transformers_llama(ckpt):
    model = build_model("stable_diffcoder", ckpt, torch.float32, "cpu")
    cfg = json.loads((ckpt / "config.json").read_text())
    keys = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
        "head_dim rms_norm_eps max_position_embeddings tie_word_embeddings attention_bias mlp_bias rope_theta"
    ).split()
    weights = load_file(str(ckpt / "model.safetensors"))
    assert_matches_transformers(model, "Llama", {k: cfg[k] for k in keys}, weights, VOCAB)


def test_engine_matches_reference_with_preemption(peaky):
    with make_engine(peaky, decoding_strategy=None) as llm:
        assert llm.config.decoding_strategy == "multi_bd" and llm.mask_token_id == 5
    check_multi_bd_batch_with_preemption(peaky, force_always=True)


def test_engine_matches_reference_with_a_prefix_cache_hit(peaky):
    check_prefix_cache_hit(peaky, force_always=True)


def test_engine_matches_reference_under_d2f(peaky):
    check_d2f(peaky, force_always=True)


def test_the_rule_differs_from_the_sdar_rule(peaky):
    """Blocks whose predecessor is not semi-complete still take their best position: fewer forwards than the
    SDAR/LLaDA rule needs for the same prompts, and the engine follows the Stable-DiffCoder one."""
    with make_engine(peaky, buffer_size=3, accept_threshold=0.99) as llm:
        prompts = random_prompts(llm, [5, 9, 14], seed=21)
        trajectories = assert_engine_matches_reference(llm, prompts, GREEDY, force_always=True)
        cfg, th = llm.config, llm.config.decoding_thresholds
        sdar_rule_nfe = [
            reference_generate(
                llm.model, p, mask_token_id=5, block_size=cfg.block_size, buffer_size=cfg.buffer_size,
                max_tokens=GREEDY.max_tokens, max_model_len=cfg.max_model_len,
                stop_token_ids=llm.settings.stop_token_ids, accept_threshold=th.accept_threshold,
                add_block_threshold=th.add_block_threshold, semi_complete_threshold=th.semi_complete_threshold,
                vocab_limit=llm.vocab_limit,
            ).nfe
            for p in prompts
        ]  # fmt: skip
    assert sum(t.nfe for t in trajectories) < sum(sdar_rule_nfe)
