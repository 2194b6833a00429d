"""Dream-v0 / DiffuCoder: Qwen2.5 with q/k/v bias and shifted logits, loaded as published, decoded like the
reference (Dream rule = the SDAR/LLaDA forcing rule; position p read from row p - 1). What every family does is
checked in test_families.py."""

from __future__ import annotations

import json

import pytest
import torch
from family_harness import make_engine, write_real_vocab_checkpoint
from safetensors.torch import load_file

from diffulex import SamplingParams
from diffulex.models.dream import DreamForDiffusionLM
from diffulex.models.family import FAMILIES, load_hf_config, model_type_to_model_name
from diffulex.models.hf_config import DreamConfig
from diffulex.models.loader import build_model
from diffulex.testing.checkpoints import tiny_special_token_ids, write_tiny_checkpoint

FAMILY = "dream"


def test_config_is_read_without_remote_code_and_names_the_family(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "Dream" and raw["architectures"] == ["DreamModel"] and "auto_map" in raw
    assert model_type_to_model_name(raw["model_type"], raw["architectures"]) == "dream"
    config = load_hf_config(ckpt, "dream")
    assert isinstance(config, DreamConfig)
    assert config.mask_token_id == tiny_special_token_ids("dream")["<|mask|>"]
    assert config.head_dim == 16 and config.rope_theta == 1e6
    family = FAMILIES.get("dream")
    assert FAMILIES.get("diffucoder") is family and family.model is DreamForDiffusionLM
    assert family.logits_shift is True and not family.force_every_block
    assert (family.mask_token_id, family.default_strategy) == (151666, "d2f")


def test_the_checkpoint_is_qwen2_shaped_biases_on_q_k_v_only_and_no_qk_norm(ckpt):
    saved = load_file(str(ckpt / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in saved and "model.layers.0.self_attn.o_proj.bias" not in saved
    assert not any("q_norm" in name for name in saved)


def test_a_reasoner_checkpoint_loaded_as_dream_says_which_family_it_is(tmp_path):
    reasoner = write_tiny_checkpoint(tmp_path / "r", family="dream_reasoner")
    with pytest.raises(ValueError, match="q_norm.*model_name='dream_reasoner'"):
        build_model("dream", reasoner, torch.float32, "cpu")


def test_the_real_qwen_tokenizer_gives_dream_its_mask_id(tmp_path):
    """Dream's tokenizer is Qwen2.5's plus <|beginoftext|> 151665 and <|mask|> 151666. Rebuilt offline from the
    real Qwen2 files into a Dream checkpoint folder of real vocabulary size, it loads through the engine's
    tokenizer path (its DreamTokenizer class is never imported) and the engine writes 151666."""
    ckpt = write_real_vocab_checkpoint(tmp_path, "dream")
    config = json.loads((ckpt / "config.json").read_text())
    assert (config["vocab_size"], config["mask_token_id"], config["bos_token_id"]) == (152064, 151666, 151665)
    with make_engine(ckpt, max_model_len=64) as llm:
        assert llm.mask_token_id == 151666
        tok = llm.tokenizer
        assert len(tok) == 151667 and tok.mask_token_id == 151666
        assert tok.convert_tokens_to_ids("<|beginoftext|>") == 151665
        ids = tok.encode("Hello world, 你好<|im_end|>", add_special_tokens=False)
        assert ids == [9707, 1879, 11, 220, 108386, 151645]
        out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out.trajectories[0].token_ids) == 4 and 151666 not in out.trajectories[0].token_ids

    # Without mask_token_id in config.json, the tokenizer files' <|mask|> gives the same id.
    del config["mask_token_id"]
    (ckpt / "config.json").write_text(json.dumps(config))
    assert load_hf_config(ckpt, "dream").mask_token_id == 151666
    with make_engine(ckpt, max_model_len=64) as llm:
        assert llm.mask_token_id == 151666
