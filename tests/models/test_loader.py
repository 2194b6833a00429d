"""Checkpoints load strictly (every problem named, nothing half-loaded); configs load without remote code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffulex.models.family import load_hf_config, model_type_to_model_name
from diffulex.models.hf_config import SDARConfig
from diffulex.models.loader import build_model, checkpoint_files, load_checkpoint
from diffulex.testing import write_tiny_checkpoint
from diffulex.testing.checkpoints import sdar_reference_dir

REAL_SDAR = sdar_reference_dir()


def _rewrite_weights(ckpt: Path, edit) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


# ----- loading weights --------------------------------------------------------------------------------


def test_a_tiny_checkpoint_round_trips_into_the_model(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, seed=7)
    model = build_model("sdar", ckpt, torch.float32, "cpu")
    saved = load_file(str(ckpt / "model.safetensors"))
    state = model.state_dict()
    assert set(state) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert not model.training


def test_sharded_and_single_file_checkpoints_load_to_identical_models(tmp_path):
    single = build_model("sdar", write_tiny_checkpoint(tmp_path / "single", seed=3), torch.float32, "cpu")
    sharded_dir = write_tiny_checkpoint(tmp_path / "sharded", seed=3, shards=3)
    assert len(checkpoint_files(sharded_dir)) == 3
    sharded = build_model("sdar", sharded_dir, torch.float32, "cpu")
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_shards_without_an_index_are_all_read(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, seed=3, shards=2)
    (ckpt / "model.safetensors.index.json").unlink()
    assert [p.name for p in checkpoint_files(ckpt)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    build_model("sdar", ckpt, torch.float32, "cpu")


def test_an_index_naming_a_missing_shard_is_an_error(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        checkpoint_files(ckpt)


def test_a_missing_tensor_is_named(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path)
    _rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_norm\.weight"):
        build_model("sdar", ckpt, torch.float32, "cpu")


def test_a_shape_mismatch_names_the_tensor_its_file_and_both_shapes(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path)
    _rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64)}))
    with pytest.raises(ValueError) as err:
        build_model("sdar", ckpt, torch.float32, "cpu")
    assert "model.layers.0.mlp.up_proj.weight in model.safetensors: checkpoint [96, 64] vs model [128, 64]" in str(
        err.value
    )


def test_an_unexpected_tensor_is_named(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path)
    _rewrite_weights(ckpt, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight"):
        build_model("sdar", ckpt, torch.float32, "cpu")


def test_all_problems_are_reported_together_and_nothing_is_copied(tmp_path):
    good = build_model("sdar", write_tiny_checkpoint(tmp_path / "good", seed=1), torch.float32, "cpu")
    before = {k: v.clone() for k, v in good.state_dict().items()}
    bad = write_tiny_checkpoint(tmp_path / "bad", seed=2)

    def edit(t):
        t.pop("model.norm.weight")
        t["lm_head.weight"] = torch.zeros(3, 3)
        t["surprise"] = torch.zeros(1)

    _rewrite_weights(bad, edit)
    with pytest.raises(ValueError) as err:
        load_checkpoint(good, bad)
    message = str(err.value)
    assert "model.norm.weight" in message and "lm_head.weight" in message and "surprise" in message
    for name, tensor in good.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_derived_rope_frequencies_in_a_checkpoint_are_ignored(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _rewrite_weights(ckpt, lambda t: t.update({name: torch.ones(8)}))
    build_model("sdar", ckpt, torch.float32, "cpu")


def test_a_tied_checkpoint_may_still_carry_lm_head_weight(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    _rewrite_weights(ckpt, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model = build_model("sdar", ckpt, torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_folder_with_only_a_pickle_gets_the_safetensors_error(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="no safetensors weights") as err:
        checkpoint_files(tmp_path)
    assert "pytorch_model.bin" in str(err.value) and "execute code" in str(err.value)


def test_an_empty_folder_has_no_safetensors_weights(tmp_path):
    with pytest.raises(ValueError, match="no safetensors weights"):
        checkpoint_files(tmp_path)


def test_weights_are_cast_to_the_requested_dtype(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, dtype=torch.bfloat16)
    as_fp32 = build_model("sdar", ckpt, torch.float32, "cpu")
    assert {p.dtype for p in as_fp32.parameters()} == {torch.float32}
    from_config = build_model("sdar", ckpt, None, "cpu")  # config.json says bfloat16
    assert {p.dtype for p in from_config.parameters()} == {torch.bfloat16}
    saved = load_file(str(ckpt / "model.safetensors"))
    assert torch.equal(as_fp32.model.norm.weight, saved["model.norm.weight"].float())


# ----- reading config.json ----------------------------------------------------------------------------


def test_the_real_sdar_4b_config_is_read_without_remote_code():
    if not (REAL_SDAR / "config.json").is_file():
        pytest.skip(f"{REAL_SDAR} is not available")
    config = load_hf_config(REAL_SDAR, "sdar")
    assert isinstance(config, SDARConfig)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (2560, 36, 32)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (8, 128, 9728)
    assert (config.vocab_size, config.mask_token_id, config.eos_token_id, config.block_size) == (
        151936,
        151669,
        151643,
        4,
    )
    assert config.rope_theta == 1_000_000 and config.rope_scaling is None and config.torch_dtype == "bfloat16"
    assert not config.tie_word_embeddings and not config.attention_bias


def _minimal(**overrides):
    d = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "some_unknown_key": {"ignored": True},
    }
    d.update(overrides)
    return d


def test_optional_fields_get_qwen3_defaults_and_unknown_keys_are_ignored():
    config = SDARConfig.from_dict(_minimal())
    assert config.head_dim == 16 and config.num_key_value_heads == 4
    assert config.rms_norm_eps == 1e-6 and config.mask_token_id is None and config.eos_token_id is None


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"])
def test_a_missing_required_field_is_named(field, tmp_path):
    d = _minimal()
    del d[field]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"'{field}' is missing"):
        load_hf_config(tmp_path, "sdar")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_size": "64"}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"eos_token_id": [1, "x"]}, "eos_token_id"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"hidden_size": 66}, "head_dim"),
    ],
)
def test_an_invalid_field_is_named(overrides, field):
    with pytest.raises(ValueError, match=field):
        SDARConfig.from_dict(_minimal(**overrides))


def test_eos_token_id_may_be_a_list():
    assert SDARConfig.from_dict(_minimal(eos_token_id=[5, 6])).eos_token_id == [5, 6]


def test_a_missing_config_json_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_hf_config(tmp_path, "sdar")


def test_an_unregistered_model_name_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no_such_family"):
        load_hf_config(tmp_path, "no_such_family")


@pytest.mark.parametrize(
    ("model_type", "architectures", "name"),
    [
        ("sdar", ["SDARForCausalLM"], "sdar"),
        ("sdar_moe", ["SDARMoeForCausalLM"], "sdar_moe"),
        ("Dream", ["DreamModel"], "dream"),
        ("llada", ["LLaDAModelLM"], "llada"),
        ("llada2_moe", ["LLaDA2MoeModelLM"], "llada2"),
        ("diffusion_gemma", ["DiffusionGemmaForBlockDiffusion"], "diffusion_gemma"),
        ("llama", ["StableDiffcoderForCausalLM"], "stable_diffcoder"),
        ("Fast_dLLM_Qwen", ["Fast_dLLM_QwenForCausalLM"], "fast_dllm_v2"),
        ("fast_dllm_v2", [], "fast_dllm_v2"),
        ("llama", ["LlamaForCausalLM"], None),
        ("qwen3", None, None),
    ],
)
def test_model_type_maps_to_the_engine_model_name(model_type, architectures, name):
    assert model_type_to_model_name(model_type, architectures) == name
