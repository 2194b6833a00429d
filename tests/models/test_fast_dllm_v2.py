"""Fast-dLLM v2 under multi_bd: Qwen2.5 with q/k/v bias, shifted logits, mask |<MASK>| from the tokenizer
files (its config.json names none), Dream acceptance rule. Its native strategy is a separate runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_harness import (
    assert_forward_matches_reference,
    assert_matches_transformers,
    check_first_token_comes_from_the_last_prompt_position,
    check_multi_bd_batch_with_preemption,
    check_prefix_cache_hit,
    make_engine,
)
from safetensors.torch import load_file

from diffulex.models.fast_dllm_v2 import FastdLLMV2ForDiffusionLM
from diffulex.models.hf_config import FastdLLMV2Config, load_hf_config, model_type_to_model_name
from diffulex.models.loader import build_model
from diffulex.registry import AutoSampler
from diffulex.sampler import ConfidenceSampler
from diffulex.testing.checkpoints import tiny_special_token_ids, write_tiny_checkpoint

VOCAB = 380


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fdv2") / "fdv2", family="fast_dllm_v2", seed=1, init_std=0.1)


@pytest.fixture(scope="module")
def peaky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fdv2") / "peaky", family="fast_dllm_v2", seed=6,
                                 init_std=1.0)


def test_config_names_the_family_and_the_mask_comes_from_the_tokenizer_files(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "Fast_dLLM_Qwen" and raw["architectures"] == ["Fast_dLLM_QwenForCausalLM"]
    assert "mask_token_id" not in raw and raw["bd_size"] == 32
    assert model_type_to_model_name(raw["model_type"], raw["architectures"]) == "fast_dllm_v2"
    config = load_hf_config(ckpt, "fast_dllm_v2")
    assert isinstance(config, FastdLLMV2Config) and config.bd_size == 32
    assert config.mask_token_id == tiny_special_token_ids("fast_dllm_v2")["|<MASK>|"]
    assert FastdLLMV2ForDiffusionLM.logits_shift is True
    assert FastdLLMV2ForDiffusionLM.family_defaults["mask_token_id"] == 151665
    assert AutoSampler.get("fast_dllm_v2") is ConfidenceSampler


def test_weights_round_trip_under_the_qwen2_names(ckpt):
    model = build_model("fast_dllm_v2", ckpt, torch.float32, "cpu")
    saved = load_file(str(ckpt / "model.safetensors"))
    assert "model.layers.0.self_attn.v_proj.bias" in saved and "model.layers.0.self_attn.o_proj.bias" not in saved
    assert set(model.state_dict()) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_forward_equals_a_plain_torch_qwen2(ckpt):
    assert_forward_matches_reference(build_model("fast_dllm_v2", ckpt, torch.float32, "cpu"), ckpt, VOCAB)


def test_forward_equals_transformers_qwen2(ckpt):
    model = build_model("fast_dllm_v2", ckpt, torch.float32, "cpu")
    cfg = json.loads((ckpt / "config.json").read_text())
    keys = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
        "rms_norm_eps max_position_embeddings tie_word_embeddings rope_theta"
    ).split()
    weights = load_file(str(ckpt / "model.safetensors"))
    assert_matches_transformers(model, "Qwen2", {k: cfg[k] for k in keys}, weights, VOCAB)


def test_engine_matches_reference_under_multi_bd_with_preemption(peaky):
    check_multi_bd_batch_with_preemption(peaky)


def test_engine_matches_reference_with_a_prefix_cache_hit(peaky):
    check_prefix_cache_hit(peaky)


def test_first_generated_token_comes_from_the_last_prompt_position(peaky):
    check_first_token_comes_from_the_last_prompt_position(peaky)


def test_other_strategies_go_to_the_native_one_which_is_not_available_yet(peaky):
    """As in the original, fast_dllm_v2 runs with its own strategy or multi_bd; anything else (d2f included)
    is turned into the native strategy, whose runtime is a separate piece of work."""
    sizes = dict(block_size=8, page_size=8, buffer_size=4)  # 8 x 4 = the trained 32-token block
    with pytest.raises(ValueError, match="decoding_strategy='fast_dllm_v2'"):
        make_engine(peaky, decoding_strategy=None, **sizes)
    with pytest.warns(UserWarning, match="replaced by 'fast_dllm_v2'"), pytest.raises(ValueError, match="not supp"):
        make_engine(peaky, decoding_strategy="d2f", **sizes)


def test_the_real_qwen_tokenizer_gives_fast_dllm_v2_its_mask_id(tmp_path):
    """|<MASK>| is an additional special token at 151665 (Qwen2.5 + 1), not a declared mask token; the config
    names no mask id. The engine still writes 151665: the tokenizer files name it."""
    ckpt = write_tiny_checkpoint(
        tmp_path / "real-vocab", family="fast_dllm_v2", real_tokenizer=True, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
    )  # fmt: skip
    assert "mask_token_id" not in json.loads((ckpt / "config.json").read_text())
    with make_engine(ckpt, max_model_len=64) as llm:
        assert llm.tokenizer.mask_token_id is None and len(llm.tokenizer) == 151666
        assert llm.mask_token_id == 151665 == llm.tokenizer.convert_tokens_to_ids("|<MASK>|")
        assert 151645 in llm.settings.stop_token_ids  # <|im_end|>
