"""DiffuCoder: published in the Dream format and decoded by the Dream code, so ``model_name="diffucoder"`` runs
the Dream model and rule; a DiffuCoder folder says ``model_type: "Dream"`` and is detected as ``dream``. What every
family does is checked in test_families.py."""

from __future__ import annotations

import json

import torch
from family_harness import make_engine, write_real_vocab_checkpoint
from safetensors.torch import load_file

from diffulex.models.dream import DreamForDiffusionLM
from diffulex.models.family import model_type_to_model_name
from diffulex.models.loader import build_model

FAMILY = "diffucoder"


def test_diffucoder_is_the_dream_model_under_its_own_name(peaky):
    raw = json.loads((peaky / "config.json").read_text())
    assert model_type_to_model_name(raw["model_type"], raw["architectures"]) == "dream"
    model = build_model("diffucoder", peaky, torch.float32, "cpu")
    assert type(model) is DreamForDiffusionLM
    saved = load_file(str(peaky / "model.safetensors"))
    assert set(model.state_dict()) == set(saved)


def test_the_real_qwen_tokenizer_gives_diffucoder_the_dream_mask_id(tmp_path):
    ckpt = write_real_vocab_checkpoint(tmp_path, "diffucoder")
    with make_engine(ckpt, model_name="diffucoder", max_model_len=64) as llm:
        assert llm.mask_token_id == 151666 == llm.tokenizer.mask_token_id
