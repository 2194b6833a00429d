"""Tiny checkpoints in the real on-disk format, written at test time (nothing is downloaded).

`write_tiny_checkpoint` produces a folder that looks exactly like a published SDAR checkpoint, scaled
down: ``config.json`` with every key of the real SDAR-4B-Chat config, ``generation_config.json``, safetensors
weights under the real parameter names (single file or index + shards), and a byte-level BPE tokenizer
trained on a small built-in text with the SDAR special tokens. Engine, loader and tokenizer code therefore
run unchanged on it, fast, on CPU.

The other families (``llada``, ``dream``, ``diffucoder``, ``dream_reasoner``, ``stable_diffcoder``,
``fast_dllm_v2``) are written the same way in their own formats: ``write_tiny_checkpoint(path, family=...)``.

`write_qwen_tokenizer` copies the real Qwen2 tokenizer files of SDAR-4B-Chat from a folder holding them (with a
Qwen-based family's own added tokens), for the tests that must see real token ids. `write_tiny_lora_adapter`
writes a PEFT LoRA adapter folder for a tiny checkpoint.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

# The SDAR family's special tokens, in the order they get ids after the BPE vocabulary (as in Qwen).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
BPE_VOCAB_SIZE = 376  # BPE ids; the special tokens follow, so len(tokenizer) == 380
# config vocab_size = len(tokenizer) rounded up to this: padded embedding rows, like real checkpoints.
VOCAB_PAD_MULTIPLE = 64

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Training text for the tiny tokenizer (original prose; arithmetic so digits and operators get merges too).
TINY_CORPUS = """\
The old lighthouse stood at the end of a long stone pier. Every evening the keeper climbed the narrow stairs,
wound the clock of the lamp, and watched the light sweep over the water. Ships passed far out at sea, and the
keeper wrote their names in a thick book: the name, the hour, the wind, and the colour of the sky.

In spring the village below the hill woke early. Farmers walked to their fields before the sun was up, and the
baker opened his door to let the smell of fresh bread into the street. Children ran to school along the river,
counting the ducks, the boats and the bridges as they went. One, two, three bridges; four, five, six boats.

A good question is often better than a quick answer. When you do not know something, say so, then find out.
Read the problem twice, write down what is given and what is asked, and check every step before moving on.
Small careful steps are faster than large careless ones, because you do not have to walk back.

The user asked the assistant a question, and the assistant gave a short and clear answer. Then the user asked
another question about numbers, time and distance. The assistant thought about it step by step and explained
the reasoning in plain words, so that anyone could follow it.

A train leaves the station at 9:15 and arrives at 11:45, so the journey takes 2 hours and 30 minutes.
If a box holds 12 apples and there are 7 boxes, there are 12 * 7 = 84 apples. Half of them is 84 / 2 = 42.
3 + 4 = 7. 10 - 3 = 7. 6 * 7 = 42. 81 / 9 = 9. 2 + 2 = 4. 5 * 5 = 25. 100 - 58 = 42. 15 + 27 = 42.
The answer is 42. The total is 128. The sum of 1, 2, 3, 4 and 5 is 15. 0 1 2 3 4 5 6 7 8 9 10 11 12.
Tom has 3 marbles and finds 5 more; now he has 3 + 5 = 8 marbles. Anna reads 20 pages a day for 6 days,
which is 20 * 6 = 120 pages. The price was $40 and is now $30, a drop of $10, or 25 percent.
"""


@dataclass(frozen=True)
class TinyTokenizerSpec:
    """A family's special tokens, as the tiny tokenizer lays them out.

    ``special_tokens`` get consecutive ids in this order, after the BPE ids (Qwen, LLaDA) or, with
    ``specials_first``, before them starting at 0 (Seed-Coder, whose ``<[MASK_TOKEN]>`` is id 5). ``mask_token``
    is declared as the tokenizer's mask token only where the real tokenizer declares one; a family whose mask
    is just an added token (Fast-dLLM v2's ``|<MASK>|``) leaves it None.
    """

    special_tokens: tuple[str, ...]
    eos_token: str
    pad_token: str | None = None
    bos_token: str | None = None
    mask_token: str | None = None
    additional_special_tokens: tuple[str, ...] = ()
    specials_first: bool = False
    chat_template: str = CHAT_TEMPLATE


LLAMA3_CHAT_TEMPLATE = (
    "{{- '<|startoftext|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SEED_CODER_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<[begin_of_sentence]>' + message['role'] + '\\n' + message['content'] + '<[end_of_sentence]>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<[begin_of_sentence]>assistant\\n' }}{%- endif %}"
)

_QWEN_TURN = ("<|im_start|>", "<|im_end|>")
# Ling / LLaDA2 chat markup: <role>HUMAN</role>...<|role_end|><role>ASSISTANT</role>
LLADA2_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<role>' + message['role'] | upper + '</role>' + message['content'] + '<|role_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<role>ASSISTANT</role>' }}{%- endif %}"
)
TINY_TOKENIZERS: dict[str, TinyTokenizerSpec] = {
    "sdar": TinyTokenizerSpec(
        SPECIAL_TOKENS, "<|endoftext|>", "<|endoftext|>", mask_token="<|MASK|>", additional_special_tokens=_QWEN_TURN
    ),
    # Dream-v0 / DiffuCoder: Qwen2.5 specials, then <|beginoftext|> (bos, 151665) and <|mask|> (151666).
    "dream": TinyTokenizerSpec(
        ("<|endoftext|>", *_QWEN_TURN, "<|beginoftext|>", "<|mask|>"),
        "<|endoftext|>",
        "<|endoftext|>",
        bos_token="<|beginoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=_QWEN_TURN,
    ),
    # Qwen3 specials (<think> 151667, </think> 151668) and <|MASK|> (151669), as in the SDAR/Qwen3 files.
    "dream_reasoner": TinyTokenizerSpec(
        ("<|endoftext|>", *_QWEN_TURN, "<think>", "</think>", "<|MASK|>"),
        "<|endoftext|>",
        "<|endoftext|>",
        mask_token="<|MASK|>",
        additional_special_tokens=_QWEN_TURN,
    ),
    # Qwen2.5-Instruct specials; |<MASK>| (151665) is an additional special token, not a declared mask token.
    "fast_dllm_v2": TinyTokenizerSpec(
        ("<|endoftext|>", *_QWEN_TURN, "|<MASK>|"),
        "<|im_end|>",
        "<|endoftext|>",
        additional_special_tokens=(*_QWEN_TURN, "|<MASK>|"),
    ),
    # LLaDA: <|startoftext|> 126080, <|endoftext|> 126081, <|mdm_mask|> 126336, LLaMA-3 style chat headers and
    # <|eot_id|> 126348.
    # LLaDA2 (Ling tokenizer): <|endoftext|> is eos and pad, <|mask|> the mask.
    "llada2": TinyTokenizerSpec(
        ("<|endoftext|>", "<|mask|>", "<role>", "</role>", "<|role_end|>"),
        "<|endoftext|>",
        "<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=("<role>", "</role>", "<|role_end|>"),
        chat_template=LLADA2_CHAT_TEMPLATE,
    ),
    "llada": TinyTokenizerSpec(
        ("<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|endoftext|>",
        "<|endoftext|>",
        bos_token="<|startoftext|>",
        additional_special_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|mdm_mask|>"),
        chat_template=LLAMA3_CHAT_TEMPLATE,
    ),
    # Seed-Coder / Stable-DiffCoder: bos 0, pad 1, eos 2, <[MASK_TOKEN]> 5. Only the mask string and these ids
    # are the published facts; the other names are this file's placeholders.
    "stable_diffcoder": TinyTokenizerSpec(
        (
            "<[begin_of_sentence]>",
            "<[pad]>",
            "<[end_of_sentence]>",
            "<[reserved_3]>",
            "<[reserved_4]>",
            "<[MASK_TOKEN]>",
        ),
        "<[end_of_sentence]>",
        "<[pad]>",
        bos_token="<[begin_of_sentence]>",
        mask_token="<[MASK_TOKEN]>",
        specials_first=True,
        chat_template=SEED_CODER_CHAT_TEMPLATE,
    ),
}
TINY_TOKENIZERS["diffucoder"] = TINY_TOKENIZERS["dream"]
TINY_TOKENIZERS["sdar_moe"] = TINY_TOKENIZERS["sdar"]
FAMILIES = tuple(TINY_TOKENIZERS)


def _tiny_tokenizer_spec(family: str) -> TinyTokenizerSpec:
    try:
        return TINY_TOKENIZERS[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}") from None


@functools.lru_cache(maxsize=8)
def _tiny_tokenizer_files(family: str = "sdar") -> dict[str, bytes]:
    """Train the tiny tokenizer of `family` once per process and keep the files ``save_pretrained`` wrote."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from diffulex.tokenizer import QWEN2_SPLIT_PATTERN

    spec = _tiny_tokenizer_spec(family)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    first = list(spec.special_tokens) if spec.specials_first else []
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE + len(first),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=first,
    )
    tok.train_from_iterator(TINY_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE + len(first):
        raise RuntimeError(f"tiny BPE training gave {tok.get_vocab_size()} ids, expected {BPE_VOCAB_SIZE}")
    if not spec.specials_first:
        tok.add_special_tokens(list(spec.special_tokens))
    for token, expected in tiny_special_token_ids(family).items():
        if tok.token_to_id(token) != expected:
            raise RuntimeError(f"tiny tokenizer: {token!r} got id {tok.token_to_id(token)}, expected {expected}")

    kwargs = {"eos_token": spec.eos_token}
    for key in ("pad_token", "bos_token", "mask_token"):
        if getattr(spec, key) is not None:
            kwargs[key] = getattr(spec, key)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        additional_special_tokens=list(spec.additional_special_tokens),
        chat_template=spec.chat_template,
        clean_up_tokenization_spaces=False,
        **kwargs,
    )
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def tiny_special_token_ids(family: str = "sdar") -> dict[str, int]:
    """Ids of the tiny tokenizer's special tokens of `family`: after the BPE ids (in `TINY_TOKENIZERS` order),
    or from 0 for families whose specials come first (Stable-DiffCoder)."""
    spec = _tiny_tokenizer_spec(family)
    offset = 0 if spec.specials_first else BPE_VOCAB_SIZE
    return {token: offset + i for i, token in enumerate(spec.special_tokens)}


def tiny_tokenizer_len(family: str = "sdar") -> int:
    return BPE_VOCAB_SIZE + len(_tiny_tokenizer_spec(family).special_tokens)


def _write_weights(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    per_shard = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        filename = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[s * per_shard : (s + 1) * per_shard]}
        save_file(part, str(path / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class _Geometry:
    """The sizes and switches of one tiny checkpoint, as `write_tiny_checkpoint` resolved them."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    block_size: int
    init_std: float
    dtype_name: str
    num_experts: int = 0  # the MoE families' (SDAR-MoE): experts per sparse layer, and their sizes
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()


def write_tiny_checkpoint(
    path: str | Path,
    family: str = "sdar",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.02,
    block_size: int = 4,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    vocab_size: int | None = None,
    real_tokenizer: bool = False,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    mlp_only_layers: tuple[int, ...] = (),
) -> Path:
    """Write a random-weight checkpoint of `family` into `path`; returns the folder.

    `family` is an engine model name: ``sdar``, ``llada``, ``dream``, ``diffucoder``, ``dream_reasoner``,
    ``stable_diffcoder`` or ``fast_dllm_v2``. Each writes its own real format: ``config.json`` with that
    family's keys (OLMo names for LLaDA), weights under its real parameter names, and a tiny tokenizer with its
    special tokens and mask token string (see `TINY_TOKENIZERS`, `tiny_special_token_ids`).

    Deterministic in `seed`. ``vocab_size`` is ``len(tokenizer)`` (380 for SDAR) rounded up to a multiple of
    64 (384): the padding rows have weights like real checkpoints, and the engine must never sample them. SDAR
    special ids: ``<|endoftext|>`` 376 = eos/bos/pad, ``<|im_start|>`` 377, ``<|im_end|>`` 378, ``<|MASK|>``
    379 = mask. ``num_key_value_heads`` defaults to 2 (LLaDA: ``num_attention_heads``, multi-head attention as
    in LLaDA-8B), ``head_dim`` to ``hidden_size / num_attention_heads`` (the only value for the families whose
    config has no ``head_dim``). ``attention_bias`` is q/k/v(/o) bias where the family reads it (SDAR, Dream
    reasoner, Stable-DiffCoder; LLaDA's ``include_qkv_bias``); Dream, DiffuCoder and Fast-dLLM v2 always have
    q/k/v biases. ``mlp_bias`` is Stable-DiffCoder's; ``block_size`` SDAR's. ``vocab_size`` overrides the number
    of embedding rows. ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size`` and
    ``mlp_only_layers`` (layers that keep the dense MLP) are SDAR-MoE's.

    ``real_tokenizer=True`` (Qwen-based families) writes the family's real Qwen tokenizer (`write_qwen_tokenizer`)
    instead of the tiny one, and the config names the real ids (mask 151666 for Dream); ``vocab_size`` then
    defaults to the real checkpoint's (152064 or 151936), so keep ``hidden_size`` small.
    """
    fmt = _checkpoint_format(family)
    if num_key_value_heads is None:
        num_key_value_heads = num_attention_heads if family == "llada" else 2
    derived_head_dim = hidden_size // num_attention_heads
    if head_dim is None:
        head_dim = derived_head_dim
    elif head_dim != derived_head_dim and fmt.derives_head_dim:
        raise ValueError(f"{family} derives head_dim from hidden_size / num_attention_heads = {derived_head_dim}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if real_tokenizer:
        write_qwen_tokenizer(path, family)
        ids = qwen_special_token_ids(family)
        tokenizer_len = max(ids.values()) + 1
        default_vocab = QWEN_FAMILY_VOCAB[family]
    else:
        for name, data in _tiny_tokenizer_files(family).items():
            (path / name).write_bytes(data)
        ids = tiny_special_token_ids(family)
        tokenizer_len = tiny_tokenizer_len(family)
        default_vocab = math.ceil(tokenizer_len / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    if vocab_size is None:
        vocab_size = default_vocab
    elif vocab_size < tokenizer_len:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({tokenizer_len} ids)")
    g = _Geometry(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias, mlp_bias=mlp_bias,
        block_size=block_size, init_std=init_std, dtype_name=str(dtype).removeprefix("torch."),
        num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size, mlp_only_layers=tuple(mlp_only_layers),
    )  # fmt: skip
    config, generation = fmt.configs(ids, g)
    _write_json(path / "config.json", dict(sorted(config.items())))
    _write_json(path / "generation_config.json", generation)
    _write_weights(path, _random_tensors(fmt.tensor_shapes(g), seed, init_std, dtype), shards)
    return path


def _dense_tensor_shapes(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    vocab: int,
    tied: bool,
    *,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm: bool,
    mlp_bias: bool,
) -> dict[str, tuple[int, ...]]:
    """HF Qwen2 / Qwen3 / Llama checkpoint names and shapes, written out independently of the model code."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if qkv_bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (heads * head_dim,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv_heads * head_dim,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv_heads * head_dim,)
        if o_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (hidden,)
        if qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
        if mlp_bias:
            shapes[f"{p}.mlp.gate_proj.bias"] = (inter,)
            shapes[f"{p}.mlp.up_proj.bias"] = (inter,)
            shapes[f"{p}.mlp.down_proj.bias"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _sdar_tensor_shapes(
    hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int, tied: bool, bias: bool
) -> dict[str, tuple[int, ...]]:
    """The real SDAR (Qwen3) checkpoint names and shapes; what an exported SDAR checkpoint must hold."""
    return _dense_tensor_shapes(
        hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied,
        qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False,
    )  # fmt: skip


def _llada_tensor_shapes(
    d_model: int, layers: int, heads: int, kv_heads: int, mlp_hidden: int, vocab: int, tied: bool, qkv_bias: bool
) -> dict[str, tuple[int, ...]]:
    """The real LLaDA (OLMo) checkpoint names and shapes, written out independently of the model code."""
    head_dim = d_model // heads
    t = "model.transformer"
    shapes: dict[str, tuple[int, ...]] = {f"{t}.wte.weight": (vocab, d_model)}
    for i in range(layers):
        p = f"{t}.blocks.{i}"
        shapes[f"{p}.attn_norm.weight"] = (d_model,)
        shapes[f"{p}.q_proj.weight"] = (heads * head_dim, d_model)
        shapes[f"{p}.k_proj.weight"] = (kv_heads * head_dim, d_model)
        shapes[f"{p}.v_proj.weight"] = (kv_heads * head_dim, d_model)
        if qkv_bias:
            shapes[f"{p}.q_proj.bias"] = (heads * head_dim,)
            shapes[f"{p}.k_proj.bias"] = (kv_heads * head_dim,)
            shapes[f"{p}.v_proj.bias"] = (kv_heads * head_dim,)
        shapes[f"{p}.attn_out.weight"] = (d_model, heads * head_dim)
        shapes[f"{p}.ff_norm.weight"] = (d_model,)
        shapes[f"{p}.ff_proj.weight"] = (mlp_hidden, d_model)
        shapes[f"{p}.up_proj.weight"] = (mlp_hidden, d_model)
        shapes[f"{p}.ff_out.weight"] = (d_model, mlp_hidden)
    shapes[f"{t}.ln_f.weight"] = (d_model,)
    if not tied:
        shapes[f"{t}.ff_out.weight"] = (vocab, d_model)
    return shapes


def _random_tensors(
    shapes: dict[str, tuple[int, ...]], seed: int, init_std: float, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        values = torch.randn(shape, generator=gen) * init_std
        if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
            values = 1.0 + values  # norms start near 1, but not exactly, so a wrong norm is visible
        tensors[name] = values.to(dtype).contiguous()
    return tensors


# ----- each family's config.json and generation_config.json, with the keys of its published files ------------


def _qwen_config(g: _Geometry) -> dict:
    """The keys every Qwen2 / Qwen2.5 / Qwen3 ``config.json`` has (SDAR, Dream, Dream reasoner, Fast-dLLM v2)."""
    return {
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": g.hidden_size,
        "initializer_range": g.init_std,
        "intermediate_size": g.intermediate_size,
        "max_position_embeddings": g.max_position_embeddings,
        "max_window_layers": g.num_hidden_layers,
        "num_attention_heads": g.num_attention_heads,
        "num_hidden_layers": g.num_hidden_layers,
        "num_key_value_heads": g.num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": g.tie_word_embeddings,
        "torch_dtype": g.dtype_name,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": g.vocab_size,
    }


def _generation_config(bos: int, eos: int | list[int], pad: int, version: str, **sampling: object) -> dict:
    """A ``generation_config.json``: the token ids, the family's sampling defaults, the version that wrote it."""
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, **sampling, "transformers_version": version}


def _sdar_configs(ids: dict[str, int], g: _Geometry) -> tuple[dict, dict]:
    """Every key of the real SDAR-4B-Chat ``config.json``."""
    eot = ids["<|endoftext|>"]
    config = {
        **_qwen_config(g),
        "architectures": ["SDARForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        "attention_bias": g.attention_bias,
        "attn_implementation": "flex_attention",
        "block_size": g.block_size,
        "bos_token_id": eot,
        "debug": False,
        "eos_token_id": eot,
        "ep_size": 1,
        "fuse_cross_entropy": True,
        "head_dim": g.head_dim,
        "mask_token_id": ids["<|MASK|>"],
        "micro_forward": False,
        "model_type": "sdar",
        "rope_theta": 1000000,  # an integer in the published file
        "skip_checkpoint": False,
        "transformers_version": "4.52.4",
        "use_cache": False,
        "use_deepep": False,
    }
    sampling = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    return config, _generation_config(eot, [ids["<|im_end|>"], eot], eot, "4.51.0", **sampling)


def _dream_configs(ids: dict[str, int], g: _Geometry) -> tuple[dict, dict]:
    bos, eot = ids["<|beginoftext|>"], ids["<|endoftext|>"]
    config = {
        **_qwen_config(g),
        "architectures": ["DreamModel"],
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": bos,
        "eos_token_id": eot,
        "mask_token_id": ids["<|mask|>"],
        "model_type": "Dream",
        "pad_token_id": eot,
        "transformers_version": "4.46.2",
    }
    return config, _generation_config(bos, eot, eot, "4.46.2")


def _dream_reasoner_configs(ids: dict[str, int], g: _Geometry) -> tuple[dict, dict]:
    eot = ids["<|endoftext|>"]
    config = {
        **_qwen_config(g),
        "architectures": ["DreamForCausalLM"],
        "attention_bias": g.attention_bias,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModelForCausalLM": "modeling_dream.DreamForCausalLM",
        },
        "bos_token_id": eot,
        "eos_token_id": eot,
        "head_dim": g.head_dim,
        "mask_token_id": ids["<|MASK|>"],
        "model_type": "Dream",
        "pad_token_id": eot,
        "transformers_version": "4.51.3",
    }
    return config, _generation_config(eot, [ids["<|im_end|>"], eot], eot, "4.51.3")


def _fast_dllm_v2_configs(ids: dict[str, int], g: _Geometry) -> tuple[dict, dict]:
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    config = {
        **_qwen_config(g),
        "architectures": ["Fast_dLLM_QwenForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
            "AutoModel": "modeling.Fast_dLLM_QwenModel",
            "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
        },
        "bd_size": 32,
        "bos_token_id": eot,
        "conplemenrary_mask": True,  # sic, as published
        "eos_token_id": im_end,
        "layer_types": ["full_attention"] * g.num_hidden_layers,
        "model_type": "Fast_dLLM_Qwen",
        "pad_token_id": im_end,
        "transformers_version": "4.53.1",
    }
    sampling = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
    return config, _generation_config(eot, [im_end, eot], eot, "4.53.1", **sampling)


def _stable_diffcoder_configs(ids: dict[str, int], g: _Geometry) -> tuple[dict, dict]:
    """A Llama ``config.json`` (Seed-Coder geometry); it names no mask token."""
    bos, eos, pad = ids["<[begin_of_sentence]>"], ids["<[end_of_sentence]>"], ids["<[pad]>"]
    config = {
        "architectures": ["StableDiffcoderForCausalLM"],
        "attention_bias": g.attention_bias,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModelForCausalLM": "modeling_stable_diffcoder.StableDiffcoderForCausalLM"},
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": g.head_dim,
        "hidden_act": "silu",
        "hidden_size": g.hidden_size,
        "initializer_range": g.init_std,
        "intermediate_size": g.intermediate_size,
        "max_position_embeddings": g.max_position_embeddings,
        "mlp_bias": g.mlp_bias,
        "model_type": "llama",
        "num_attention_heads": g.num_attention_heads,
        "num_hidden_layers": g.num_hidden_layers,
        "num_key_value_heads": g.num_key_value_heads,
        "pad_token_id": pad,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": g.tie_word_embeddings,
        "torch_dtype": g.dtype_name,
        "transformers_version": "4.46.2",
        "use_cache": True,
        "vocab_size": g.vocab_size,
    }
    return config, _generation_config(bos, eos, pad, "4.46.2")


def _llada_configs(ids: dict[str, int], g: _Geometry) -> tuple[dict, dict]:
    """An OLMo ``config.json`` (``d_model``, ``n_layers``, ...), as LLaDA-8B publishes it."""
    eot = ids["<|endoftext|>"]
    config = {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": g.hidden_size,
        "embedding_dropout": 0.0,
        "embedding_size": g.vocab_size,
        "eos_token_id": eot,
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": g.attention_bias,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": g.init_std,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": ids["<|mdm_mask|>"],
        "max_sequence_length": g.max_position_embeddings,
        "mlp_hidden_size": g.intermediate_size,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": g.num_attention_heads,
        "n_kv_heads": g.num_key_value_heads,
        "n_layers": g.num_hidden_layers,
        "pad_token_id": eot,
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-5,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "torch_dtype": g.dtype_name,
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": g.vocab_size,
        "weight_tying": g.tie_word_embeddings,
    }
    return config, _generation_config(ids["<|startoftext|>"], [eot, ids["<|eot_id|>"]], eot, "4.46.3")


@dataclass(frozen=True)
class _CheckpointFormat:
    """How one family's checkpoint is written: its config files, and which optional tensors its layers carry.

    ``qwen2_biases``: q/k/v biases whatever ``attention_bias`` says and none on o (Qwen2.5); otherwise
    ``attention_bias`` puts biases on q/k/v and o. ``derives_head_dim``: the config has no ``head_dim`` key (it is
    ``hidden_size / num_attention_heads``). ``olmo``: LLaDA's OLMo tensor names instead of the HF ones.
    """

    configs: Callable[[dict[str, int], _Geometry], tuple[dict, dict]]
    qwen2_biases: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    derives_head_dim: bool = False
    olmo: bool = False
    moe: bool = False
    shapes: Callable[[_Geometry], dict[str, tuple[int, ...]]] | None = None  # a layout of its own (LLaDA2)

    def tensor_shapes(self, g: _Geometry) -> dict[str, tuple[int, ...]]:
        if self.shapes is not None:
            return self.shapes(g)
        if self.moe:
            return _with_experts(self._dense_shapes(g), g)
        return self._dense_shapes(g)

    def _dense_shapes(self, g: _Geometry) -> dict[str, tuple[int, ...]]:
        if self.olmo:
            return _llada_tensor_shapes(
                g.hidden_size, g.num_hidden_layers, g.num_attention_heads, g.num_key_value_heads,
                g.intermediate_size, g.vocab_size, g.tie_word_embeddings, g.attention_bias,
            )  # fmt: skip
        return _dense_tensor_shapes(
            g.hidden_size, g.num_hidden_layers, g.num_attention_heads, g.num_key_value_heads, g.head_dim,
            g.intermediate_size, g.vocab_size, g.tie_word_embeddings,
            qkv_bias=self.qwen2_biases or g.attention_bias,
            o_bias=not self.qwen2_biases and g.attention_bias,
            qk_norm=self.qk_norm,
            mlp_bias=self.mlp_bias and g.mlp_bias,
        )  # fmt: skip


def _with_experts(shapes: dict[str, tuple[int, ...]], g: _Geometry) -> dict[str, tuple[int, ...]]:
    """The dense checkpoint's tensors with each sparse layer's MLP replaced by Qwen3-MoE's router and experts."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        sparse = layer is not None and int(layer) not in g.mlp_only_layers
        if sparse and ".mlp." in name:
            if name.endswith("mlp.gate_proj.weight"):
                p = name.removesuffix("gate_proj.weight")
                out[p + "gate.weight"] = (g.num_experts, g.hidden_size)
                for e in range(g.num_experts):
                    out[f"{p}experts.{e}.gate_proj.weight"] = (g.moe_intermediate_size, g.hidden_size)
                    out[f"{p}experts.{e}.up_proj.weight"] = (g.moe_intermediate_size, g.hidden_size)
                    out[f"{p}experts.{e}.down_proj.weight"] = (g.hidden_size, g.moe_intermediate_size)
            continue
        out[name] = shape
    return out


def _sdar_moe_configs(ids: dict[str, int], g: _Geometry) -> tuple[dict, dict]:
    """SDAR's keys with the Qwen3-MoE ones (SDAR-30B-A3B's layout)."""
    config, generation = _sdar_configs(ids, g)
    config.update({
        "architectures": ["SDARMoeForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
            "AutoModel": "modeling_sdar_moe.SDARMoeModel",
            "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
        },
        "model_type": "sdar_moe",
        "num_experts": g.num_experts,
        "num_experts_per_tok": g.num_experts_per_tok,
        "moe_intermediate_size": g.moe_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(g.mlp_only_layers),
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    })  # fmt: skip
    return config, generation


# LLaDA2's tiny layout: layer 0 dense (first_k_dense_replace 1), the others experts in LLADA2_GROUPS groups of
# which one is chosen per token, plus one shared expert.
LLADA2_GROUPS = 2


def _llada2_tensor_shapes(g: _Geometry) -> dict[str, tuple[int, ...]]:
    """The real LLaDA2 (Ling MoE) checkpoint names and shapes, written out independently of the model code."""
    hidden, hd = g.hidden_size, g.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.word_embeddings.weight": (g.vocab_size, hidden)}
    for i in range(g.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        qkv_rows = (g.num_attention_heads + 2 * g.num_key_value_heads) * hd
        shapes[f"{p}.attention.query_key_value.weight"] = (qkv_rows, hidden)
        shapes[f"{p}.attention.query_layernorm.weight"] = (hd,)
        shapes[f"{p}.attention.key_layernorm.weight"] = (hd,)
        shapes[f"{p}.attention.dense.weight"] = (hidden, g.num_attention_heads * hd)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        mlp = f"{p}.mlp"
        if i == 0:
            shapes[f"{mlp}.gate_proj.weight"] = (g.intermediate_size, hidden)
            shapes[f"{mlp}.up_proj.weight"] = (g.intermediate_size, hidden)
            shapes[f"{mlp}.down_proj.weight"] = (hidden, g.intermediate_size)
            continue
        shapes[f"{mlp}.gate.weight"] = (g.num_experts, hidden)
        shapes[f"{mlp}.gate.expert_bias"] = (g.num_experts,)
        inter = g.moe_intermediate_size
        for name in [f"experts.{e}" for e in range(g.num_experts)] + ["shared_experts"]:
            shapes[f"{mlp}.{name}.gate_proj.weight"] = (inter, hidden)
            shapes[f"{mlp}.{name}.up_proj.weight"] = (inter, hidden)
            shapes[f"{mlp}.{name}.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not g.tie_word_embeddings:
        shapes["lm_head.weight"] = (g.vocab_size, hidden)
    return shapes


def _llada2_configs(ids: dict[str, int], g: _Geometry) -> tuple[dict, dict]:
    """The keys of LLaDA2.0-mini's ``config.json``, at the tiny sizes."""
    eot = ids["<|endoftext|>"]
    config = {
        "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {
            "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
        },
        "attention_dropout": 0.0,
        "embedding_dropout": 0.0,
        "eos_token_id": eot,
        "first_k_dense_replace": 1,
        "head_dim": g.head_dim,
        "hidden_act": "silu",
        "hidden_size": g.hidden_size,
        "initializer_range": g.init_std,
        "intermediate_size": g.intermediate_size,
        "max_position_embeddings": g.max_position_embeddings,
        "model_type": "llada2_moe",
        "moe_intermediate_size": g.moe_intermediate_size,
        "moe_router_enable_expert_bias": True,
        "n_group": LLADA2_GROUPS,
        "norm_head": False,
        "norm_topk_prob": True,
        "num_attention_heads": g.num_attention_heads,
        "num_experts": g.num_experts,
        "num_experts_per_tok": g.num_experts_per_tok,
        "num_hidden_layers": g.num_hidden_layers,
        "num_key_value_heads": g.num_key_value_heads,
        "num_shared_experts": 1,
        "output_router_logits": False,
        "pad_token_id": eot,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 600000,
        "rotary_dim": g.head_dim // 2,
        "routed_scaling_factor": 2.5,
        "router_dtype": "fp32",
        "score_function": "sigmoid",
        "tie_word_embeddings": g.tie_word_embeddings,
        "topk_group": 1,
        "torch_dtype": g.dtype_name,
        "transformers_version": "4.52.3",
        "use_bias": False,
        "use_cache": False,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_rmsnorm": True,
        "vocab_size": g.vocab_size,
    }
    return config, _generation_config(eot, eot, eot, "4.52.3")


_DREAM_FORMAT = _CheckpointFormat(_dream_configs, qwen2_biases=True, derives_head_dim=True)
CHECKPOINT_FORMATS: dict[str, _CheckpointFormat] = {
    "sdar": _CheckpointFormat(_sdar_configs, qk_norm=True),
    "sdar_moe": _CheckpointFormat(_sdar_moe_configs, qk_norm=True, moe=True),
    "llada2": _CheckpointFormat(_llada2_configs, shapes=_llada2_tensor_shapes),
    "dream": _DREAM_FORMAT,
    "diffucoder": _DREAM_FORMAT,
    "dream_reasoner": _CheckpointFormat(_dream_reasoner_configs, qk_norm=True),
    "fast_dllm_v2": _CheckpointFormat(_fast_dllm_v2_configs, qwen2_biases=True, derives_head_dim=True),
    "stable_diffcoder": _CheckpointFormat(_stable_diffcoder_configs, mlp_bias=True),
    "llada": _CheckpointFormat(_llada_configs, derives_head_dim=True, olmo=True),
}


def _checkpoint_format(family: str) -> _CheckpointFormat:
    _tiny_tokenizer_spec(family)  # the error for an unknown family names them all
    return CHECKPOINT_FORMATS[family]


def sdar_reference_dir() -> Path:
    """The source checkout's copy of the real SDAR-4B-Chat config and Qwen2 tokenizer files (``tests/data``).

    An installed package has no such folder: callers then take an explicit one."""
    return Path(__file__).resolve().parents[2] / "tests" / "data" / "sdar-4b-chat"


QWEN_TOKENIZER_FILES = (
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


# The Qwen-based families' added tokens beyond Qwen2.5's (ids 151643..151664, shared by all of them).
QWEN25_LAST_SHARED_ID = 151664
QWEN_FAMILY_TOKENS: dict[str, dict[str, int]] = {
    "dream": {"<|beginoftext|>": 151665, "<|mask|>": 151666},
    "fast_dllm_v2": {"|<MASK>|": 151665},
}
QWEN_FAMILY_TOKENS["diffucoder"] = QWEN_FAMILY_TOKENS["dream"]
# Embedding rows of the real checkpoints (Dream-v0-7B / Fast-dLLM-v2-7B: Qwen2.5-7B; Qwen3 / SDAR: 151936).
QWEN_FAMILY_VOCAB = {"sdar": 151936, "sdar_moe": 151936, "dream_reasoner": 151936, "dream": 152064,
                     "diffucoder": 152064, "fast_dllm_v2": 152064}


def qwen_special_token_ids(family: str = "sdar") -> dict[str, int]:
    """The real ids of the special tokens `write_tiny_checkpoint` names for a Qwen-based `family`."""
    base = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
    if family in ("sdar", "sdar_moe", "dream_reasoner"):
        return {**base, "<think>": 151667, "</think>": 151668, "<|MASK|>": 151669}
    if family in QWEN_FAMILY_TOKENS:
        return {**base, **QWEN_FAMILY_TOKENS[family]}
    raise ValueError(f"family {family!r} has no Qwen tokenizer; Qwen-based: {', '.join(QWEN_FAMILY_VOCAB)}")


def write_qwen_tokenizer(path: str | Path, family: str = "sdar", source: str | Path | None = None) -> Path:
    """Write the real Qwen2 tokenizer files of a Qwen-based `family` into `path`, rebuilt offline from the
    SDAR-4B-Chat copy; returns the folder.

    * ``sdar``, ``dream_reasoner``: the SDAR-4B-Chat files as they are (Qwen3 added tokens, 151670 ids, mask
      ``<|MASK|>`` = 151669).
    * ``dream``, ``diffucoder``: the Qwen2.5 added tokens (151643..151664), then ``<|beginoftext|>`` 151665 (bos)
      and ``<|mask|>`` 151666 (the declared mask token), with Dream's own tokenizer class named in
      ``tokenizer_config.json`` (``DreamTokenizer`` via ``auto_map``, which is never executed: the engine builds
      the same byte-level BPE from ``vocab.json`` + ``merges.txt``).
    * ``fast_dllm_v2``: the Qwen2.5 added tokens, then ``|<MASK>|`` 151665 as an additional special token (no
      declared mask token); eos ``<|im_end|>``.

    The BPE files (``vocab.json``, ``merges.txt``) are identical for Qwen2, Qwen2.5 and Qwen3. The files are read
    from `source`, else from the source checkout's `sdar_reference_dir`. Raises FileNotFoundError naming the
    folder if a file is missing.
    """
    if family not in QWEN_FAMILY_VOCAB:
        raise ValueError(f"family {family!r} has no Qwen tokenizer; Qwen-based: {', '.join(QWEN_FAMILY_VOCAB)}")
    source = Path(source) if source is not None else sdar_reference_dir()
    missing = [name for name in QWEN_TOKENIZER_FILES[:3] if not (source / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the real Qwen tokenizer files are not in {source} (missing {', '.join(missing)}); "
            "pass the folder holding SDAR-4B-Chat's tokenizer files as source"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name in QWEN_TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, path / name)
    if family in QWEN_FAMILY_TOKENS:
        _rewrite_added_tokens(path, family)
    return path


def _rewrite_added_tokens(path: Path, family: str) -> None:
    """Replace the Qwen3 additions (ids > 151664) of the copied SDAR files with `family`'s own."""
    extra = QWEN_FAMILY_TOKENS[family]
    added = json.loads((path / "added_tokens.json").read_text(encoding="utf-8"))
    added = {k: v for k, v in added.items() if v <= QWEN25_LAST_SHARED_ID}
    added.update(extra)
    _write_json(path / "added_tokens.json", dict(sorted(added.items())))

    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    decoder = {k: v for k, v in config["added_tokens_decoder"].items() if int(k) <= QWEN25_LAST_SHARED_ID}
    for content, token_id in extra.items():
        decoder[str(token_id)] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }  # fmt: skip
    config["added_tokens_decoder"] = decoder
    qwen25_specials = [t for t in config["additional_special_tokens"] if t not in ("<|MASK|>", "<MASK>")]
    special_map = json.loads((path / "special_tokens_map.json").read_text(encoding="utf-8"))
    special_map["additional_special_tokens"] = qwen25_specials
    if family in ("dream", "diffucoder"):
        config.update(
            additional_special_tokens=qwen25_specials,
            bos_token="<|beginoftext|>",
            mask_token="<|mask|>",
            tokenizer_class="DreamTokenizer",
            auto_map={"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        )
        special_map.update(bos_token="<|beginoftext|>", mask_token="<|mask|>")
    else:  # fast_dllm_v2
        config.pop("mask_token", None)
        config.update(additional_special_tokens=[*qwen25_specials, "|<MASK>|"], eos_token="<|im_end|>")
        special_map["additional_special_tokens"] = [*qwen25_specials, "|<MASK>|"]
        special_map["eos_token"] = "<|im_end|>"
    _write_json(path / "tokenizer_config.json", config)
    _write_json(path / "special_tokens_map.json", special_map)


# Default LoRA targets: the attention projections, under each family's own names (LLaDA's output is attn_out).
LORA_DEFAULT_TARGETS = {"llada": ("q_proj", "k_proj", "v_proj", "attn_out")}
_EMBEDDING_LEAVES = ("embed_tokens", "wte")


def write_tiny_lora_adapter(
    path: str | Path,
    model_dir: str | Path,
    family: str,
    *,
    r: int = 4,
    targets: list[str] | tuple[str, ...] | None = None,
    seed: int = 0,
    lora_alpha: int | None = None,
    init_std: float = 0.5,
) -> Path:
    """Write a PEFT LoRA adapter folder for the checkpoint in `model_dir`, as ``peft`` saves one; returns it.

    ``adapter_config.json`` (PEFT's keys; ``target_modules`` = `targets`, default the attention projections of
    `family`) and ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
    ``...lora_B.weight`` ``[out, r]`` for every 2-D weight of `model_dir` whose module name ends in a target
    (embeddings excepted; for LLaDA the target ``ff_out`` also selects the LM head
    ``model.transformer.ff_out``, as PEFT's suffix matching does). ``lora_alpha`` defaults to ``2 * r``. Both
    matrices are random (a freshly initialised PEFT ``B`` is zero, which would make the adapter invisible);
    ``A`` has std ``1/sqrt(in)`` and ``B`` std `init_std`. Deterministic in `seed`.
    """
    from safetensors import safe_open

    _tiny_tokenizer_spec(family)
    if targets is None:
        targets = LORA_DEFAULT_TARGETS.get(family, ("q_proj", "k_proj", "v_proj", "o_proj"))
    targets = list(targets)
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no safetensors weights")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        module, _, leaf = name.rpartition(".")
        shape = shapes[name]
        if leaf != "weight" or len(shape) != 2 or module.rpartition(".")[2] in _EMBEDDING_LEAVES:
            continue
        if not any(module == t or module.endswith("." + t) for t in targets):
            continue
        out_features, in_features = shape
        a = torch.randn(r, in_features, generator=gen) / math.sqrt(in_features)
        b = torch.randn(out_features, r, generator=gen) * init_std
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    if not tensors:
        raise ValueError(f"targets {targets} select no layer of {model_dir}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": str(model_dir),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": lora_alpha if lora_alpha is not None else 2 * r,
        "lora_dropout": 0.05,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": r,
        "rank_pattern": {},
        "revision": None,
        "target_modules": targets,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    _write_json(path / "adapter_config.json", config)
    return path


# ----- DiffusionGemma: written by transformers' own classes ---------------------------------------------------

# Gemma's special ids come first (<pad> 0, <eos> 1, <bos> 2, <mask> 4, as in the real tokenizer), then the turn
# markers; the published checkpoint's eos list is [<eos>, <turn|>, 50], the tiny one's [<eos>, <turn|>].
DIFFUSION_GEMMA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|turn>' + message['role'] + '\\n' + message['content'] + '<turn|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\\n' }}{%- endif %}"
)
TINY_TOKENIZERS["diffusion_gemma"] = TinyTokenizerSpec(
    ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"),
    "<eos>",
    "<pad>",
    bos_token="<bos>",
    mask_token="<mask>",
    additional_special_tokens=("<|turn>", "<turn|>"),
    specials_first=True,
    chat_template=DIFFUSION_GEMMA_CHAT_TEMPLATE,
)
# Both attention kinds, twice a sliding layer before a full one, the last layer full (as the model requires).
DIFFUSION_GEMMA_LAYER_TYPES = (
    "sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
)  # fmt: skip
# The published generation_config.json's denoising settings (DiffusionGemma-26B-A4B-it).
DIFFUSION_GEMMA_GENERATION = {
    "max_denoising_steps": 48,
    "t_min": 0.4,
    "t_max": 0.8,
    "sampler_config": {"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"},
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
    "max_new_tokens": 256,
}


def write_tiny_diffusion_gemma_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    num_global_key_value_heads: int = 1,
    global_head_dim: int = 32,
    layer_types: tuple[str, ...] = DIFFUSION_GEMMA_LAYER_TYPES,
    sliding_window: int = 8,
    canvas_length: int = 16,
    num_experts: int = 4,
    top_k_experts: int = 2,
    moe_intermediate_size: int = 32,
    init_std: float = 0.02,
    layer_output_scale: float = 1.0,
    published_config_format: bool = True,
) -> Path:
    """Write a random-weight ``DiffusionGemmaForBlockDiffusion`` checkpoint made by transformers itself
    (`DiffusionGemmaConfig`, the model's ``save_pretrained``; float32, a one-layer vision tower included), with
    the tiny Gemma-flavoured tokenizer (`TINY_TOKENIZERS["diffusion_gemma"]`, vocabulary padded to 384 rows).

    transformers initializes every norm weight, ``layer_scalar``, router ``scale`` and ``per_expert_scale`` to 1,
    which would hide a wrong or missing use of any of them; they are redrawn uniformly in [0.5, 1.5] (the encoder's
    layer scalars apart from the decoder's) before saving. ``layer_output_scale`` then multiplies the weights of the
    norms that close each layer's attention and feed-forward parts (``post_attention_layernorm``,
    ``post_feedforward_layernorm``): below 1 the layers only nudge the residual, so the argmax canvases of a greedy
    run settle after a few steps and adaptive stopping is exercised. ``published_config_format`` rewrites
    ``config.json`` the way the published checkpoint spells the global layers (``global_head_dim``,
    ``num_global_key_value_heads``) instead of transformers' ``per_layer_config``; transformers reads both to the
    same model."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name, data in _tiny_tokenizer_files("diffusion_gemma").items():
        (path / name).write_bytes(data)
    ids = tiny_special_token_ids("diffusion_gemma")
    vocab_size = math.ceil(tiny_tokenizer_len("diffusion_gemma") / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    eos_ids = [ids["<eos>"], ids["<turn|>"]]
    text_config = {
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": len(layer_types), "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads, "head_dim": head_dim, "global_head_dim": global_head_dim,
        "num_global_key_value_heads": num_global_key_value_heads, "layer_types": list(layer_types),
        "sliding_window": sliding_window, "num_experts": num_experts, "top_k_experts": top_k_experts,
        "moe_intermediate_size": moe_intermediate_size, "max_position_embeddings": 4096,
        "use_bidirectional_attention": "vision", "initializer_range": init_std, "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"], "eos_token_id": eos_ids,
    }  # fmt: skip
    vision_config = {
        "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
    }  # fmt: skip
    config = DiffusionGemmaConfig(
        text_config=text_config, vision_config=vision_config, canvas_length=canvas_length,
        initializer_range=init_std, eos_token_id=eos_ids, pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if tensor.dim() <= 1 and tensor.is_floating_point() and id(tensor) not in seen:
                seen.add(id(tensor))
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator))
        scaled: set[int] = set()
        for name, tensor in model.state_dict(keep_vars=True).items():
            closing_norm = name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"))
            if closing_norm and id(tensor) not in scaled:  # tied encoder/decoder names: scale once
                scaled.add(id(tensor))
                tensor.mul_(layer_output_scale)
    model.save_pretrained(str(path))
    if published_config_format:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
        data["text_config"].pop("per_layer_config", None)
        data["text_config"]["global_head_dim"] = global_head_dim
        data["text_config"]["num_global_key_value_heads"] = num_global_key_value_heads
        _write_json(path / "config.json", data)
    generation = {**DIFFUSION_GEMMA_GENERATION, "eos_token_id": eos_ids, "pad_token_id": ids["<pad>"],
                  "bos_token_id": ids["<bos>"]}  # fmt: skip
    _write_json(path / "generation_config.json", generation)
    return path
# The published DiffusionGemma-26B-A4B-it config.json (model-families spec §1.11; vision config left out): for
# geometry tests and random-weight GPU runs of the real shapes.
DIFFUSION_GEMMA_26B_TEXT_CONFIG = {
    "model_type": "diffusion_gemma_text", "hidden_size": 2816, "num_hidden_layers": 30, "num_attention_heads": 16,
    "num_key_value_heads": 8, "num_global_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512,
    "intermediate_size": 2112, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
    "vocab_size": 262144, "sliding_window": 1024, "max_position_embeddings": 262144,
    "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0, "bos_token_id": 2,
    "use_bidirectional_attention": "vision", "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
}  # fmt: skip
DIFFUSION_GEMMA_26B_CONFIG = {
    "model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"], "canvas_length": 256,
    "eos_token_id": [1, 106, 50], "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880,
    "tie_word_embeddings": True, "text_config": DIFFUSION_GEMMA_26B_TEXT_CONFIG,
}  # fmt: skip
