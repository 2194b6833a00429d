"""LLaDA: OLMo config names, OLMo parameter names (ff_proj is the gate), no shift, LLaDA/SDAR forcing rule. What
every family does is checked in test_families.py."""

from __future__ import annotations

import json

import pytest
import torch
from family_harness import assert_forward_matches_reference, assert_matches_transformers, make_engine
from safetensors.torch import load_file

from diffulex.models.family import FAMILIES, load_hf_config, model_type_to_model_name
from diffulex.models.hf_config import LLaDAConfig
from diffulex.models.llada import LLaDAForDiffusionLM
from diffulex.models.loader import build_model
from diffulex.testing.checkpoints import tiny_special_token_ids, write_tiny_checkpoint

FAMILY = "llada"
VOCAB = 382  # len of the tiny LLaDA tokenizer


def test_config_uses_olmo_names_and_names_the_family(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "llada" and raw["architectures"] == ["LLaDAModelLM"]
    assert {"d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size", "weight_tying"} <= set(raw)
    assert "hidden_size" not in raw
    assert model_type_to_model_name(raw["model_type"], raw["architectures"]) == "llada"
    config = load_hf_config(ckpt, "llada")
    assert isinstance(config, LLaDAConfig)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (64, 4, 4)  # MHA
    assert config.mask_token_id == tiny_special_token_ids("llada")["<|mdm_mask|>"]
    family = FAMILIES.get("llada")
    assert family.model is LLaDAForDiffusionLM
    assert (family.mask_token_id, family.default_strategy) == (126336, "d2f")
    assert family.logits_shift is False and not family.force_every_block


def test_the_mask_id_comes_from_the_tokenizer_files_when_the_config_has_none(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "m", family="llada")
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["mask_token_id"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    assert load_hf_config(ckpt, "llada").mask_token_id == tiny_special_token_ids("llada")["<|mdm_mask|>"]


@pytest.mark.parametrize(
    ("key", "value"), [("block_type", "sequential"), ("alibi", True), ("attention_layer_norm", True),
                       ("activation_type", "gelu"), ("block_group_size", 2)]
)  # fmt: skip
def test_configurations_the_model_does_not_implement_are_named(tmp_path, key, value):
    ckpt = write_tiny_checkpoint(tmp_path / "c", family="llada")
    raw = json.loads((ckpt / "config.json").read_text())
    raw[key] = value
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=key):
        load_hf_config(ckpt, "llada")


def test_the_checkpoint_uses_the_olmo_names(ckpt):
    saved = load_file(str(ckpt / "model.safetensors"))
    assert "model.transformer.blocks.1.ff_proj.weight" in saved and "model.transformer.ff_out.weight" in saved


def test_tied_weights_have_no_lm_head_tensor_and_use_the_embedding(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "tied", family="llada", tie_word_embeddings=True, attention_bias=True)
    saved = load_file(str(ckpt / "model.safetensors"))
    assert "model.transformer.ff_out.weight" not in saved and "model.transformer.blocks.0.q_proj.bias" in saved
    model = build_model("llada", ckpt, torch.float32, "cpu")
    assert model.model.transformer.ff_out.weight is model.model.transformer.wte.weight
    assert_forward_matches_reference(model, ckpt, VOCAB)


def test_forward_equals_transformers_llama_with_ff_proj_as_the_gate(ckpt):
    """LLaDA's block is Llama's with other names: ff_proj -> gate_proj, up_proj -> up_proj, ff_out -> down_proj."""
    model = build_model("llada", ckpt, torch.float32, "cpu")
    cfg = json.loads((ckpt / "config.json").read_text())
    renames = {
        "attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm", "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj",
        "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj",
    }  # fmt: skip
    state = {}
    for name, tensor in load_file(str(ckpt / "model.safetensors")).items():
        if name == "model.transformer.wte.weight":
            state["model.embed_tokens.weight"] = tensor
        elif name == "model.transformer.ln_f.weight":
            state["model.norm.weight"] = tensor
        elif name == "model.transformer.ff_out.weight":
            state["lm_head.weight"] = tensor
        else:
            _, _, _, layer, leaf, kind = name.split(".")
            state[f"model.layers.{layer}.{renames[leaf]}.{kind}"] = tensor
    hf_cfg = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["d_model"], intermediate_size=cfg["mlp_hidden_size"],
        num_hidden_layers=cfg["n_layers"], num_attention_heads=cfg["n_heads"], num_key_value_heads=cfg["n_kv_heads"],
        rms_norm_eps=cfg["rms_norm_eps"], max_position_embeddings=cfg["max_sequence_length"],
        tie_word_embeddings=False, rope_theta=cfg["rope_theta"],
    )  # fmt: skip
    assert_matches_transformers(model, "Llama", hf_cfg, state, VOCAB)


@pytest.mark.parametrize("strategy", ["dmax", "diffusion_gemma"])
def test_strategies_the_original_rejects_for_llada_are_clear_errors(peaky, strategy):
    with pytest.raises(ValueError, match=strategy):
        make_engine(peaky, decoding_strategy=strategy)


@torch.inference_mode()
def test_readers_reach_the_last_block_and_change_nothing_on_the_cpu(ckpt):
    """The forward takes the rows anyone reads (`run_decoder`); LLaDA's last block hands them to its projections
    after attention, which skip only on CUDA, so on the CPU the hidden states are the same."""
    from diffulex.attention import DenseAttentionMetadata, visibility_mask

    model = build_model("llada", ckpt, torch.float32, "cpu")
    pos = torch.arange(8)
    meta = DenseAttentionMetadata(visibility_mask(pos, pos, 4, False, 0))
    ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(model(ids, pos, meta, torch.full((8,), -1)), model(ids, pos, meta), atol=0, rtol=0)
