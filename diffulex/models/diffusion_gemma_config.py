"""Reading a DiffusionGemma checkpoint's ``config.json`` (``model_type: "diffusion_gemma"``) into a typed config.

The file nests the text model under ``text_config`` (``diffusion_gemma_text``) next to a ``vision_config`` this
engine does not use. Everything the network's shape depends on is read here and nowhere else, so the canvas
length, the sliding window and the per-layer head geometry always come from the checkpoint.

Per-layer geometry follows transformers' reading of the same file: a layer's ``head_dim`` and
``num_key_value_heads`` are the text config's, except where ``per_layer_config`` (a dict keyed by layer index,
written by transformers >= 5.x) overrides them; a file without ``per_layer_config`` (the published one) gives every
``full_attention`` layer ``global_head_dim`` (512 when absent) and, when present, ``num_global_key_value_heads``.
Values the network cannot honour (a bidirectional encoder, untied weights, an unknown rotary type) are refused
with an error naming the field, the value and what is allowed, instead of being run wrongly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffulex.models.hf_config import check_norm_eps, check_torch_dtype, read_config_dict

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
# transformers' defaults for keys a config may leave out (`DiffusionGemmaTextConfig`).
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_SLIDING_PATTERN = 6  # five sliding layers, then one full
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
SUPPORTED_ACTIVATION = "gelu_pytorch_tanh"
SUPPORTED_ROPE_TYPES = ("default", "proportional")
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


@dataclass(frozen=True)
class RopeSpec:
    """One layer type's rotary: ``default`` rotates the whole head; ``proportional`` rotates the first
    ``partial_rotary_factor * head_dim / 2`` frequency pairs with exponents over the whole ``head_dim`` and leaves
    the other pairs unrotated (zero frequency), which is how the full-attention layers get partial rotary."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class LayerGeometry:
    """What differs between layers: the attention kind, its head size and its number of K/V heads. Full-attention
    layers have no ``v_proj``: their values are the key projection (before its norm and rotary)."""

    layer_type: str
    head_dim: int
    num_kv_heads: int

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    """The text model of a ``DiffusionGemmaForBlockDiffusion`` checkpoint, validated."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layers: tuple[LayerGeometry, ...]
    sliding_window: int
    rope: dict[str, RopeSpec]
    rms_norm_eps: float
    final_logit_softcapping: float | None
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    max_position_embeddings: int
    canvas_length: int
    image_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    bos_token_id: int | None
    torch_dtype: str | None

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(layer.layer_type for layer in self.layers)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiffusionGemmaConfig:
        """Validate a parsed ``config.json``; errors name the field (``text_config.`` prefixed where nested)."""
        model_type = d.get("model_type")
        if model_type != "diffusion_gemma":
            raise ValueError(f"config field 'model_type' must be 'diffusion_gemma', got {model_type!r}")
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config field 'text_config' must be an object, got {type(text).__name__}")
        if (
            _bool(d, "tie_word_embeddings", True) is not True
            or _bool(text, "tie_word_embeddings", True, "text_config.") is not True
        ):
            raise ValueError(
                "config field 'tie_word_embeddings' must be true: the checkpoint format stores the encoder, decoder "
                "and LM head as one set of tied weights; untied checkpoints are not supported"
            )
        t = "text_config."
        bidirectional = text.get("use_bidirectional_attention")
        if bidirectional not in (None, "vision"):
            raise ValueError(
                f"config field 'text_config.use_bidirectional_attention' must be null or 'vision' (a causal "
                f"encoder for text), got {bidirectional!r}"
            )
        if _bool(text, "attention_bias", False, t):
            raise ValueError("config field 'text_config.attention_bias' must be false (no attention biases), got true")
        activation = text.get("hidden_activation", SUPPORTED_ACTIVATION)
        if activation != SUPPORTED_ACTIVATION:
            raise ValueError(
                f"config field 'text_config.hidden_activation' must be {SUPPORTED_ACTIVATION!r}, got {activation!r}"
            )
        num_layers = _int(text, "num_hidden_layers", t, default=30)
        num_heads = _int(text, "num_attention_heads", t, default=8)
        layer_types = _layer_types(text, num_layers)
        layers = _layer_geometry(text, layer_types, num_heads)
        num_experts = _int(text, "num_experts", t, required=True)
        top_k = _int(text, "top_k_experts", t, required=True)
        if top_k > num_experts:
            raise ValueError(
                f"config field 'text_config.top_k_experts' must be in [1, num_experts={num_experts}], got {top_k}"
            )
        softcap = text.get("final_logit_softcapping", 30.0)
        if softcap is not None:
            softcap = _positive_float(text, "final_logit_softcapping", t, 30.0)
        return cls(
            vocab_size=_int(text, "vocab_size", t, default=262_144),
            hidden_size=_int(text, "hidden_size", t, default=2304),
            intermediate_size=_int(text, "intermediate_size", t, default=9216),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            layers=layers,
            sliding_window=_int(text, "sliding_window", t, default=512),
            rope=_rope(text, layer_types),
            rms_norm_eps=check_norm_eps(f"{t}rms_norm_eps", _positive_float(text, "rms_norm_eps", t, 1e-6)),
            final_logit_softcapping=softcap,
            num_experts=num_experts,
            top_k_experts=top_k,
            moe_intermediate_size=_int(text, "moe_intermediate_size", t, required=True),
            max_position_embeddings=_int(text, "max_position_embeddings", t, default=131_072),
            canvas_length=_int(d, "canvas_length", "", default=256),
            image_token_id=_token_id(d, "image_token_id", ""),
            eos_token_ids=_eos_ids(d, text),
            pad_token_id=_token_id(text, "pad_token_id", t),
            bos_token_id=_token_id(text, "bos_token_id", t),
            torch_dtype=_dtype_name(d, text),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> DiffusionGemmaConfig:
        """Read ``<model_dir>/config.json`` as JSON, inside the folder (`read_config_dict`; nothing in the folder is
        executed); errors name the file."""
        data = read_config_dict(model_dir)
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{Path(model_dir) / 'config.json'}: {e}") from None


def _int(d: dict[str, Any], key: str, prefix: str, default: int | None = None, required: bool = False) -> int:
    value = d.get(key)
    if value is None:
        if required or default is None:
            raise ValueError(f"config field '{prefix}{key}' is missing (a positive integer is required)")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config field '{prefix}{key}' must be a positive integer, got {value!r}")
    return value


def _positive_float(d: dict[str, Any], key: str, prefix: str, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"config field '{prefix}{key}' must be a positive finite number, got {value!r}")
    return float(value)


def _bool(d: dict[str, Any], key: str, default: bool, prefix: str = "") -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"config field '{prefix}{key}' must be true or false, got {value!r}")
    return value


def _token_id(d: dict[str, Any], key: str, prefix: str) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config field '{prefix}{key}' must be a non-negative integer, got {value!r}")
    return value


def _eos_ids(d: dict[str, Any], text: dict[str, Any]) -> tuple[int, ...]:
    """The top-level ``eos_token_id`` (the published config lists three), else the text config's."""
    for prefix, section in (("", d), ("text_config.", text)):
        value = section.get("eos_token_id")
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(
                    f"config field '{prefix}eos_token_id' must be a non-negative integer or a list of them, "
                    f"got {value!r}"
                )
        return tuple(values)
    return ()


def _dtype_name(d: dict[str, Any], text: dict[str, Any]) -> str | None:
    for section in (d, text):
        value = section.get("torch_dtype", section.get("dtype"))
        if value is not None:
            return check_torch_dtype(value)
    return None


def _layer_types(text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    value = text.get("layer_types")
    if value is None:
        types = [SLIDING if (i + 1) % DEFAULT_SLIDING_PATTERN else FULL for i in range(num_layers)]
        types[-1] = FULL
        return tuple(types)
    if not isinstance(value, list) or len(value) != num_layers or any(v not in LAYER_TYPES for v in value):
        raise ValueError(
            f"config field 'text_config.layer_types' must list one of {', '.join(LAYER_TYPES)} per layer "
            f"(num_hidden_layers={num_layers}), got {value!r}"
        )
    if value[-1] != FULL:
        raise ValueError(
            f"config field 'text_config.layer_types' must end with {FULL!r} (the last layer is a global one), "
            f"got {value[-1]!r}"
        )
    return tuple(value)


def _layer_geometry(text: dict[str, Any], layer_types: tuple[str, ...], num_heads: int) -> tuple[LayerGeometry, ...]:
    t = "text_config."
    head_dim = _int(text, "head_dim", t, default=256)
    kv_heads = _int(text, "num_key_value_heads", t, default=4)
    overrides: dict[int, dict[str, int]] = {}
    per_layer = text.get("per_layer_config")
    if per_layer is not None:
        if not isinstance(per_layer, dict):
            raise ValueError(f"config field 'text_config.per_layer_config' must be an object, got {per_layer!r}")
        for key, entry in per_layer.items():
            field = f"text_config.per_layer_config.{key}"
            if not str(key).isdigit() or int(key) >= len(layer_types):
                raise ValueError(f"config field {field!r}: keys must be layer indices in [0, {len(layer_types)})")
            if not isinstance(entry, dict) or set(entry) - set(PER_LAYER_KEYS):
                raise ValueError(f"config field {field!r} may only set {', '.join(PER_LAYER_KEYS)}, got {entry!r}")
            overrides[int(key)] = {name: _int(entry, name, field + ".") for name in entry}
    else:
        global_override = {"head_dim": _int(text, "global_head_dim", t, default=DEFAULT_GLOBAL_HEAD_DIM)}
        if text.get("num_global_key_value_heads") is not None:
            global_override["num_key_value_heads"] = _int(text, "num_global_key_value_heads", t)
        overrides = {i: global_override for i, kind in enumerate(layer_types) if kind == FULL}
    layers = []
    for i, kind in enumerate(layer_types):
        o = overrides.get(i, {})
        geometry = LayerGeometry(kind, o.get("head_dim", head_dim), o.get("num_key_value_heads", kv_heads))
        if num_heads % geometry.num_kv_heads:
            raise ValueError(
                f"layer {i}: num_attention_heads ({num_heads}) must be a multiple of its num_key_value_heads "
                f"({geometry.num_kv_heads})"
            )
        if geometry.head_dim % 2:
            raise ValueError(f"layer {i}: head_dim must be even for rotary, got {geometry.head_dim}")
        layers.append(geometry)
    for kind in set(layer_types):
        dims = {g.head_dim for g in layers if g.layer_type == kind}
        if len(dims) > 1:
            raise ValueError(
                f"every {kind} layer must have the same head_dim (one rotary table per kind), got {sorted(dims)}"
            )
    return tuple(layers)


def _rope(text: dict[str, Any], layer_types: tuple[str, ...]) -> dict[str, RopeSpec]:
    params = text.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(params, dict):
        raise ValueError(f"config field 'text_config.rope_parameters' must be an object, got {params!r}")
    specs = {}
    for kind in sorted(set(layer_types)):
        field = f"text_config.rope_parameters.{kind}"
        entry = params.get(kind)
        if not isinstance(entry, dict):
            raise ValueError(f"config field {field!r} must be an object with 'rope_type' and 'rope_theta'")
        rope_type = entry.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"config field '{field}.rope_type' must be one of {', '.join(SUPPORTED_ROPE_TYPES)}, got {rope_type!r}"
            )
        partial = _positive_float(entry, "partial_rotary_factor", field + ".", 1.0)
        if partial > 1.0 or (rope_type == "default" and partial != 1.0):
            allowed = "1.0 for 'default'" if rope_type == "default" else "(0, 1] for 'proportional'"
            raise ValueError(f"config field '{field}.partial_rotary_factor' must be {allowed}, got {partial}")
        specs[kind] = RopeSpec(
            rope_type=rope_type,
            theta=_positive_float(entry, "rope_theta", field + ".", 10_000.0),
            partial_rotary_factor=partial,
            factor=_positive_float(entry, "factor", field + ".", 1.0) if rope_type == "proportional" else 1.0,
        )
    return specs
