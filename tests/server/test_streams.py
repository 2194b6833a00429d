"""Streamed text decodes a window per chunk, not the whole answer, and sends exactly what decoding everything would."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from diffulex.server.streams import TextStream
from diffulex.testing.checkpoints import write_qwen_tokenizer
from diffulex.tokenizer import load_tokenizer

TEXTS = [
    "The capital of France is Paris.\n\nNext: façade, naïve, 東京, emoji 🙂 and more 🙂🙂 text",
    "  spaced   out  ",
]


class SentencePieceLike:
    """A decoder whose text depends on context, as Metaspace decoders: ``▁`` is a space, and a decode drops the
    space its first piece starts with, so decoding new tokens on their own would lose the space between words."""

    PIECES = ["▁the", "▁cat", "s", "▁sat", ".", "▁on", "▁mat", "▁", "a"]

    def __len__(self) -> int:
        return len(self.PIECES)

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.PIECES[i] for i in token_ids).replace("▁", " ").removeprefix(" ")


class CleaningUp(SentencePieceLike):
    """Also removes the space before a full stop: a decode may rewrite text it gave before."""

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return super().decode(token_ids).replace(" .", ".")


class WholeDecodeStream(TextStream):
    """The reference: every update decodes all the tokens."""

    def _text_of(self, token_ids: list[int]) -> str:
        return self._decode(token_ids)


class CountingTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module", params=["tiny", "qwen", "sentencepiece-like"])
def tokenizer(request, sdar_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    if request.param == "tiny":
        return load_tokenizer(str(sdar_dir))
    if request.param == "sentencepiece-like":
        return SentencePieceLike()
    return load_tokenizer(str(write_qwen_tokenizer(tmp_path_factory.mktemp("qwen"))))


def streamed(stream: TextStream, ids: list[int], chunks: list[int], final: str) -> list[str]:
    deltas, end = [], 0
    for size in chunks:
        end = min(end + size, len(ids))
        deltas.append(stream.update(ids[:end]))
    return [*deltas, stream.finish(final)]


def test_window_decoding_streams_what_whole_decoding_streams(tokenizer) -> None:
    rng = random.Random(0)
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in TEXTS if hasattr(tokenizer, "encode")]
    # arbitrary ids too: byte tokens that end inside a UTF-8 character, special ids among text
    sequences += [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))] for _ in range(40)]
    for ids in sequences:
        final = tokenizer.decode(ids, skip_special_tokens=True)
        for stop in ([], ["Paris", "\n\n", "🙂"]):
            chunks = [rng.randrange(1, 5) for _ in ids]
            ours = streamed(TextStream(tokenizer, stop), ids, chunks, final)
            assert ours == streamed(WholeDecodeStream(tokenizer, stop), ids, chunks, final), ids
            assert "".join(ours) == final


def test_a_long_answer_streamed_a_block_at_a_time_decodes_each_token_a_bounded_number_of_times(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    if hasattr(tokenizer, "encode"):
        ids = tokenizer.encode(" ".join(["a plain sentence of words"] * 80), add_special_tokens=False)
    else:
        ids = [random.Random(1).randrange(len(tokenizer)) for _ in range(400)]
    stream = TextStream(counting)
    for end in range(4, len(ids) + 4, 4):
        stream.update(ids[:end])
    assert stream.sent and tokenizer.decode(ids, skip_special_tokens=True).startswith(stream.sent)
    assert counting.decoded <= 4 * len(ids)  # decoding everything at every block: about len(ids)^2 / 8


def test_a_decoder_that_rewrites_earlier_text_inside_the_window_is_decoded_whole_like_before() -> None:
    tokenizer = CleaningUp()
    ids = [0, 1, 7, 4, 3]  # "the cat " then "." rewrites the space already decoded: "the cat."
    final = tokenizer.decode(ids)
    chunks = [3, 1, 1]
    assert streamed(TextStream(tokenizer), ids, chunks, final) == streamed(WholeDecodeStream(tokenizer), ids,
                                                                           chunks, final)
