"""``load_format="dummy"``: seeded random weights of the checkpoint's shapes, with no weight file at all."""

from __future__ import annotations

import json

import pytest
import torch

from diffulex import Diffulex, SamplingParams
from diffulex.models.loader import build_model
from diffulex.testing import write_tiny_checkpoint


@pytest.fixture
def weightless(tmp_path):
    """A tiny SDAR folder with config.json and tokenizer but no safetensors file; initializer_range 0.05."""
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", attention_bias=True, tie_word_embeddings=True)
    (ckpt / "model.safetensors").unlink()
    config = json.loads((ckpt / "config.json").read_text())
    config["initializer_range"] = 0.05
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def test_dummy_weights_need_no_safetensors_file(weightless):
    with pytest.raises(ValueError, match="has no safetensors weights"):
        build_model("sdar", weightless, torch.float32, "cpu")
    model = build_model("sdar", weightless, torch.float32, "cpu", load_format="dummy")
    assert not model.training


def test_dummy_weights_are_normal_with_the_initializer_range_norms_one_and_biases_zero(weightless):
    model = build_model("sdar", weightless, torch.float32, "cpu", load_format="dummy")
    attn = model.model.layers[0].self_attn
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert torch.equal(attn.q_norm.weight, torch.ones_like(attn.q_norm.weight))
    assert torch.equal(attn.q_proj.bias, torch.zeros_like(attn.q_proj.bias))
    embedding = model.model.embed_tokens.weight
    assert embedding.mean().abs() < 0.01
    assert embedding.std().item() == pytest.approx(0.05, rel=0.1)
    assert model.lm_head.weight is embedding  # tied weights stay one tensor


def test_dummy_weights_follow_the_seed(weightless):
    def weights(seed: int) -> list[torch.Tensor]:
        return list(build_model("sdar", weightless, torch.float32, "cpu", load_format="dummy", seed=seed)
                    .state_dict().values())

    first, again, other = weights(1), weights(1), weights(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])


def test_unknown_load_format_is_rejected(weightless):
    with pytest.raises(ValueError, match="load_format='pt' is invalid"):
        build_model("sdar", weightless, torch.float32, "cpu", load_format="pt")


def test_the_engine_generates_from_a_weightless_folder_with_dummy_weights(weightless):
    with Diffulex(str(weightless), load_format="dummy", seed=3, block_size=4, max_model_len=256) as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    assert out.trajectories[0].num_generated_tokens == 8
