"""Reading a checkpoint's ``config.json`` into our own typed config classes, never through remote code.

Real diffusion-LM checkpoints ship their config class as Python code (``auto_map`` ->
``configuration_*.py``); loading it through ``transformers.AutoConfig`` would need ``trust_remote_code=True``,
i.e. executing files from the checkpoint folder. Instead each family declares the fields it uses in a
dataclass here and reads the JSON itself: unknown keys are ignored, missing or invalid required fields are a
``ValueError`` naming the field.

``load_hf_config(model_dir, model_name)`` picks the reader registered for the engine's ``model_name``;
``model_type_to_model_name`` guesses that name from ``config.json`` when the user did not give one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from diffulex.registry import Registry

HFConfigReaders: Registry[Callable[[str | Path], Any]] = Registry("HF config reader for model")


def read_config_dict(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint folder."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{Path(model_dir)} has no config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _int(d: dict[str, Any], key: str, *, required: bool = True, default: int | None = None) -> int | None:
    value = d.get(key)
    if value is None:
        if required:
            raise ValueError(f"config field {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _token_id(d: dict[str, Any], key: str) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config field {key!r} must be a non-negative integer, got {value!r}")
    return value


def _token_ids(d: dict[str, Any], key: str) -> int | list[int] | None:
    value = d.get(key)
    if isinstance(value, list):
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"config field {key!r} must hold non-negative integers, got {value!r}")
        return list(value)
    return _token_id(d, key)


def _float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config field {key!r} must be true or false, got {value!r}")
    return value


@dataclass
class SDARConfig:
    """The fields of an SDAR (Qwen3-architecture block-diffusion) ``config.json`` that the engine uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    block_size: int | None = None
    torch_dtype: str | None = None
    model_type: str = "sdar"
    architectures: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SDARConfig:
        """Validate and copy the known fields of a config dict; other keys are ignored."""
        hidden_size = _int(d, "hidden_size")
        num_heads = _int(d, "num_attention_heads")
        num_kv_heads = _int(d, "num_key_value_heads", required=False, default=num_heads)
        assert hidden_size is not None and num_heads is not None and num_kv_heads is not None
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"config field 'num_attention_heads' ({num_heads}) must be a multiple of "
                f"'num_key_value_heads' ({num_kv_heads})"
            )
        head_dim = _int(d, "head_dim", required=False)
        if head_dim is None:
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"config field 'head_dim' is missing and hidden_size={hidden_size} is not divisible by "
                    f"num_attention_heads={num_heads}"
                )
            head_dim = hidden_size // num_heads
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config field 'hidden_act' must be 'silu' for SDAR, got {hidden_act!r}")
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rope_parameters = d.get("rope_parameters")  # transformers 5 spelling of the same two fields
        if isinstance(rope_parameters, dict):
            if rope_theta is None:
                rope_theta = rope_parameters.get("rope_theta")
            if rope_scaling is None and rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = rope_parameters
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise ValueError(f"config field 'rope_scaling' must be an object or null, got {rope_scaling!r}")
        torch_dtype = d.get("torch_dtype", d.get("dtype"))
        if torch_dtype is not None and not isinstance(torch_dtype, str):
            raise ValueError(f"config field 'torch_dtype' must be a string, got {torch_dtype!r}")
        architectures = d.get("architectures") or []
        return cls(
            vocab_size=_int(d, "vocab_size"),  # type: ignore[arg-type]
            hidden_size=hidden_size,
            intermediate_size=_int(d, "intermediate_size"),  # type: ignore[arg-type]
            num_hidden_layers=_int(d, "num_hidden_layers"),  # type: ignore[arg-type]
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            rope_theta=_float({"rope_theta": rope_theta}, "rope_theta", 1_000_000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(d, "max_position_embeddings", required=False, default=32768),  # type: ignore[arg-type]
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            attention_bias=_bool(d, "attention_bias", False),
            hidden_act=hidden_act,
            mask_token_id=_token_id(d, "mask_token_id"),
            bos_token_id=_token_id(d, "bos_token_id"),
            eos_token_id=_token_ids(d, "eos_token_id"),
            block_size=_int(d, "block_size", required=False),
            torch_dtype=torch_dtype,
            model_type=str(d.get("model_type", "sdar")),
            architectures=list(architectures),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> SDARConfig:
        """Read ``<model_dir>/config.json``; errors name the file."""
        try:
            return cls.from_dict(read_config_dict(model_dir))
        except ValueError as e:
            raise ValueError(f"{Path(model_dir) / 'config.json'}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


HFConfigReaders.register("sdar")(SDARConfig.from_pretrained)


def load_hf_config(model_dir: str | Path, model_name: str) -> Any:
    """The typed config of the checkpoint in `model_dir`, read by the reader registered for `model_name`."""
    return HFConfigReaders.get(model_name)(model_dir)


# model_type (as written in config.json) -> engine model_name, for types that identify the family alone.
_MODEL_TYPE_TO_NAME = {
    "sdar": "sdar",
    "sdar_moe": "sdar_moe",
    "Dream": "dream",
    "llada": "llada",
    "llada2_moe": "llada2",
    "diffusion_gemma": "diffusion_gemma",
    "Fast_dLLM_Qwen": "fast_dllm_v2",
    "fast_dllm_v2": "fast_dllm_v2",
}

# Substring of an architecture name -> model_name; checked first, because some families reuse a generic
# model_type (Stable-DiffCoder says "llama").
_ARCHITECTURE_TO_NAME = {
    "StableDiffcoder": "stable_diffcoder",
    "Fast_dLLM_Qwen": "fast_dllm_v2",
    "FastdLLMV2": "fast_dllm_v2",
    "SDARMoe": "sdar_moe",
    "SDARFor": "sdar",
    "LLaDA2Moe": "llada2",
    "DiffusionGemma": "diffusion_gemma",
}


def model_type_to_model_name(model_type: str | None, architectures: list[str] | None) -> str | None:
    """The engine ``model_name`` for a checkpoint's ``model_type``/``architectures``; None if unknown."""
    for arch in architectures or []:
        for needle, name in _ARCHITECTURE_TO_NAME.items():
            if needle in arch:
                return name
    if model_type is None:
        return None
    return _MODEL_TYPE_TO_NAME.get(model_type)
