"""diffulex's tokenizer is transformers' tokenizer over the same files: the same ids, the same decoded and streamed
text, the same chat renderings, for every family's tiny tokenizer and for the real Qwen2 vocabulary under each
Qwen-based family's own tokenizer config (as vocab.json + merges.txt, and as a tokenizer.json)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from diffulex.prompts import encode_prompt
from diffulex.server.streams import DenoiseView, TextStream
from diffulex.testing.checkpoints import (
    TINY_TOKENIZERS,
    _tiny_tokenizer_files,
    sdar_reference_dir,
    write_qwen_tokenizer,
)
from diffulex.tokenizer import CheckpointTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

# Each tiny layout once (diffucoder and sdar_moe share dream's and sdar's).
TINY_FAMILIES = sorted({spec: family for family, spec in reversed(TINY_TOKENIZERS.items())}.values())
QWEN_FAMILIES = ("sdar", "fast_dllm_v2", "dream")
TEXTS = [
    "Hello world, 你好",
    "The old lighthouse stood at the end of a long stone pier.",
    "  leading and trailing   whitespace runs \t\t tabs\n\n\nnewlines\r\nCRLF   ",
    "digits 0 12 345 6789 3.14159 1e-10 -42 1,000,000 ٣٤٥ ²³",
    "café naïve ﬁ Ünïcödé e\u0301 한국어 日本語のテキスト עברית العربية 😀👩‍👩‍👧 \u200b\ufeff",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    "What's it? I'll go, they've, we're, she'd... OK!!!",
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?  "},
    ],
    [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon a time"}],
]


def _family_special_text(tok: Any) -> str:
    """Every special token of the tokenizer, written into ordinary text."""
    specials = sorted(tok.all_special_tokens)
    return "x" + " y ".join(specials) + "z" + "".join(specials)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """name -> (the folder diffulex loads, the same files as transformers loads them)."""
    root = tmp_path_factory.mktemp("parity")
    found: dict[str, tuple[Path, Path]] = {}
    for family in TINY_FAMILIES:
        folder = root / f"tiny-{family}"
        folder.mkdir()
        for name, data in _tiny_tokenizer_files(family).items():
            (folder / name).write_bytes(data)
        found[f"tiny-{family}"] = (folder, folder)
    if (sdar_reference_dir() / "vocab.json").is_file():
        for family in QWEN_FAMILIES:
            folder = write_qwen_tokenizer(root / f"qwen-{family}", family)
            reference = folder
            config = json.loads((folder / "tokenizer_config.json").read_text())
            if config.get("tokenizer_class") == "DreamTokenizer":
                # transformers refuses Dream's class without its remote code; Dream's class is Qwen2's, so the
                # reference is the same files naming Qwen2's class.
                reference = root / f"qwen-{family}-as-qwen2"
                shutil.copytree(folder, reference)
                config.pop("auto_map", None)
                (reference / "tokenizer_config.json").write_text(
                    json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"})
                )
            found[f"qwen-{family}"] = (folder, reference)
        # The real vocabulary as a tokenizer.json (how Qwen2.5-based folders ship it), its class still Qwen2's.
        as_json = root / "qwen-sdar-json"
        as_json.mkdir()
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(found["qwen-sdar"][0] / name, as_json / name)
        load_tokenizer(found["qwen-sdar"][0]).backend_tokenizer.save(str(as_json / "tokenizer.json"))
        found["qwen-sdar-json"] = (as_json, as_json)
    return found


def _pairs(folders: dict[str, tuple[Path, Path]]) -> dict[str, tuple[Any, Any]]:
    return {
        name: (load_tokenizer(ours), transformers.AutoTokenizer.from_pretrained(str(ref)))
        for name, (ours, ref) in folders.items()
    }


@pytest.fixture(scope="module")
def pairs(folders: dict[str, tuple[Path, Path]]) -> dict[str, tuple[Any, Any]]:
    return _pairs(folders)


NAMES = [f"tiny-{f}" for f in TINY_FAMILIES] + [f"qwen-{f}" for f in QWEN_FAMILIES] + ["qwen-sdar-json"]


@pytest.fixture(params=NAMES)
def pair(request: pytest.FixtureRequest, pairs: dict[str, tuple[Any, Any]]) -> tuple[Any, Any]:
    if request.param not in pairs:
        pytest.skip("the real Qwen tokenizer files are not available")
    return pairs[request.param]


def test_diffulex_builds_every_supported_family_itself(pair) -> None:
    ours, _ = pair
    assert isinstance(ours, CheckpointTokenizer)


def test_the_vocabulary_and_special_tokens_are_transformers(pair) -> None:
    ours, hf = pair
    assert len(ours) == len(hf)
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token"):
        assert (getattr(ours, name), getattr(ours, f"{name}_id")) == (getattr(hf, name), getattr(hf, f"{name}_id"))
    assert sorted(ours.all_special_tokens) == sorted(hf.all_special_tokens)
    assert ours.get_vocab() == hf.get_vocab()


def test_text_encodes_to_the_same_ids_with_and_without_special_tokens(pair) -> None:
    ours, hf = pair
    for text in [*TEXTS, _family_special_text(hf), "".join(TEXTS)]:
        for add_special_tokens in (False, True):
            assert ours.encode(text, add_special_tokens=add_special_tokens) == hf.encode(
                text, add_special_tokens=add_special_tokens
            ), (text, add_special_tokens)


def test_ids_decode_to_the_same_text_with_and_without_special_tokens(pair) -> None:
    ours, hf = pair
    rng = random.Random(0)
    sequences = [hf.encode(text, add_special_tokens=False) for text in [*TEXTS, _family_special_text(hf)]]
    # Arbitrary id runs too: byte tokens that end inside a UTF-8 character, special ids next to text.
    sequences += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    for ids in sequences:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    assert ours.convert_ids_to_tokens(sequences[0]) == hf.convert_ids_to_tokens(sequences[0])


def _streamed(tok: Any, ids: list[int], chunk: int) -> list[str]:
    stream = TextStream(tok, stop=["Paris", "\n\n"])
    deltas = [stream.update(ids[:end]) for end in range(chunk, len(ids) + chunk, chunk)]
    return [*deltas, stream.finish(tok.decode(ids, skip_special_tokens=True))]


def test_streamed_text_and_denoising_pieces_are_the_same(pair) -> None:
    ours, hf = pair
    ids = hf.encode("".join(TEXTS) + _family_special_text(hf), add_special_tokens=False)
    for chunk in (1, 3, 4):
        assert _streamed(ours, ids, chunk) == _streamed(hf, ids, chunk)
    assert [DenoiseView(ours, 0, 4, 0, 8).piece(i) for i in ids] == [DenoiseView(hf, 0, 4, 0, 8).piece(i) for i in ids]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "multi-turn", "assistant-last"])
def test_chat_templates_render_the_same_text_and_prompt_ids(pair, conversation) -> None:
    ours, hf = pair
    for add_generation_prompt in (False, True):
        rendered = ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert rendered == hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    if conversation[-1]["role"] == "assistant":
        assert ours.apply_chat_template(conversation, tokenize=False, continue_final_message=True) == (
            hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
        )
    for parse in (False, True):
        assert encode_prompt(ours, conversation, mask_token_id=None, parse_special_tokens=parse) == encode_prompt(
            hf, conversation, mask_token_id=None, parse_special_tokens=parse
        )


def test_the_real_template_renders_tools_and_template_switches_the_same(pairs) -> None:
    if "qwen-sdar" not in pairs:
        pytest.skip("the real Qwen tokenizer files are not available")
    ours, hf = pairs["qwen-sdar"]
    parameters = {"type": "object", "properties": {"a": {"type": "number"}}}
    tools = [{"type": "function", "function": {"name": "add", "description": "Add två", "parameters": parameters}}]
    conversation = [*CONVERSATIONS[2], {"role": "assistant", "content": "<think>\nhm\n</think>\n\nRome"}]
    for kwargs in ({"tools": tools}, {"enable_thinking": False}, {}):
        assert ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **kwargs) == (
            hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **kwargs)
        )
    assert ours.apply_chat_template(conversation, add_generation_prompt=True) == list(
        hf.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    )


# ----- the config switches and template layouts some folders use -----------------------------------------------


def _variant(source: Path, folder: Path, **config_changes: Any) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def test_add_bos_and_eos_of_a_vocabulary_only_folder_wrap_each_encoding(folders, tmp_path) -> None:
    if "qwen-sdar" not in folders:
        pytest.skip("the real Qwen tokenizer files are not available")
    folder = _variant(folders["qwen-sdar"][0], tmp_path / "bos", add_bos_token=True, add_eos_token=True,
                      bos_token="<|im_start|>")  # fmt: skip
    ours, hf = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS[:3]:
        ids = ours.encode(text)
        assert ids == hf.encode(text) and ids[0] == ours.bos_token_id and ids[-1] == ours.eos_token_id
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_split_special_tokens_makes_special_token_text_plain_text(folders, tmp_path) -> None:
    folder = _variant(folders["tiny-sdar"][0], tmp_path / "split", split_special_tokens=True)
    ours, hf = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "a<|im_end|>b<|MASK|>"
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert 378 not in ours.encode(text, add_special_tokens=False)


def test_named_chat_templates_are_chosen_as_transformers_chooses(folders, tmp_path) -> None:
    folder = _variant(folders["tiny-sdar"][0], tmp_path / "named",
                      chat_template="{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")  # fmt: skip
    named = folder / "additional_chat_templates"
    named.mkdir()
    tool_use = "TOOLS{{ (tools or []) | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    (named / "tool_use.jinja").write_text(tool_use)
    ours, hf = load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    conversation = CONVERSATIONS[1]
    tools = [{"type": "function", "function": {"name": "f"}}]
    for kwargs in ({}, {"tools": tools}, {"chat_template": "tool_use"}):
        assert ours.apply_chat_template(conversation, tokenize=False, **kwargs) == hf.apply_chat_template(
            conversation, tokenize=False, **kwargs
        ), kwargs
    (folder / "chat_template.jinja").unlink()  # named templates without a default: one must be named
    with pytest.raises(ValueError, match="none is named 'default'; name one of \\['tool_use'\\]"):
        load_tokenizer(folder).apply_chat_template(conversation, tokenize=False)
