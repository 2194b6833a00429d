"""Fast-dLLM v2 under multi_bd: Qwen2.5 with q/k/v bias, shifted logits, mask |<MASK>| from the tokenizer
files (its config.json names none), Dream acceptance rule. Its native strategy is tested in
tests/engine/test_fast_dllm_v2_engine.py. What every family does is checked in test_families.py."""

from __future__ import annotations

import json

import pytest
from family_harness import make_engine, write_real_vocab_checkpoint
from safetensors.torch import load_file

from diffulex import SamplingParams
from diffulex.models.family import FAMILIES, load_hf_config, model_type_to_model_name
from diffulex.models.fast_dllm_v2 import FastdLLMV2ForDiffusionLM
from diffulex.models.hf_config import FastdLLMV2Config
from diffulex.testing.checkpoints import tiny_special_token_ids

FAMILY = "fast_dllm_v2"


def test_config_names_the_family_and_the_mask_comes_from_the_tokenizer_files(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "Fast_dLLM_Qwen" and raw["architectures"] == ["Fast_dLLM_QwenForCausalLM"]
    assert "mask_token_id" not in raw and raw["bd_size"] == 32
    assert model_type_to_model_name(raw["model_type"], raw["architectures"]) == "fast_dllm_v2"
    config = load_hf_config(ckpt, "fast_dllm_v2")
    assert isinstance(config, FastdLLMV2Config) and config.bd_size == 32
    assert config.mask_token_id == tiny_special_token_ids("fast_dllm_v2")["|<MASK>|"]
    family = FAMILIES.get("fast_dllm_v2")
    assert family.model is FastdLLMV2ForDiffusionLM
    assert family.logits_shift is True and not family.force_every_block
    assert family.mask_token_id == 151665


def test_the_checkpoint_is_qwen2_shaped_biases_on_q_k_v_only(ckpt):
    saved = load_file(str(ckpt / "model.safetensors"))
    assert "model.layers.0.self_attn.v_proj.bias" in saved and "model.layers.0.self_attn.o_proj.bias" not in saved


def test_other_strategies_go_to_the_native_one(peaky):
    """As in the original, fast_dllm_v2 runs with its own strategy or multi_bd; anything else (d2f included)
    is turned into the native strategy, which is also the default."""
    sizes = dict(block_size=8, page_size=8, buffer_size=4)  # 8 x 4 = the trained 32-token block
    with make_engine(peaky, decoding_strategy=None, **sizes) as llm:
        assert llm.config.decoding_strategy == "fast_dllm_v2"
    with pytest.warns(UserWarning, match="replaced by 'fast_dllm_v2'"):
        llm = make_engine(peaky, decoding_strategy="d2f", **sizes)
    with llm:
        assert llm.config.decoding_strategy == "fast_dllm_v2"
        (answer,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert answer.completion_reason == "max_new_tokens_reached" and len(answer.token_ids) == 8


def test_the_real_qwen_tokenizer_gives_fast_dllm_v2_its_mask_id(tmp_path):
    """|<MASK>| is an additional special token at 151665 (Qwen2.5 + 1), not a declared mask token; the config
    names no mask id. The engine still writes 151665: the tokenizer files name it."""
    ckpt = write_real_vocab_checkpoint(tmp_path, "fast_dllm_v2")
    assert "mask_token_id" not in json.loads((ckpt / "config.json").read_text())
    with make_engine(ckpt, max_model_len=64) as llm:
        assert llm.tokenizer.mask_token_id is None and len(llm.tokenizer) == 151666
        assert llm.mask_token_id == 151665 == llm.tokenizer.convert_tokens_to_ids("|<MASK>|")
        assert 151645 in llm.settings.stop_token_ids  # <|im_end|>
