"""Reading DiffusionGemma's ``config.json``: both spellings of the global layers, and values the network cannot
honour refused with the field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffulex.models.diffusion_gemma_config import FULL, SLIDING, DiffusionGemmaConfig, RopeSpec
from diffulex.testing.checkpoints import (
    DIFFUSION_GEMMA_26B_CONFIG,
    DIFFUSION_GEMMA_26B_TEXT_CONFIG,
    write_tiny_diffusion_gemma_checkpoint,
)


def test_the_published_config_gives_its_geometry() -> None:
    """DiffusionGemma-26B-A4B-it: 30 layers, every sixth full; sliding layers 256-dim heads with 8 K/V heads and
    plain rotary, full layers 512-dim with 2 K/V heads and proportional rotary on a quarter of the pairs."""
    config = DiffusionGemmaConfig.from_dict(DIFFUSION_GEMMA_26B_CONFIG)
    assert config.layer_types == tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(30))
    assert {(g.layer_type, g.head_dim, g.num_kv_heads) for g in config.layers} == {(SLIDING, 256, 8), (FULL, 512, 2)}
    assert config.rope == {
        SLIDING: RopeSpec("default", 10_000.0),
        FULL: RopeSpec("proportional", 1_000_000.0, partial_rotary_factor=0.25),
    }
    assert (config.canvas_length, config.sliding_window, config.eos_token_ids) == (256, 1024, (1, 106, 50))
    assert (config.num_experts, config.top_k_experts, config.image_token_id) == (128, 8, 258880)


def test_both_spellings_of_the_global_layers_read_alike(tmp_path: Path) -> None:
    """transformers >= 5 writes ``per_layer_config`` (layer index -> head_dim, num_key_value_heads); the published
    file has ``global_head_dim`` and ``num_global_key_value_heads``. Both give the same geometry."""
    per_layer = write_tiny_diffusion_gemma_checkpoint(tmp_path / "per-layer", published_config_format=False)
    published = write_tiny_diffusion_gemma_checkpoint(tmp_path / "published")
    assert "per_layer_config" in json.loads((per_layer / "config.json").read_text())["text_config"]
    assert "per_layer_config" not in json.loads((published / "config.json").read_text())["text_config"]
    assert DiffusionGemmaConfig.from_pretrained(per_layer) == DiffusionGemmaConfig.from_pretrained(published)


def test_a_missing_global_head_dim_takes_transformers_default() -> None:
    text = {k: v for k, v in DIFFUSION_GEMMA_26B_TEXT_CONFIG.items() if k != "global_head_dim"}
    config = DiffusionGemmaConfig.from_dict({**DIFFUSION_GEMMA_26B_CONFIG, "text_config": text})
    assert {g.head_dim for g in config.layers if g.layer_type == FULL} == {512}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"tie_word_embeddings": False}, "'tie_word_embeddings' must be true"),
        ({"text_config": {"use_bidirectional_attention": "all"}}, "attention' must be null or 'vision'.*got 'all'"),
        ({"text_config": {"num_experts": None}}, "'text_config.num_experts' is missing"),
        ({"text_config": {"layer_types": ["full_attention"] * 29 + ["sliding_attention"]}}, "must end with"),
        ({"text_config": {"hidden_activation": "silu"}}, "'text_config.hidden_activation' must be 'gelu_pytorch_tanh'"),
        ({"text_config": {"per_layer_config": {"5": {"sliding_window": 4}}}}, "per_layer_config.5' may only set"),
        ({"text_config": {"rope_parameters": {**DIFFUSION_GEMMA_26B_TEXT_CONFIG["rope_parameters"],
                                              "full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}}},
         "rope_type' must be one of default, proportional, got 'yarn'"),
        ({"canvas_length": 0}, "'canvas_length' must be a positive integer, got 0"),
    ],
)  # fmt: skip
def test_values_the_network_cannot_honour_are_refused(edit: dict, message: str) -> None:
    config = {**DIFFUSION_GEMMA_26B_CONFIG, **{k: v for k, v in edit.items() if k != "text_config"}}
    config["text_config"] = {**DIFFUSION_GEMMA_26B_TEXT_CONFIG, **edit.get("text_config", {})}
    with pytest.raises(ValueError, match=message):
        DiffusionGemmaConfig.from_dict(config)
