"""DiffuCoder: published in the Dream format and decoded by the Dream code, so ``model_name="diffucoder"`` runs
the Dream model and rule; a DiffuCoder folder says ``model_type: "Dream"`` and is detected as ``dream``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_harness import check_d2f, check_multi_bd_batch_with_preemption, make_engine
from safetensors.torch import load_file

from diffulex.models.dream import DreamForDiffusionLM
from diffulex.models.hf_config import model_type_to_model_name
from diffulex.models.loader import build_model
from diffulex.testing.checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def peaky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dc") / "peaky", family="diffucoder", seed=7, init_std=1.0)


def test_diffucoder_is_the_dream_model_under_its_own_name(peaky):
    raw = json.loads((peaky / "config.json").read_text())
    assert model_type_to_model_name(raw["model_type"], raw["architectures"]) == "dream"
    model = build_model("diffucoder", peaky, torch.float32, "cpu")
    assert type(model) is DreamForDiffusionLM
    saved = load_file(str(peaky / "model.safetensors"))
    assert set(model.state_dict()) == set(saved)


def test_engine_matches_reference_with_preemption(peaky):
    with make_engine(peaky, model_name="diffucoder", decoding_strategy=None) as llm:
        assert llm.config.decoding_strategy == "d2f" and llm.settings.logits_shift
    check_multi_bd_batch_with_preemption(peaky, model_name="diffucoder")


def test_engine_matches_reference_under_d2f(peaky):
    check_d2f(peaky, model_name="diffucoder")


def test_the_real_qwen_tokenizer_gives_diffucoder_the_dream_mask_id(tmp_path):
    ckpt = write_tiny_checkpoint(
        tmp_path / "real-vocab", family="diffucoder", real_tokenizer=True, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
    )  # fmt: skip
    with make_engine(ckpt, model_name="diffucoder", max_model_len=64) as llm:
        assert llm.mask_token_id == 151666 == llm.tokenizer.mask_token_id
