"""Writing a trained model as a real SDAR checkpoint folder (config.json, generation_config.json,
model.safetensors, tokenizer files), the format `diffulex.testing.checkpoints` also writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffulex.models.hf_config import SDARConfig
from diffulex.models.sdar import SDARForDiffusionLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def model_config(
    *,
    vocab_size: int,
    special_ids: dict[str, int],
    hidden_size: int = 256,
    num_hidden_layers: int = 8,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 768,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    block_size: int = 4,
    tie_word_embeddings: bool = True,
) -> dict:
    """The full ``config.json`` of an SDAR checkpoint (the keys of the published SDAR configs)."""
    eot = special_ids["<|endoftext|>"]
    return {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_implementation": "flex_attention",
        "block_size": block_size,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "mask_token_id": special_ids["<|MASK|>"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_hidden_layers,
        "model_type": "sdar",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.4",
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def generation_config(special_ids: dict[str, int]) -> dict:
    eot = special_ids["<|endoftext|>"]
    return {
        "bos_token_id": eot,
        "eos_token_id": [special_ids["<|im_end|>"], eot],
        "pad_token_id": eot,
        "do_sample": False,
        "transformers_version": "4.51.0",
    }


def state_dict_for_export(model: SDARForDiffusionLM, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under the real names; a tied LM head is not written (it is the embedding)."""
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        tensors[name] = t.detach().to("cpu", dtype).contiguous()
    return tensors


def save_checkpoint(
    model: SDARForDiffusionLM,
    config: dict,
    tokenizer_dir: str | Path,
    special_ids: dict[str, int],
    out: str | Path,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write the checkpoint folder `out` (bf16 weights); tokenizer files are copied from `tokenizer_dir`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state_dict_for_export(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen = json.dumps(generation_config(special_ids), indent=2) + "\n"
    (out / "generation_config.json").write_text(gen, encoding="utf-8")
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text, encoding="utf-8")
    return out


def sdar_config(config: dict) -> SDARConfig:
    return SDARConfig.from_dict(config)
