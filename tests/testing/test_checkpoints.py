"""Tiny checkpoints have the real SDAR on-disk format, are deterministic, and are cheap to write."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffulex.testing import tiny_special_token_ids, write_tiny_checkpoint
from diffulex.testing.checkpoints import sdar_reference_dir


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_the_folder_has_the_files_of_a_real_checkpoint(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path)
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "chat_template.jinja"} & names  # where the chat template lives


def test_config_json_has_every_key_of_the_real_sdar_config(tmp_path):
    real = sdar_reference_dir() / "config.json"
    if not real.is_file():
        pytest.skip("the real SDAR config is not available")
    tiny = _config(write_tiny_checkpoint(tmp_path))
    assert set(json.loads(real.read_text())) <= set(tiny)
    assert tiny["model_type"] == "sdar" and tiny["architectures"] == ["SDARForCausalLM"]


def test_config_ids_come_from_the_tiny_tokenizer(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, block_size=8)
    config, ids = _config(ckpt), tiny_special_token_ids()
    assert config["mask_token_id"] == ids["<|MASK|>"] == 379
    assert config["bos_token_id"] == config["eos_token_id"] == ids["<|endoftext|>"] == 376
    assert config["block_size"] == 8
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]


def test_vocab_size_is_padded_past_the_tokenizer_like_real_checkpoints(tmp_path):
    config = _config(write_tiny_checkpoint(tmp_path))
    assert config["vocab_size"] == 384 and config["vocab_size"] % 64 == 0
    assert config["vocab_size"] > max(tiny_special_token_ids().values()) + 1 == 380


def test_sizes_and_dtype_follow_the_arguments(tmp_path):
    ckpt = write_tiny_checkpoint(
        tmp_path,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
        intermediate_size=80,
        dtype=torch.bfloat16,
    )
    config = _config(ckpt)
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (48, 3, 8)
    assert config["torch_dtype"] == "bfloat16"
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert tensors["model.layers.2.self_attn.q_proj.weight"].shape == (48, 48)
    assert tensors["model.layers.2.self_attn.k_proj.weight"].shape == (24, 48)
    assert tensors["model.layers.2.mlp.down_proj.weight"].shape == (48, 80)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_weights_use_the_real_names_and_norms_start_near_one(tmp_path):
    tensors = load_file(str(write_tiny_checkpoint(tmp_path) / "model.safetensors"))
    assert "model.layers.1.self_attn.q_norm.weight" in tensors and "lm_head.weight" in tensors
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert (norm - 1).abs().max() < 0.2 and not torch.all(norm == 1)
    assert tensors["model.layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.2)


def test_tied_checkpoints_omit_lm_head(tmp_path):
    tensors = load_file(str(write_tiny_checkpoint(tmp_path, tie_word_embeddings=True) / "model.safetensors"))
    assert "lm_head.weight" not in tensors


def test_the_same_seed_writes_the_same_weights_and_another_seed_does_not(tmp_path):
    a = load_file(str(write_tiny_checkpoint(tmp_path / "a", seed=5) / "model.safetensors"))
    b = load_file(str(write_tiny_checkpoint(tmp_path / "b", seed=5) / "model.safetensors"))
    c = load_file(str(write_tiny_checkpoint(tmp_path / "c", seed=6) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    tokenizer_a, tokenizer_c = (tmp_path / "a" / "tokenizer.json"), (tmp_path / "c" / "tokenizer.json")
    assert tokenizer_a.read_bytes() == tokenizer_c.read_bytes()


def test_shards_come_with_an_index_of_every_tensor(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, shards=3)
    assert not (ckpt / "model.safetensors").exists()
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard_names = sorted(set(index["weight_map"].values()))
    assert shard_names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    total, seen = 0, set()
    for name in shard_names:
        with safe_open(str(ckpt / name), framework="pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == name
                tensor = f.get_tensor(key)
                total += tensor.numel() * tensor.element_size()
                seen.add(key)
    assert seen == set(index["weight_map"]) and index["metadata"]["total_size"] == total


def test_the_chat_template_is_qwen_style(tmp_path):
    from diffulex.tokenizer import load_tokenizer

    tok = load_tokenizer(write_tiny_checkpoint(tmp_path))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 377 and ids[-2:] == [378, tok.encode("\n")[0]]


def test_the_tiny_tokenizer_compresses_english(tmp_path):
    from diffulex.tokenizer import load_tokenizer

    tok = load_tokenizer(write_tiny_checkpoint(tmp_path))
    text = "The keeper climbed the stairs and watched the light over the water."
    assert len(tok.encode(text)) < len(text.encode()) * 0.6  # BPE merges, not raw bytes


def test_writing_a_default_checkpoint_is_fast_once_the_tokenizer_is_trained(tmp_path):
    write_tiny_checkpoint(tmp_path / "warm")
    start = time.perf_counter()
    write_tiny_checkpoint(tmp_path / "timed")
    assert time.perf_counter() - start < 1.0


def test_an_unknown_family_is_an_error_naming_the_families(tmp_path):
    with pytest.raises(ValueError, match="llada"):
        write_tiny_checkpoint(tmp_path, family="nope")



def test_the_tiny_diffusion_gemma_folder_is_transformers_format_with_no_weight_left_at_one(tmp_path):
    """Written by transformers' own classes: its tokenizer has Gemma's special ids, the folder holds a vision
    tower, and no norm weight, layer scalar or router scale is left at its initial 1 (the encoder's layer scalars
    differ from the decoder's), so a model that skipped or confused one of them could not match."""
    from transformers import AutoTokenizer

    from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint

    folder = write_tiny_diffusion_gemma_checkpoint(tmp_path / "dgemma")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.mask_token_id) == (
        0, 1, 2, 4,
    )  # fmt: skip
    assert _config(folder)["text_config"]["global_head_dim"] == 32
    assert json.loads((folder / "generation_config.json").read_text())["max_denoising_steps"] == 48
    tensors = load_file(str(folder / "model.safetensors"))
    assert any(name.startswith("model.encoder.vision_tower.") for name in tensors)
    small = {name: t for name, t in tensors.items() if t.dim() <= 1 and "vision" not in name}
    assert small and all(not torch.all(t == 1) for t in small.values())
    encoder = tensors["model.encoder.language_model.layers.0.layer_scalar"]
    assert not torch.equal(encoder, tensors["model.decoder.layers.0.layer_scalar"])
