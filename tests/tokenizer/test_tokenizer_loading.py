"""Tokenizers load without remote code (and without transformers where the folder allows), give the real Qwen ids,
yield the engine's stop and mask ids, and name what is wrong with a folder they cannot load."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from diffulex.testing import tiny_special_token_ids, write_qwen_tokenizer, write_tiny_checkpoint
from diffulex.testing.checkpoints import sdar_reference_dir
from diffulex.tokenizer import (
    CheckpointTokenizer,
    build_qwen2_tokenizer,
    load_tokenizer,
    resolve_mask_token_id,
    stop_token_ids,
)

HELLO = "Hello world, 你好<|im_end|>"
HELLO_IDS = [9707, 1879, 11, 220, 108386, 151645]

@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (sdar_reference_dir() / "vocab.json").is_file():
        pytest.skip("the real SDAR tokenizer files are not available")
    return write_qwen_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path):
    return load_tokenizer(qwen_dir)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


# ----- the real SDAR / Qwen tokenizer (vocab.json + merges.txt, no tokenizer.json) ------------------------


def test_the_real_sdar_tokenizer_gives_qwen_ids(qwen, qwen_dir):
    assert not (qwen_dir / "tokenizer.json").exists()
    assert qwen.encode(HELLO, add_special_tokens=False) == HELLO_IDS
    assert qwen.encode(HELLO) == HELLO_IDS  # no BOS is added
    assert qwen.decode(HELLO_IDS) == HELLO
    assert len(qwen) == 151670


def test_the_real_sdar_mask_id_is_151669(qwen, qwen_dir):
    assert resolve_mask_token_id(qwen, None, qwen_dir, None) == 151669
    assert qwen.convert_tokens_to_ids("<|MASK|>") == 151669


def test_the_real_sdar_config_gives_mask_and_stop_ids():
    real = sdar_reference_dir()
    if not (real / "config.json").is_file():
        pytest.skip("the real SDAR files are not available")
    from diffulex.models.family import load_hf_config

    tok = load_tokenizer(real)
    assert resolve_mask_token_id(tok, load_hf_config(real, "sdar"), real, 151669) == 151669
    assert stop_token_ids(tok, real) == {151643, 151645}


def test_a_vocabulary_only_folder_is_built_by_diffulex_as_qwen2_bpe(qwen, qwen_dir):
    assert isinstance(qwen, CheckpointTokenizer) and qwen.source.startswith("vocab.json + merges.txt")
    built = build_qwen2_tokenizer(qwen_dir)
    text = (
        "Hello world, 你好<|im_end|>\n  def f(x):\n\treturn x ** 2  # 1234567 café naïve ﬁ\r\n\n"
        "<|im_start|>user\nWhat's 12+30?<|im_end|>\n<think>ok</think> 😀 Ünïcödé   end  "
    )
    assert built.encode(text) == qwen.encode(text)
    assert built.decode(built.encode(text)) == text
    assert len(built) == len(qwen)
    assert (built.mask_token_id, built.eos_token_id, built.pad_token_id) == (151669, 151643, 151643)


def test_the_real_chat_template_renders_qwen_turns(qwen):
    messages = [{"role": "user", "content": "hi"}]
    prompt = qwen.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_write_qwen_tokenizer_names_the_folder_when_the_files_are_absent(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        write_qwen_tokenizer(tmp_path / "out", source=tmp_path / "nowhere")


# ----- the tiny tokenizer ---------------------------------------------------------------------------------


def test_the_tiny_tokenizer_loads_with_its_special_ids(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    ids = tiny_special_token_ids()
    assert ids == {"<|endoftext|>": 376, "<|im_start|>": 377, "<|im_end|>": 378, "<|MASK|>": 379}
    assert len(tok) == 380
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (376, 376, 379)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [377, 378]
    text = "The answer is 42.<|im_end|>"
    assert tok.encode(text)[-1] == 378 and tok.decode(tok.encode(text)) == text


def test_stop_ids_of_the_tiny_checkpoint_include_im_end_and_endoftext(tiny_dir):
    assert stop_token_ids(load_tokenizer(tiny_dir), tiny_dir) == {376, 378}


def test_stop_ids_gather_the_tokenizer_config_and_generation_config(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, None, 376]}))
    assert stop_token_ids(load_tokenizer(tmp_path), tmp_path) == {376, 5, 7}


# ----- mask id resolution order ---------------------------------------------------------------------------


def _copy_tokenizer(src: Path, dst: Path, *, drop_mask: bool) -> Path:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    if drop_mask:
        config.pop("mask_token", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_the_config_mask_id_wins(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    assert resolve_mask_token_id(tok, SimpleNamespace(mask_token_id=12), tiny_dir, 3) == 12


def test_the_tokenizer_mask_comes_next(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    assert resolve_mask_token_id(tok, SimpleNamespace(mask_token_id=None), tiny_dir, 3) == 379


@pytest.mark.parametrize("entry", ["<|im_start|>", {"content": "<|im_start|>", "special": True}])
def test_then_special_tokens_map_mask_token(tiny_dir, tmp_path, entry):
    folder = _copy_tokenizer(tiny_dir, tmp_path / "t", drop_mask=True)
    tok = load_tokenizer(folder)
    assert tok.mask_token_id is None
    (folder / "special_tokens_map.json").write_text(json.dumps({"mask_token": entry}))
    assert resolve_mask_token_id(tok, None, folder, 3) == 377


def test_then_added_tokens_json_spellings(tiny_dir, tmp_path):
    folder = _copy_tokenizer(tiny_dir, tmp_path / "t", drop_mask=True)
    tok = load_tokenizer(folder)
    (folder / "special_tokens_map.json").write_text(json.dumps({"mask_token": "<MASK>"}))
    (folder / "added_tokens.json").write_text(json.dumps({"<MASK>": 379}))
    assert resolve_mask_token_id(tok, None, folder, 3) == 379


def test_then_the_family_default_if_the_tokenizer_has_that_id(tiny_dir, tmp_path):
    folder = _copy_tokenizer(tiny_dir, tmp_path / "t", drop_mask=True)
    tok = load_tokenizer(folder)
    assert resolve_mask_token_id(tok, None, folder, 300) == 300
    assert resolve_mask_token_id(tok, None, folder, 151669) is None  # not an id of this tokenizer
    assert resolve_mask_token_id(tok, None, folder, None) is None


# ----- errors ---------------------------------------------------------------------------------------------


def test_a_folder_without_tokenizer_files_names_the_folder_and_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "sdar"}))
    with pytest.raises(ValueError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "vocab.json + merges.txt" in message and "config.json" in message


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope")


def test_the_fallback_builder_names_missing_files(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match="merges.txt"):
        build_qwen2_tokenizer(tmp_path)


# ----- folders diffulex does not build go to transformers, and the log says which loader was used -------------


def _gpt2_vocabulary_folder(tiny_dir: Path, folder: Path) -> Path:
    """The tiny BPE as GPT-2 writes it (vocab.json + merges.txt of class GPT2Tokenizer): not a Qwen2 layout."""
    model = json.loads((tiny_dir / "tokenizer.json").read_text())["model"]
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    return folder


def test_a_vocabulary_of_another_tokenizer_class_loads_through_transformers(tiny_dir, tmp_path, caplog):
    folder = _gpt2_vocabulary_folder(tiny_dir, tmp_path / "gpt2")
    with caplog.at_level("INFO", logger="diffulex"):
        tok = load_tokenizer(folder)
    assert not isinstance(tok, CheckpointTokenizer)
    assert "transformers'" in caplog.text and "'GPT2Tokenizer', not a Qwen2-style one" in caplog.text
    assert tok.decode(tok.encode("The old lighthouse", add_special_tokens=False)) == "The old lighthouse"


def test_the_log_names_diffulex_and_the_files_it_built_from(tiny_dir, caplog):
    with caplog.at_level("INFO", logger="diffulex"):
        load_tokenizer(tiny_dir)
    assert f"tokenizer of {tiny_dir}: diffulex's, from tokenizer.json" in caplog.text


def test_a_sentencepiece_only_folder_goes_to_transformers_and_its_failure_is_named(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05not a real sentencepiece model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(ValueError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    assert "neither a tokenizer.json nor vocab.json + merges.txt" in message
    assert "AutoTokenizer failed" in message and "tokenizer.model" in message


def test_a_declared_added_token_id_that_contradicts_the_vocabulary_is_named(tiny_dir, tmp_path):
    folder = _copy_tokenizer(tiny_dir, tmp_path / "t", drop_mask=False)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {"5": {"content": "<|im_end|>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'<\|im_end\|>' has id 5, but the vocabulary gives it id 378"):
        load_tokenizer(folder)


def test_a_declared_special_token_the_vocabulary_lacks_is_added_after_it(tiny_dir, tmp_path):
    folder = _copy_tokenizer(tiny_dir, tmp_path / "t", drop_mask=False)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = [*config.get("extra_special_tokens", []), "<|tool|>"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    assert len(tok) == 381 and tok.convert_tokens_to_ids("<|tool|>") == 380
    assert tok.decode(tok.encode("a<|tool|>b"), skip_special_tokens=True) == "ab"
