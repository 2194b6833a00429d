"""Reading a checkpoint's ``config.json`` into our own typed config classes, never through remote code.

Real diffusion-LM checkpoints ship their config class as Python code (``auto_map`` ->
``configuration_*.py``); loading it through ``transformers.AutoConfig`` would need ``trust_remote_code=True``,
i.e. executing files from the checkpoint folder. Instead each family declares the fields it uses in a
dataclass here and reads the JSON itself: unknown keys are ignored, missing or invalid required fields are a
``ValueError`` naming the field. Sizes are also bounded above (`MAX_LAYERS`, `MAX_EXPERTS`, `MAX_WIDTH`,
`MAX_POSITIONS`): the model is built from them before any weight is read, so an enormous value must be refused
here rather than turn into minutes of module construction or an allocation the machine cannot make.

The dense families (SDAR, Dream, DiffuCoder, Dream reasoner, Stable-DiffCoder, Fast-dLLM v2) share one reader,
`DenseDecoderConfig`, for the HF-style (Qwen2 / Qwen3 / Llama) field names; each family's subclass states only
what differs (defaults, extra fields, its mask token string). LLaDA has OLMo field names and its own reader.

``load_hf_config(model_dir, model_name)`` picks the reader registered for the engine's ``model_name``;
``model_type_to_model_name`` guesses that name from ``config.json`` when the user did not give one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from diffulex.checkpoint_folder import checkpoint_path

# Upper bounds on the sizes a config.json may state: far above any published model, low enough that the model built
# from them (before its weights are read) cannot take minutes or exhaust memory by itself.
MAX_LAYERS = 1024
MAX_EXPERTS = 4096
MAX_WIDTH = 1 << 20  # hidden, intermediate and head sizes, head counts, vocabulary
MAX_POSITIONS = 1 << 24  # the rotary table holds this many positions
# A norm's epsilon guards a division by a variance: published models use 1e-6 to 1e-5, and from about 1 on it
# outweighs the variance of typical hidden states, so every layer's output shrinks towards zero.
MAX_NORM_EPS = 1.0
# The weight dtypes a checkpoint may declare (``torch_dtype``, with or without ``torch.``): the float ones. An
# integer or 8-bit float dtype means a quantized checkpoint, whose weights need scales this loader does not read.
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16", "float64", "float", "half", "bf16", "fp16", "fp32")
# Token ids of the file that must name a row of the vocabulary (the mask token is checked by the engine).
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# The upper bound of each size field (by its JSON name, in every family); other integer fields get MAX_WIDTH.
SIZE_LIMITS = {
    "num_hidden_layers": MAX_LAYERS,
    "n_layers": MAX_LAYERS,
    "first_k_dense_replace": MAX_LAYERS,
    "decoder_sparse_step": MAX_LAYERS,
    "num_experts": MAX_EXPERTS,
    "num_experts_per_tok": MAX_EXPERTS,
    "num_shared_experts": MAX_EXPERTS,
    "n_group": MAX_EXPERTS,
    "topk_group": MAX_EXPERTS,
    "max_position_embeddings": MAX_POSITIONS,
    "max_sequence_length": MAX_POSITIONS,
}


def read_config_dict(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint folder (which must not lead outside it: `checkpoint_path`)."""
    path = checkpoint_path(model_dir, "config.json")
    if not path.is_file():
        raise FileNotFoundError(f"{Path(model_dir)} has no config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


# ----- field readers: each validates one value and names the field when it is wrong ------------------------


def _int(d: dict[str, Any], key: str, *, required: bool = True, default: int | None = None) -> int | None:
    value = d.get(key)
    if value is None:
        if required:
            raise ValueError(f"config field {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive integer, got {value!r}")
    return _bounded(key, value)


def _bounded(key: str, value: int) -> int:
    limit = SIZE_LIMITS.get(key, MAX_WIDTH)
    if value > limit:
        raise ValueError(f"config field {key!r} must be at most {limit}, got {value}")
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


def norm_eps(d: dict[str, Any], key: str, default: float) -> float:
    """A norm epsilon: positive, finite and at most `MAX_NORM_EPS`."""
    return check_norm_eps(key, _float(d, key, default))


def check_norm_eps(key: str, value: float) -> float:
    """``value`` of config field ``key`` if it is at most `MAX_NORM_EPS` (its reader checked it positive)."""
    if value > MAX_NORM_EPS:
        raise ValueError(f"config field {key!r} must be at most {MAX_NORM_EPS:g}, got {value!r}")
    return value


def _float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"config field {key!r} must be a positive finite number, got {value!r}")
    return float(value)


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config field {key!r} must be true or false, got {value!r}")
    return value


def _torch_dtype(d: dict[str, Any]) -> str | None:
    """``torch_dtype``, also under its transformers-5 name ``dtype``."""
    return check_torch_dtype(d.get("torch_dtype", d.get("dtype")))


def check_torch_dtype(value: Any) -> str | None:
    """A checkpoint's declared weight dtype: None or one of `CHECKPOINT_DTYPES`."""
    if value is None:
        return None
    if not isinstance(value, str) or value.removeprefix("torch.") not in CHECKPOINT_DTYPES:
        raise ValueError(
            f"config field 'torch_dtype' must be a float dtype ({', '.join(CHECKPOINT_DTYPES[:4])}); quantized "
            f"checkpoints are not supported, got {value!r}"
        )
    return value


def _architectures(d: dict[str, Any]) -> list[str]:
    value = d.get("architectures") or []
    return list(value) if isinstance(value, list) else []


def _rope_fields(d: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """``rope_theta`` and ``rope_scaling``, also from the transformers-5 ``rope_parameters`` spelling."""
    rope_scaling = d.get("rope_scaling")
    rope_theta = d.get("rope_theta")
    rope_parameters = d.get("rope_parameters")
    if isinstance(rope_parameters, dict):
        if rope_theta is None:
            rope_theta = rope_parameters.get("rope_theta")
        if rope_scaling is None and rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = rope_parameters
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ValueError(f"config field 'rope_scaling' must be an object or null, got {rope_scaling!r}")
    return _float({"rope_theta": rope_theta}, "rope_theta", default_theta), rope_scaling


def _heads(d: dict[str, Any], hidden_size: int) -> tuple[int, int, int]:
    num_heads = _int(d, "num_attention_heads")
    num_kv_heads = _int(d, "num_key_value_heads", required=False, default=num_heads)
    assert num_heads is not None and num_kv_heads is not None
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
    return num_heads, num_kv_heads, head_dim


def find_added_token_id(model_dir: str | Path, content: str) -> int | None:
    """The id of the added token `content` as written in a checkpoint's tokenizer files, else None.

    Read from the JSON files only (``added_tokens.json``, ``tokenizer_config.json`` ``added_tokens_decoder``,
    ``tokenizer.json`` ``added_tokens``), without building the tokenizer. Families whose ``config.json`` does
    not carry ``mask_token_id`` (Fast-dLLM v2, Stable-DiffCoder) name their mask token by its string; this
    turns it into the id of the checkpoint at hand.
    """
    folder = Path(model_dir)

    def load(name: str) -> Any:
        path = checkpoint_path(folder, name)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    added = load("added_tokens.json")
    if isinstance(added, dict):
        value = added.get(content)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    tok_config = load("tokenizer_config.json")
    if isinstance(tok_config, dict) and isinstance(tok_config.get("added_tokens_decoder"), dict):
        for id_str, entry in tok_config["added_tokens_decoder"].items():
            text = entry.get("content") if isinstance(entry, dict) else entry
            if text == content and str(id_str).isdigit():
                return int(id_str)
    tok_json = load("tokenizer.json")
    if isinstance(tok_json, dict) and isinstance(tok_json.get("added_tokens"), list):
        for entry in tok_json["added_tokens"]:
            if isinstance(entry, dict) and entry.get("content") == content and isinstance(entry.get("id"), int):
                return int(entry["id"])
    return None


class HFConfig:
    """What every family's config class does with its file, whatever its field names: `from_dict` (per family)
    validates the JSON; `from_pretrained` names the file in errors and, when ``config.json`` has no
    ``mask_token_id``, looks the family's ``mask_token`` string up in the tokenizer files."""

    # The family's mask token string (None = do not look it up).
    mask_token: ClassVar[str | None] = None
    # config.json's name of a field the engine reads under its HF-style name, where the family spells it otherwise.
    json_names: ClassVar[dict[str, str]] = {}

    @classmethod
    def json_name(cls, attr: str) -> str:
        """The key in the family's ``config.json`` that sets `attr`, for error messages."""
        return cls.json_names.get(attr, attr)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """Validate and copy the known fields of a config dict; other keys are ignored."""
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Self:
        """Read ``<model_dir>/config.json``; errors name the file."""
        try:
            config = cls.from_dict(read_config_dict(model_dir))
            _check_token_ids(config)
        except ValueError as e:
            raise ValueError(f"{Path(model_dir) / 'config.json'}: {e}") from None
        if getattr(config, "mask_token_id", None) is None and cls.mask_token is not None:
            config.mask_token_id = find_added_token_id(model_dir, cls.mask_token)  # type: ignore[attr-defined]
        return config

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


def _check_token_ids(config: HFConfig) -> None:
    """An id past the vocabulary is never generated (an end token that can never end an answer) and cannot be
    embedded (a begin or pad token)."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        return
    for name in TOKEN_ID_FIELDS:
        value = getattr(config, name, None)
        ids = value if isinstance(value, list) else [value]
        if any(i is not None and i >= vocab for i in ids):
            key = config.json_name(name)
            raise ValueError(f"config field {key!r} must be below vocab_size={vocab}, got {value!r}")


# ----------------------------------------------------------------------------------------------------------
# Dense families with HF-style (Qwen2 / Qwen3 / Llama) field names. One reader; each family's subclass says what
# differs from it, so it documents what that family reads.
# ----------------------------------------------------------------------------------------------------------


@dataclass
class DenseDecoderConfig(HFConfig):
    """The fields of a Qwen2 / Qwen3 / Llama style ``config.json`` that the dense families use.

    Which of the bias / norm options a family applies is decided by its model class (Dream forces q/k/v bias,
    for example); the config only records what the file says. A field's default here is also what a file that
    leaves the key out gets (a family overrides ``rope_theta``'s, for example).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    model_type: str = ""
    architectures: list[str] = field(default_factory=list)

    # The family's name in error messages.
    family: ClassVar[str] = "dense"
    # Optional positive-integer fields a family adds to the ones above (its block size, for example).
    extra_int_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """Validate and copy the known fields of a config dict; other keys are ignored."""
        hidden_size = _int(d, "hidden_size")
        assert hidden_size is not None
        num_heads, num_kv_heads, head_dim = _heads(d, hidden_size)
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config field 'hidden_act' must be 'silu' for {cls.family}, got {hidden_act!r}")
        if d.get("use_sliding_window") is True:
            raise ValueError(f"config field 'use_sliding_window' is true: sliding-window attention is not "
                             f"supported for {cls.family}")
        rope_theta, rope_scaling = _rope_fields(d, cls.rope_theta)
        return cls(
            vocab_size=_int(d, "vocab_size"),  # type: ignore[arg-type]
            hidden_size=hidden_size,
            intermediate_size=_int(d, "intermediate_size"),  # type: ignore[arg-type]
            num_hidden_layers=_int(d, "num_hidden_layers"),  # type: ignore[arg-type]
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=norm_eps(d, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(d, "max_position_embeddings", required=False, default=32768),  # type: ignore[arg-type]
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            attention_bias=_bool(d, "attention_bias", False),
            mlp_bias=_bool(d, "mlp_bias", False),
            hidden_act=hidden_act,
            mask_token_id=_token_id(d, "mask_token_id"),
            bos_token_id=_token_id(d, "bos_token_id"),
            eos_token_id=_token_ids(d, "eos_token_id"),
            pad_token_id=_token_id(d, "pad_token_id"),
            torch_dtype=_torch_dtype(d),
            model_type=str(d.get("model_type", cls.model_type)),
            architectures=_architectures(d),
            **{key: _int(d, key, required=False) for key in cls.extra_int_fields},
        )


@dataclass
class SDARConfig(DenseDecoderConfig):
    """SDAR (``model_type: "sdar"``): a Qwen3 config plus ``block_size``, the block length it was trained with."""

    rope_theta: float = 1_000_000.0
    model_type: str = "sdar"
    block_size: int | None = None

    family: ClassVar[str] = "SDAR"
    extra_int_fields: ClassVar[tuple[str, ...]] = ("block_size",)


@dataclass
class SDARMoeConfig(SDARConfig):
    """SDAR-MoE (``model_type: "sdar_moe"``, SDAR-30B-A3B): the SDAR fields plus Qwen3-MoE's sparse MLP.

    A layer's MLP is sparse unless it is listed in ``mlp_only_layers`` or ``decoder_sparse_step`` skips it (layer
    ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0``); dense layers use ``intermediate_size``.
    """

    model_type: str = "sdar_moe"
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    decoder_sparse_step: int | None = None
    norm_topk_prob: bool = False
    mlp_only_layers: list[int] = field(default_factory=list)
    family: ClassVar[str] = "SDAR-MoE"
    extra_int_fields: ClassVar[tuple[str, ...]] = (
        "block_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
    )  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        config = super().from_dict(d)
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if getattr(config, key) is None:
                raise ValueError(f"config field {key!r} is missing")
        assert config.num_experts is not None and config.num_experts_per_tok is not None
        if config.num_experts_per_tok > config.num_experts:
            raise ValueError(
                f"config field 'num_experts_per_tok' ({config.num_experts_per_tok}) must be at most "
                f"'num_experts' ({config.num_experts})"
            )
        config.decoder_sparse_step = config.decoder_sparse_step or 1
        config.norm_topk_prob = _bool(d, "norm_topk_prob", False)
        layers = d.get("mlp_only_layers") or []
        if not isinstance(layers, list) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < config.num_hidden_layers for i in layers
        ):
            raise ValueError(
                f"config field 'mlp_only_layers' must list layer indices in [0, {config.num_hidden_layers}), "
                f"got {layers!r}"
            )
        config.mlp_only_layers = list(layers)
        return config

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer `index`'s MLP is the mixture of experts (else the dense SwiGLU)."""
        assert self.decoder_sparse_step is not None
        return index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0


@dataclass
class LLaDA2Config(DenseDecoderConfig):
    """The LLaDA2 family (``model_type: "llada2_moe"``: LLaDA2.0/2.1 mini and flash, and the DMax checkpoints): a
    Ling/Bailing-MoE decoder. HF field names for the sizes; what differs from the dense reader:

    * attention: fused ``query_key_value`` (bias ``use_qkv_bias``), output ``dense`` (bias ``use_bias``), per-head
      q/k RMSNorm (``use_qk_norm``), rotary on the first ``partial_rotary_factor`` of each head;
    * MLP: the first ``first_k_dense_replace`` layers dense (``intermediate_size``), the others a mixture of
      ``num_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token, chosen by sigmoid
      scores with an expert bias, from ``topk_group`` of ``n_group`` groups, weighted times
      ``routed_scaling_factor``, plus ``num_shared_experts`` always-on experts.
    """

    model_type: str = "llada2_moe"
    rope_theta: float = 600_000.0
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    use_qk_norm: bool = True
    expert_bias: bool = True
    use_qkv_bias: bool = False
    use_bias: bool = False
    partial_rotary_factor: float = 1.0
    family: ClassVar[str] = "LLaDA2"
    mask_token: ClassVar[str | None] = "<|mask|>"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        config = super().from_dict(d)
        for key in ("moe_intermediate_size", "num_experts", "num_experts_per_tok"):
            setattr(config, key, _int(d, key))
        config.num_shared_experts = _count(d, "num_shared_experts")
        config.first_k_dense_replace = _count(d, "first_k_dense_replace")
        config.n_group = _int(d, "n_group", required=False, default=1)  # type: ignore[assignment]
        config.topk_group = _int(d, "topk_group", required=False, default=1)  # type: ignore[assignment]
        config.routed_scaling_factor = _float(d, "routed_scaling_factor", 1.0)
        score_function = d.get("score_function", "sigmoid")
        if score_function != "sigmoid":
            raise ValueError(f"config field 'score_function' must be 'sigmoid' for LLaDA2, got {score_function!r}")
        config.use_qk_norm = _bool(d, "use_qk_norm", True)
        config.expert_bias = _bool(d, "moe_router_enable_expert_bias", True)
        config.use_qkv_bias = _bool(d, "use_qkv_bias", False)
        config.use_bias = _bool(d, "use_bias", False)
        factor = _float(d, "partial_rotary_factor", 1.0)
        rotary_dim = int(config.head_dim * factor)
        if factor > 1.0 or rotary_dim % 2 != 0 or rotary_dim == 0:
            raise ValueError(
                f"config field 'partial_rotary_factor' must be in (0, 1] and rotate an even number of the "
                f"{config.head_dim} head dims, got {factor!r}"
            )
        config.partial_rotary_factor = factor
        return config

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sparse_layer(self, index: int) -> bool:
        return index >= self.first_k_dense_replace


def _count(d: dict[str, Any], key: str) -> int:
    """A non-negative integer field that may be absent or null (0)."""
    value = d.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config field {key!r} must be a non-negative integer, got {value!r}")
    return _bounded(key, value)


@dataclass
class DreamConfig(DenseDecoderConfig):
    """Dream-v0 / Dream-Coder / DiffuCoder (``model_type: "Dream"``, Qwen2.5 geometry) and the Qwen3-style Dream
    reasoner, which shares the model type. The reasoner's model reads ``attention_bias`` and uses q/k norms;
    the Qwen2.5 model always has q/k/v biases."""

    family: ClassVar[str] = "Dream"
    mask_token: ClassVar[str | None] = "<|mask|>"


@dataclass
class DreamReasonerConfig(DreamConfig):
    """The Qwen3-style Dream reasoner (``model_type: "Dream"``, q/k norms, mask ``<|MASK|>``)."""

    family: ClassVar[str] = "Dream reasoner"
    mask_token: ClassVar[str | None] = "<|MASK|>"


@dataclass
class StableDiffCoderConfig(DenseDecoderConfig):
    """Stable-DiffCoder (``model_type: "llama"``, ``architectures: ["StableDiffcoderForCausalLM"]``): a Llama
    config; ``attention_bias`` applies to q/k/v/o, ``mlp_bias`` to the MLP. Its config.json names no mask token;
    the tokenizer's ``<[MASK_TOKEN]>`` is."""

    rope_theta: float = 500_000.0

    family: ClassVar[str] = "Stable-DiffCoder"
    mask_token: ClassVar[str | None] = "<[MASK_TOKEN]>"


@dataclass
class FastdLLMV2Config(DenseDecoderConfig):
    """Fast-dLLM v2 (``model_type: "Fast_dLLM_Qwen"``): Qwen2.5 with q/k/v bias; ``bd_size`` is its trained block
    (32). The mask token ``|<MASK>|`` is an added token of the tokenizer, not a config field."""

    bd_size: int | None = None

    family: ClassVar[str] = "Fast-dLLM v2"
    mask_token: ClassVar[str | None] = "|<MASK>|"
    extra_int_fields: ClassVar[tuple[str, ...]] = ("bd_size",)


# ----------------------------------------------------------------------------------------------------------
# LLaDA: OLMo field names.
# ----------------------------------------------------------------------------------------------------------


@dataclass
class LLaDAConfig(HFConfig):
    """The fields of a LLaDA (``model_type: "llada"``, OLMo-derived) ``config.json`` that the engine uses.

    Only the configuration the published LLaDA checkpoints use is implemented (``block_type: "llama"``, RMS
    norms with weights, RoPE, SiLU-gated MLP, no ALiBi, no q/k norm, one block per group); anything else is a
    ``ValueError`` naming the field rather than a model that silently computes something else.
    """

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden_size: int
    vocab_size: int
    embedding_size: int
    weight_tying: bool = False
    include_qkv_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    max_sequence_length: int = 4096
    scale_logits: bool = False
    mask_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    model_type: str = "llada"
    architectures: list[str] = field(default_factory=list)

    mask_token: ClassVar[str | None] = "<|mdm_mask|>"
    json_names: ClassVar[dict[str, str]] = {
        "num_hidden_layers": "n_layers",
        "hidden_size": "d_model",
        "vocab_size": "embedding_size",
    }

    # The HF-style names the rest of the engine reads.
    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def max_position_embeddings(self) -> int:
        return self.max_sequence_length

    @property
    def tie_word_embeddings(self) -> bool:
        return self.weight_tying

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        """Validate and copy the known fields of a config dict; other keys are ignored."""
        expected = {
            "block_type": "llama",
            "layer_norm_type": "rms",
            "activation_type": "silu",
            "alibi": False,
            "rope": True,
            "attention_layer_norm": False,
            "include_bias": False,
            "bias_for_layer_norm": False,
            "layer_norm_with_affine": True,
            "input_emb_norm": False,
            "block_group_size": 1,
        }
        for key, want in expected.items():
            value = d.get(key, want)
            if value is None:
                continue
            if value != want or type(value) is not type(want):
                raise ValueError(
                    f"config field {key!r} is {value!r}; only {want!r} (the published LLaDA configuration) is "
                    "supported"
                )
        d_model = _int(d, "d_model")
        n_heads = _int(d, "n_heads")
        assert d_model is not None and n_heads is not None
        if d.get("multi_query_attention") is True:
            n_kv_heads = 1
        else:
            n_kv_heads = _int(d, "n_kv_heads", required=False, default=n_heads)
        assert n_kv_heads is not None
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"config field 'n_heads' ({n_heads}) must be a multiple of 'n_kv_heads' ({n_kv_heads})")
        if d_model % n_heads != 0:
            raise ValueError(f"config field 'd_model' ({d_model}) must be divisible by 'n_heads' ({n_heads})")
        mlp_hidden = _int(d, "mlp_hidden_size", required=False)
        if mlp_hidden is None:
            ratio = _int(d, "mlp_ratio", required=False, default=4)
            assert ratio is not None
            mlp_hidden = ratio * d_model
            if mlp_hidden > MAX_WIDTH:
                raise ValueError(
                    f"config field 'mlp_ratio' ({ratio}) times 'd_model' ({d_model}) gives an MLP width of "
                    f"{mlp_hidden}, more than {MAX_WIDTH}"
                )
        vocab_size = _int(d, "vocab_size")
        embedding_size = _int(d, "embedding_size", required=False, default=vocab_size)
        assert vocab_size is not None and embedding_size is not None
        if embedding_size < vocab_size:
            raise ValueError(f"config field 'embedding_size' ({embedding_size}) is smaller than 'vocab_size' "
                             f"({vocab_size})")
        include_qkv_bias = d.get("include_qkv_bias", d.get("use_qkv_bias", False))
        return cls(
            d_model=d_model,
            n_layers=_int(d, "n_layers"),  # type: ignore[arg-type]
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            mlp_hidden_size=mlp_hidden,
            vocab_size=vocab_size,
            embedding_size=embedding_size,
            weight_tying=_bool(d, "weight_tying", False),
            include_qkv_bias=_bool({"include_qkv_bias": include_qkv_bias}, "include_qkv_bias", False),
            rms_norm_eps=norm_eps(d, "rms_norm_eps", 1e-5),
            rope_theta=_float(d, "rope_theta", 10_000.0),
            max_sequence_length=_int(d, "max_sequence_length", required=False, default=4096),  # type: ignore[arg-type]
            scale_logits=_bool(d, "scale_logits", False),
            mask_token_id=_token_id(d, "mask_token_id"),
            bos_token_id=_token_id(d, "bos_token_id"),
            eos_token_id=_token_ids(d, "eos_token_id"),
            pad_token_id=_token_id(d, "pad_token_id"),
            torch_dtype=_torch_dtype(d),
            model_type=str(d.get("model_type", "llada")),
            architectures=_architectures(d),
        )
