"""Tiny checkpoints in the real on-disk format, written at test time (nothing is downloaded).

`write_tiny_checkpoint` produces a folder that looks exactly like a published SDAR checkpoint, scaled
down: ``config.json`` with every key of the real SDAR-4B-Chat config, ``generation_config.json``, safetensors
weights under the real parameter names (single file or index + shards), and a byte-level BPE tokenizer
trained on a small built-in text with the SDAR special tokens. Engine, loader and tokenizer code therefore
run unchanged on it, fast, on CPU.

`write_qwen_tokenizer` copies the real Qwen2 tokenizer files of SDAR-4B-Chat from the shared data folder, for
the tests that must see real token ids.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import tempfile
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


@functools.lru_cache(maxsize=1)
def _tiny_tokenizer_files() -> dict[str, bytes]:
    """Train the tiny tokenizer once per process and keep the files ``save_pretrained`` wrote."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from diffulex.tokenizer import QWEN2_SPLIT_PATTERN

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(TINY_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"tiny BPE training gave {tok.get_vocab_size()} ids, expected {BPE_VOCAB_SIZE}")
    tok.add_special_tokens(list(SPECIAL_TOKENS))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        fast.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def tiny_special_token_ids() -> dict[str, int]:
    """Ids of the tiny tokenizer's special tokens (they follow the BPE ids, in `SPECIAL_TOKENS` order)."""
    return {token: BPE_VOCAB_SIZE + i for i, token in enumerate(SPECIAL_TOKENS)}


def _sdar_tensor_shapes(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    vocab: int,
    tied: bool,
    bias: bool,
) -> dict[str, tuple[int, ...]]:
    """The real SDAR (Qwen3) checkpoint names and shapes, written out independently of the model code."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.self_attn.q_proj.weight"] = (heads * head_dim, hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_heads * head_dim, hidden)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if bias:
            shapes[f"{p}.self_attn.q_proj.bias"] = (heads * head_dim,)
            shapes[f"{p}.self_attn.k_proj.bias"] = (kv_heads * head_dim,)
            shapes[f"{p}.self_attn.v_proj.bias"] = (kv_heads * head_dim,)
            shapes[f"{p}.self_attn.o_proj.bias"] = (hidden,)
        shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


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


def write_tiny_checkpoint(
    path: str | Path,
    family: str = "sdar",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.02,
    block_size: int = 4,
    attention_bias: bool = False,
) -> Path:
    """Write a random-weight checkpoint of `family` (only ``"sdar"`` today) into `path`; returns the folder.

    Deterministic in `seed`. ``vocab_size`` is ``len(tokenizer)`` (380) rounded up to a multiple of 64 (384):
    the padding rows have weights like real checkpoints, and the engine must never sample them. Special ids:
    see `tiny_special_token_ids` (``<|endoftext|>`` 376 = eos/bos/pad, ``<|im_start|>`` 377, ``<|im_end|>``
    378, ``<|MASK|>`` 379 = mask).
    """
    if family != "sdar":
        raise ValueError(f"write_tiny_checkpoint supports family 'sdar' only, got {family!r}")
    if head_dim is None:
        head_dim = 16
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer_files = _tiny_tokenizer_files()
    for name, data in tokenizer_files.items():
        (path / name).write_bytes(data)
    ids = tiny_special_token_ids()
    tokenizer_len = len(ids) + BPE_VOCAB_SIZE
    vocab_size = math.ceil(tokenizer_len / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    dtype_name = str(dtype).removeprefix("torch.")

    config = {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        "attention_bias": attention_bias,
        "attention_dropout": 0.0,
        "attn_implementation": "flex_attention",
        "bos_token_id": ids["<|endoftext|>"],
        "debug": False,
        "eos_token_id": ids["<|endoftext|>"],
        "block_size": block_size,
        "mask_token_id": ids["<|MASK|>"],
        "ep_size": 1,
        "fuse_cross_entropy": True,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": init_std,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "max_window_layers": num_hidden_layers,
        "micro_forward": False,
        "model_type": "sdar",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "skip_checkpoint": False,
        "sliding_window": None,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype_name,
        "transformers_version": "4.52.4",
        "use_cache": False,
        "use_deepep": False,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    _write_json(path / "config.json", config)
    generation_config = {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "4.51.0",
    }
    _write_json(path / "generation_config.json", generation_config)

    shapes = _sdar_tensor_shapes(
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        intermediate_size,
        vocab_size,
        tie_word_embeddings,
        attention_bias,
    )
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        values = torch.randn(shape, generator=gen) * init_std
        if name.endswith("norm.weight"):
            values = 1.0 + values  # norms start near 1, but not exactly, so a wrong norm is visible
        tensors[name] = values.to(dtype).contiguous()
    _write_weights(path, tensors, shards)
    return path


def shared_sdar_data_dir() -> Path:
    """The shared folder holding the real SDAR-4B-Chat config and Qwen2 tokenizer files."""
    override = os.environ.get("DIFFULEX_SHARED_DATA")
    if override:
        base = Path(override)
        return base if (base / "vocab.json").is_file() else base / "sdar-4b-chat"
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "sdar-4b-chat"


QWEN_TOKENIZER_FILES = (
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def write_qwen_tokenizer(path: str | Path) -> Path:
    """Copy the real Qwen2 tokenizer of SDAR-4B-Chat (151670 ids, mask ``<|MASK|>`` = 151669) into `path`.

    The source is ``DIFFULEX_SHARED_DATA`` (the ``sdar-4b-chat`` folder itself or its parent) or
    ``<repo>/../shared/data/sdar-4b-chat``. Raises FileNotFoundError naming the folder if a file is missing.
    """
    source = shared_sdar_data_dir()
    missing = [name for name in QWEN_TOKENIZER_FILES[:3] if not (source / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the real Qwen tokenizer files are not in {source} (missing {', '.join(missing)}); "
            "set DIFFULEX_SHARED_DATA to the folder holding sdar-4b-chat"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name in QWEN_TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, path / name)
    return path
