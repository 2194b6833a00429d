"""The `tokenizers.Tokenizer` of a checkpoint folder, built from its files without transformers.

Two layouts cover every family the engine serves: a ``tokenizer.json`` (the tokenizers library's own
serialization, loaded as it is) and the Qwen2 pair ``vocab.json`` + ``merges.txt`` that SDAR, Dream and their
relatives ship with a Python tokenizer class named in ``auto_map`` (never executed here). For the pair, the pipeline
is Qwen2's: NFC, the Qwen2 split regex (`QWEN2_SPLIT_PATTERN`), byte-level mapping, BPE, byte-level decoding.

The declared added and special tokens (`diffulex.tokenizer.tokenizer_config`) are then applied the way transformers
applies them: the config's added tokens in id order, then every declared special token is made special (added at
the next id when the vocabulary lacks it). A folder in any other layout (a sentencepiece ``tokenizer.model`` only,
a vocabulary of another tokenizer class) raises `UnsupportedTokenizerFolder`, and the caller hands it to
transformers.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from diffulex.checkpoint_folder import checkpoint_path
from diffulex.tokenizer.files import read_json
from diffulex.tokenizer.tokenizer_config import AddedTokenEntry, TokenizerConfig

# The pre-tokenization regex of Qwen2/Qwen2.5/Qwen3 (digits split one by one).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Tokenizer classes whose vocab.json + merges.txt mean the Qwen2 pipeline (Dream's class is a copy of Qwen2's);
# a folder that names no class is taken as one too, as every vocabulary-only family we serve is Qwen-based.
QWEN2_STYLE_CLASSES = frozenset({"Qwen2Tokenizer", "Qwen2TokenizerFast", "DreamTokenizer", "DreamTokenizerFast"})


class UnsupportedTokenizerFolder(Exception):
    """The folder's tokenizer is in a layout this module does not build (transformers may): the message says why."""


def load_tokenizer_json(folder: Path) -> Tokenizer:
    """``tokenizer.json`` as the tokenizers library reads it; ValueError naming the file if it cannot."""
    path = checkpoint_path(folder, "tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception
        read_json(path)  # invalid JSON is named as such
        raise ValueError(f"{path} is not a valid tokenizer file: {e}") from None


def qwen2_bpe(folder: Path) -> Tokenizer:
    """The Qwen2 byte-level BPE pipeline over ``vocab.json`` + ``merges.txt``, without added tokens."""
    missing = [name for name in ("vocab.json", "merges.txt") if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"cannot build a BPE tokenizer from {folder}: missing {', '.join(missing)}")
    vocab, merges = checkpoint_path(folder, "vocab.json"), checkpoint_path(folder, "merges.txt")
    try:
        bpe = models.BPE.from_file(str(vocab), str(merges), unk_token=None)
    except Exception as e:  # the tokenizers library raises a bare Exception
        read_json(vocab)
        raise ValueError(
            f"cannot build a BPE tokenizer from {folder}: vocab.json + merges.txt are not a valid BPE model: {e}"
        ) from None
    backend = Tokenizer(bpe)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _as_added_token(entry: AddedTokenEntry, *, special: bool | None = None) -> AddedToken:
    return AddedToken(
        entry.content, special=entry.special if special is None else special, normalized=entry.normalized,
        lstrip=entry.lstrip, rstrip=entry.rstrip, single_word=entry.single_word,
    )  # fmt: skip


def _add(backend: Tokenizer, token: AddedToken) -> None:
    (backend.add_special_tokens if token.special else backend.add_tokens)([token])


def _apply_added_tokens(backend: Tokenizer, folder: Path, config: TokenizerConfig) -> None:
    """The config's added tokens, each at the id the config gives it (their flags win over the backend's)."""
    added = backend.get_added_tokens_decoder()  # read once: Gemma-style vocabularies add thousands of tokens
    for token_id, entry in config.added_tokens.items():
        present = backend.token_to_id(entry.content)
        if present is None:
            next_id = backend.get_vocab_size(with_added_tokens=True)
            if token_id != next_id:
                raise ValueError(
                    f"{folder}: added token {entry.content!r} has id {token_id}, but the next free id is {next_id} "
                    "(added ids must follow the vocabulary without gaps)"
                )
        elif present != token_id:
            raise ValueError(
                f"{folder / 'tokenizer_config.json'}: added token {entry.content!r} has id {token_id}, but the "
                f"vocabulary gives it id {present}"
            )
        existing = added.get(token_id)
        wanted = _as_added_token(entry)
        if existing is None or _flags(existing) != _flags(wanted):
            _add(backend, wanted)
            added[token_id] = wanted


def _flags(token: AddedToken) -> tuple[object, ...]:
    return (token.content, token.special, token.normalized, token.lstrip, token.rstrip, token.single_word)


def _apply_declared_specials(backend: Tokenizer, config: TokenizerConfig) -> None:
    """Every declared special token becomes a special added token (appended when the vocabulary lacks it)."""
    by_content = {token.content: token for token in backend.get_added_tokens_decoder().values()}
    flags_of = {config.named_tokens[name]: entry for name, entry in config.named_flags.items()}
    for content in config.special_contents:
        existing = by_content.get(content)
        if existing is not None:
            if not existing.special:
                backend.add_special_tokens([AddedToken(
                    content, special=True, normalized=False, lstrip=existing.lstrip, rstrip=existing.rstrip,
                    single_word=existing.single_word,
                )])  # fmt: skip
            continue
        declared = flags_of.get(content)
        token = (
            _as_added_token(declared, special=True) if declared is not None
            else AddedToken(content, special=True, normalized=False)
        )  # fmt: skip
        backend.add_special_tokens([token])


def _bos_eos_post_processor(backend: Tokenizer, config: TokenizerConfig) -> None:
    """``add_bos_token`` / ``add_eos_token`` of a vocabulary-only folder, as a template around each sequence."""
    bos, eos = config.named_tokens.get("bos_token"), config.named_tokens.get("eos_token")
    add_bos = config.add_bos_token and bos is not None and backend.token_to_id(bos) is not None
    add_eos = config.add_eos_token and eos is not None and backend.token_to_id(eos) is not None
    if not (add_bos or add_eos):
        return
    single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])])
    specials = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def build_backend(folder: Path, config: TokenizerConfig) -> tuple[Tokenizer, str]:
    """The folder's tokenizer and the files it was built from (for the log). Raises ValueError naming the file for
    a damaged one, `UnsupportedTokenizerFolder` for a layout that is not ours to build."""
    if (folder / "tokenizer.json").is_file():
        backend, source = load_tokenizer_json(folder), "tokenizer.json"
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        if config.tokenizer_class is not None and config.tokenizer_class not in QWEN2_STYLE_CLASSES:
            raise UnsupportedTokenizerFolder(
                f"vocab.json + merges.txt of tokenizer class {config.tokenizer_class!r}, not a Qwen2-style one "
                f"({', '.join(sorted(QWEN2_STYLE_CLASSES))})"
            )
        backend, source = qwen2_bpe(folder), "vocab.json + merges.txt (Qwen2 byte-level BPE)"
    else:
        raise UnsupportedTokenizerFolder("neither a tokenizer.json nor vocab.json + merges.txt")
    finish_backend(backend, folder, config, from_tokenizer_json=source == "tokenizer.json")
    return backend, source


def finish_backend(backend: Tokenizer, folder: Path, config: TokenizerConfig, *, from_tokenizer_json: bool) -> None:
    """Apply the folder's declarations to a freshly built backend: added tokens, special tokens, the BOS/EOS
    switches of a vocabulary-only folder (a ``tokenizer.json`` carries its own post-processor, which transformers
    keeps too) and whether special-token text is parsed at all."""
    if config.clean_up_tokenization_spaces and not isinstance(backend.model, models.BPE):
        raise UnsupportedTokenizerFolder("clean_up_tokenization_spaces is set for a non-BPE vocabulary")
    _apply_added_tokens(backend, folder, config)
    _apply_declared_specials(backend, config)
    if not from_tokenizer_json:
        _bos_eos_post_processor(backend, config)
    backend.encode_special_tokens = config.split_special_tokens
