"""Stable-DiffCoder: Llama under model_type "llama", found by its architectures; mask from the tokenizer
files; the acceptance rule forces the best position in every sampled block. What every family does is checked in
test_families.py."""

from __future__ import annotations

import json

from family_harness import GREEDY, assert_engine_matches_reference, make_engine, random_prompts
from safetensors.torch import load_file

from diffulex.models.family import FAMILIES, load_hf_config, model_type_to_model_name
from diffulex.models.hf_config import StableDiffCoderConfig
from diffulex.models.stable_diffcoder import StableDiffCoderForDiffusionLM
from diffulex.testing.reference_decoder import reference_generate

FAMILY = "stable_diffcoder"


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
    family = FAMILIES.get("stable_diffcoder")
    assert family.model is StableDiffCoderForDiffusionLM
    assert (family.mask_token_id, family.default_strategy) == (5, "multi_bd")
    assert family.force_every_block is True


def test_the_checkpoint_has_attention_and_mlp_biases(ckpt):
    saved = load_file(str(ckpt / "model.safetensors"))
    assert {"model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.down_proj.bias"} <= set(saved)


def test_the_rule_differs_from_the_sdar_rule(peaky):
    """Blocks whose predecessor is not semi-complete still take their best position: fewer forwards than the
    SDAR/LLaDA rule needs for the same prompts, and the engine follows the Stable-DiffCoder one."""
    with make_engine(peaky, buffer_size=3, accept_threshold=0.99) as llm:
        prompts = random_prompts(llm, [5, 9, 14], seed=30)
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
