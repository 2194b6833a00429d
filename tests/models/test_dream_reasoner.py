"""The Dream reasoner: Qwen3 layout under model_type "Dream", told apart by its architectures; no shift. What every
family does is checked in test_families.py."""

from __future__ import annotations

import json

import pytest
import torch
from family_harness import make_engine, write_real_vocab_checkpoint
from safetensors.torch import load_file

from diffulex.models.dream_reasoner import DreamReasonerForDiffusionLM
from diffulex.models.family import FAMILIES, load_hf_config, model_type_to_model_name
from diffulex.models.hf_config import DreamReasonerConfig
from diffulex.models.loader import build_model
from diffulex.testing.checkpoints import tiny_special_token_ids, write_tiny_checkpoint

FAMILY = "dream_reasoner"


def test_architectures_tell_the_reasoner_from_dream_v0(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "Dream" and raw["architectures"] == ["DreamForCausalLM"]
    assert model_type_to_model_name("Dream", ["DreamForCausalLM"]) == "dream_reasoner"
    assert model_type_to_model_name("Dream", ["DreamModel"]) == "dream"
    assert model_type_to_model_name("Dream", []) == "dream"
    config = load_hf_config(ckpt, "dream_reasoner")
    assert isinstance(config, DreamReasonerConfig) and config.attention_bias
    assert config.mask_token_id == tiny_special_token_ids("dream_reasoner")["<|MASK|>"]
    family = FAMILIES.get("dream_reasoner")
    assert family.model is DreamReasonerForDiffusionLM
    assert family.logits_shift is False and not family.force_every_block
    assert (family.mask_token_id, family.default_strategy) == (151669, "multi_bd")


def test_the_checkpoint_has_qk_norms_and_biases_on_all_four_projections(ckpt):
    saved = load_file(str(ckpt / "model.safetensors"))
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.o_proj.bias"} <= set(saved)


def test_a_dream_v0_checkpoint_loaded_as_the_reasoner_says_which_family_it_is(tmp_path):
    dream = write_tiny_checkpoint(tmp_path / "d", family="dream")
    with pytest.raises(ValueError, match="missing tensors.*q_norm.*model_name='dream'"):
        build_model("dream_reasoner", dream, torch.float32, "cpu")


def test_the_real_qwen3_tokenizer_gives_the_reasoner_its_mask_id(tmp_path):
    ckpt = write_real_vocab_checkpoint(tmp_path, "dream_reasoner")
    raw = json.loads((ckpt / "config.json").read_text())
    assert (raw["vocab_size"], raw["mask_token_id"]) == (151936, 151669)
    del raw["mask_token_id"]  # the tokenizer's <|MASK|> must give the same id
    (ckpt / "config.json").write_text(json.dumps(raw))
    with make_engine(ckpt, max_model_len=64) as llm:
        assert llm.mask_token_id == 151669 == llm.tokenizer.mask_token_id
        assert len(llm.tokenizer) == 151670
