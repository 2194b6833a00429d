"""A corrupted or hostile checkpoint folder is refused quickly, with a ValueError naming the file and the problem;
loading never reads outside the folder and never runs code from it."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffulex.models.family import load_hf_config
from diffulex.models.loader import build_model, checkpoint_files, load_checkpoint
from diffulex.testing import write_tiny_checkpoint
from diffulex.testing.checkpoints import FAMILIES
from diffulex.tokenizer import build_qwen2_tokenizer, load_tokenizer

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_2 = "model-00002-of-00002.safetensors"
# A hang is the bug these guard against; a correct refusal reads headers only and takes milliseconds.
REFUSAL_SECONDS = 10.0


def load(ckpt: Path, family: str = "sdar") -> torch.nn.Module:
    return build_model(family, ckpt, torch.float32, "cpu")


def refusal(ckpt: Path, family: str = "sdar") -> str:
    """The message of the ValueError that loading `ckpt` raises."""
    with pytest.raises(ValueError) as err:
        load(ckpt, family)
    return str(err.value)


def edit_config(ckpt: Path, **changes: object) -> None:
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_index(ckpt: Path, shard: str, new_name: str) -> None:
    path = ckpt / INDEX
    index = json.loads(path.read_text())
    index["weight_map"] = {k: new_name if v == shard else v for k, v in index["weight_map"].items()}
    path.write_text(json.dumps(index))


# ----- nothing outside the folder is opened ---------------------------------------------------------------


def test_an_index_shard_that_climbs_out_of_the_folder_is_refused(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "a" / "b" / "ckpt", shards=2)
    shutil.move(ckpt / SHARD_2, tmp_path / "outside.safetensors")
    edit_index(ckpt, SHARD_2, "../../../outside.safetensors")
    message = refusal(ckpt)
    assert "outside.safetensors" in message and "outside the checkpoint folder" in message


def test_an_index_shard_given_as_an_absolute_path_is_refused(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", shards=2)
    outside = tmp_path / "outside.safetensors"
    shutil.move(ckpt / SHARD_2, outside)
    edit_index(ckpt, SHARD_2, str(outside))
    with pytest.raises(ValueError, match="is an absolute path") as err:
        checkpoint_files(ckpt)
    assert str(outside) in str(err.value)


def test_a_weight_file_linked_to_a_file_outside_the_folder_is_refused(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(ckpt / WEIGHTS, outside)
    (ckpt / WEIGHTS).symlink_to(outside)
    message = refusal(ckpt)
    assert WEIGHTS in message and "symbolic link" in message and str(outside) in message


def test_a_shard_under_a_folder_linked_outside_is_refused(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", shards=2)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(ckpt / SHARD_2, outside / SHARD_2)
    (ckpt / "shards").symlink_to(outside, target_is_directory=True)
    edit_index(ckpt, SHARD_2, f"shards/{SHARD_2}")
    message = refusal(ckpt)
    assert f"shards/{SHARD_2}" in message and "outside the checkpoint folder" in message


def test_links_that_stay_inside_the_folder_are_followed(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", seed=5)
    (ckpt / "store").mkdir()
    shutil.move(ckpt / WEIGHTS, ckpt / "store" / "weights.safetensors")
    (ckpt / WEIGHTS).symlink_to(Path("store") / "weights.safetensors")
    model = load(ckpt)
    saved = load_file(str(ckpt / "store" / "weights.safetensors"))
    assert torch.equal(model.model.norm.weight, saved["model.norm.weight"])


def test_a_config_linked_outside_the_folder_is_refused(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    outside = tmp_path / "other_config.json"
    shutil.move(ckpt / "config.json", outside)
    (ckpt / "config.json").symlink_to(outside)
    with pytest.raises(ValueError, match="config.json.*outside the checkpoint folder"):
        load_hf_config(ckpt, "sdar")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_linked_outside_the_folder_is_refused(tmp_path, name):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    outside = tmp_path / f"other_{name}"
    shutil.move(ckpt / name, outside)
    (ckpt / name).symlink_to(outside)
    with pytest.raises(ValueError, match=f"{name}.*outside the checkpoint folder"):
        load_tokenizer(ckpt)


def test_bpe_vocabulary_files_linked_outside_the_folder_are_refused(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    (folder / "vocab.json").symlink_to(tmp_path / "vocab.json")
    (folder / "merges.txt").write_text("#version: 0.2\na b\n")
    with pytest.raises(ValueError, match="vocab.json.*outside the checkpoint folder"):
        build_qwen2_tokenizer(folder)


# ----- every damaged file is named with what is wrong with it ----------------------------------------------


def _cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: p.write_bytes(b""), "the file is empty"),
        (lambda p: _cut(p, 5), "truncated: 5 bytes"),
        (lambda p: _cut(p, 100), "truncated: the header length field says"),
        (lambda p: _cut(p, p.stat().st_size - 10), "truncated file"),
        (lambda p: p.write_bytes((2**62).to_bytes(8, "little") + b"{}"), f"header length field says {2**62} bytes"),
        (lambda p: p.write_bytes((4).to_bytes(8, "little") + b"{{{{"), "header is not valid JSON"),
        (lambda p: p.write_bytes(b"PK\x03\x04 a zip file, not safetensors"), "more than the"),
    ],
    ids=["empty", "under-8-bytes", "truncated-header", "truncated-data", "absurd-header", "bad-json", "zip"],
)
def test_a_damaged_safetensors_file_is_named_with_its_problem(tmp_path, damage, problem):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    damage(ckpt / WEIGHTS)
    message = refusal(ckpt)
    assert str(ckpt / WEIGHTS) in message and problem in message


def _write_raw_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}, "has dtype 'F99'"),
        ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "has shape [-2]"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "needs 12 bytes"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [8]}, "has data_offsets [8]"),
    ],
)
def test_an_invalid_header_entry_names_the_tensor_and_file(tmp_path, entry, problem):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    _write_raw_safetensors(ckpt / WEIGHTS, {"model.norm.weight": entry}, bytes(8))
    message = refusal(ckpt)
    assert str(ckpt / WEIGHTS) in message and "'model.norm.weight'" in message and problem in message


def test_a_damaged_shard_is_named_among_the_shards(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", shards=2)
    _cut(ckpt / SHARD_2, 200)
    assert str(ckpt / SHARD_2) in refusal(ckpt)


def test_an_index_mapping_a_tensor_to_a_shard_without_it_names_both(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", shards=2)
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"]["model.layers.0.mlp.gate_proj.ghost"] = SHARD_2
    (ckpt / INDEX).write_text(json.dumps(index))
    message = refusal(ckpt)
    assert INDEX in message and "model.layers.0.mlp.gate_proj.ghost" in message and SHARD_2 in message


def test_an_index_that_is_not_json_is_named(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", shards=2)
    (ckpt / INDEX).write_text("{truncated")
    assert f"{ckpt / INDEX} has no valid 'weight_map'" in refusal(ckpt)


def test_integer_data_for_a_floating_point_weight_is_a_dtype_mismatch(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    tensors = load_file(str(ckpt / WEIGHTS))
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"], dtype=torch.int64)
    save_file(tensors, str(ckpt / WEIGHTS))
    message = refusal(ckpt)
    assert "dtype mismatches" in message and "model.norm.weight in model.safetensors: checkpoint I64" in message


def test_an_invalid_config_json_is_named(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "config.json").write_text('{"hidden_size": 64,')
    assert f"{ckpt / 'config.json'} is not valid JSON" in refusal(ckpt)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"eos_token_id": 10**9}, "'eos_token_id' must be below vocab_size=384, got 1000000000"),
        ({"eos_token_id": [5, 10**9]}, "'eos_token_id' must be below vocab_size=384, got [5, 1000000000]"),
        ({"bos_token_id": 384}, "'bos_token_id' must be below vocab_size=384, got 384"),
        ({"pad_token_id": 10**9}, "'pad_token_id' must be below vocab_size=384"),
        ({"torch_dtype": "int8"}, "'torch_dtype' must be a float dtype (float32, float16, bfloat16, float64); quant"),
        ({"rms_norm_eps": 1e308}, "'rms_norm_eps' must be at most 1, got 1e+308"),
    ],
)
def test_config_values_no_model_can_run_with_are_refused_naming_the_field(tmp_path, changes, problem):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    edit_config(ckpt, **changes)
    assert problem in refusal(ckpt)


@pytest.mark.parametrize("dtype", ["bfloat16", "torch.float16", "float32"])
def test_float_checkpoint_dtypes_are_read(tmp_path, dtype):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    edit_config(ckpt, torch_dtype=dtype)
    assert load_hf_config(ckpt, "sdar").torch_dtype == dtype


def test_a_tokenizer_json_that_is_not_json_is_named_as_such(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError) as err:
        load_tokenizer(ckpt)
    message = str(err.value)
    assert f"{ckpt / 'tokenizer.json'} is not valid JSON" in message and "neither" not in message


@pytest.mark.parametrize(
    "content",
    ["{}", "[]", '{"model": {"type": "BPE", "vocab": 5, "merges": []}}'],
    ids=["empty-object", "list", "bad-model"],
)
def test_a_tokenizer_json_the_tokenizers_library_rejects_is_named(tmp_path, content):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError) as err:
        load_tokenizer(ckpt)
    message = str(err.value)
    assert f"{ckpt / 'tokenizer.json'} is not a valid tokenizer file" in message and "neither" not in message


def test_an_invalid_tokenizer_config_is_named(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "tokenizer_config.json").write_text("{'single': 'quotes'}")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(ckpt)


# ----- the config is checked against the weights before anything large is built ---------------------------


def test_a_million_layers_is_refused_at_once_with_the_weights_count(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    edit_config(ckpt, num_hidden_layers=1_000_000)
    start = time.perf_counter()
    message = refusal(ckpt)
    assert time.perf_counter() - start < REFUSAL_SECONDS
    assert "config.json" in message and "'num_hidden_layers' is 1000000" in message and "hold 2" in message


def test_a_million_experts_is_refused_at_once_with_the_weights_count(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", family="sdar_moe", num_experts=4)
    edit_config(ckpt, num_experts=1_000_000)
    start = time.perf_counter()
    message = refusal(ckpt, "sdar_moe")
    assert time.perf_counter() - start < REFUSAL_SECONDS
    assert "'num_experts' is 1000000" in message and "hold 4" in message


def test_more_layers_than_the_weights_hold_is_refused_for_llada_by_its_own_field_name(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", family="llada")
    edit_config(ckpt, n_layers=40)
    message = refusal(ckpt, "llada")
    assert "'n_layers' is 40" in message and "hold 2" in message


@pytest.mark.parametrize(
    ("family", "field"),
    [("sdar", "hidden_size"), ("dream", "hidden_size"), ("llada2", "hidden_size"), ("llada", "d_model")],
)
def test_a_hidden_size_the_weights_contradict_is_named_with_the_weights_value(tmp_path, family, field):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", family=family, hidden_size=64)
    edit_config(ckpt, **{field: 128})
    message = refusal(ckpt, family)
    assert f"config field {field!r} is 128, but the weights say 64" in message and "model.safetensors" in message


def test_a_vocabulary_the_weights_contradict_is_named_with_the_weights_value(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", vocab_size=384)
    edit_config(ckpt, vocab_size=448)
    assert "config field 'vocab_size' is 448, but the weights say 384" in refusal(ckpt)


@pytest.mark.parametrize(
    ("family", "changes", "field"),
    [
        ("sdar", {"num_hidden_layers": 1_000_000}, "num_hidden_layers"),
        ("llada", {"n_layers": 1_000_000}, "n_layers"),
        ("sdar", {"hidden_size": 2**40, "head_dim": 16}, "hidden_size"),
        ("sdar", {"vocab_size": 10**12}, "vocab_size"),
        ("sdar", {"intermediate_size": 2**33}, "intermediate_size"),
        ("sdar", {"max_position_embeddings": 10**12}, "max_position_embeddings"),
        ("sdar_moe", {"num_experts": 10**9}, "num_experts"),
        ("llada", {"mlp_hidden_size": None, "mlp_ratio": 10**6}, "mlp_ratio"),
        ("sdar", {"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ("sdar", {"rope_theta": float("inf")}, "rope_theta"),
        ("llada2", {"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
    ],
)
def test_an_absurd_config_value_is_refused_naming_the_field_before_anything_is_built(tmp_path, family, changes, field):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", family=family)
    edit_config(ckpt, **changes)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"config field '{field}'") as err:
        build_model(family, ckpt, torch.float32, "cpu", load_format="dummy")
    assert time.perf_counter() - start < REFUSAL_SECONDS
    assert "config.json" in str(err.value)


# ----- non-finite weights ---------------------------------------------------------------------------------


def test_nan_and_inf_weights_are_reported_with_tensor_and_file(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", shards=2)
    first = ckpt / "model-00001-of-00002.safetensors"
    tensors = load_file(str(first))
    nan_name, inf_name = sorted(name for name in tensors if tensors[name].dim() == 2)[:2]
    tensors[nan_name] = torch.full_like(tensors[nan_name], float("nan"))
    tensors[inf_name][0, 0] = float("-inf")
    save_file(tensors, str(first))
    message = refusal(ckpt)
    assert "non-finite weights" in message
    assert f"{nan_name} in {first.name} ({tensors[nan_name].numel()} of {tensors[nan_name].numel()} values)" in message
    assert f"{inf_name} in {first.name} (1 of {tensors[inf_name].numel()} values)" in message


def test_a_weight_that_overflows_the_model_dtype_is_reported(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    tensors = load_file(str(ckpt / WEIGHTS))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].double()
    tensors["model.norm.weight"][3] = 1e300  # finite in the file, Inf once cast to float32
    save_file(tensors, str(ckpt / WEIGHTS))
    assert "model.norm.weight in model.safetensors (1 of" in refusal(ckpt)


def test_large_finite_weights_are_not_mistaken_for_non_finite(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    tensors = load_file(str(ckpt / WEIGHTS))
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], 3e38)  # near the float32 limit
    save_file(tensors, str(ckpt / WEIGHTS))
    assert torch.all(load(ckpt).model.norm.weight == torch.tensor(3e38))


def test_load_checkpoint_into_a_built_model_reports_nan_too(tmp_path):
    model = load(write_tiny_checkpoint(tmp_path / "good"))
    bad = write_tiny_checkpoint(tmp_path / "bad")
    tensors = load_file(str(bad / WEIGHTS))
    tensors["lm_head.weight"][1, 2] = float("nan")
    save_file(tensors, str(bad / WEIGHTS))
    with pytest.raises(ValueError, match=r"lm_head\.weight in model\.safetensors \(1 of"):
        load_checkpoint(model, bad)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_names_a_truncated_shard_and_a_nan_tensor(tmp_path, family):
    truncated = write_tiny_checkpoint(tmp_path / "truncated", family=family, shards=2)
    _cut(truncated / SHARD_2, (truncated / SHARD_2).stat().st_size // 2)
    message = refusal(truncated, family)
    assert str(truncated / SHARD_2) in message and "truncated" in message

    poisoned = write_tiny_checkpoint(tmp_path / "poisoned", family=family)
    tensors = load_file(str(poisoned / WEIGHTS))
    name = max(tensors, key=lambda n: tensors[n].numel())
    tensors[name].view(-1)[-1] = float("nan")
    save_file(tensors, str(poisoned / WEIGHTS))
    assert f"{name} in {WEIGHTS} (1 of {tensors[name].numel()} values)" in refusal(poisoned, family)


# ----- checkpoint code is never executed ------------------------------------------------------------------


class _Trap:
    """Unpickling this writes the marker file: proof that a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pickle executed"))


def test_a_corrupted_folder_shipping_code_never_runs_it(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "executed"
    payload = f"from pathlib import Path\nPath({str(marker)!r}).write_text('module executed')\n"
    for module in ("configuration_evil.py", "modeling_evil.py", "tokenization_evil.py"):
        (ckpt / module).write_text(payload)
    auto_map = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModel": "modeling_evil.EvilModel",
        "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None],
    }
    edit_config(ckpt, auto_map=auto_map)
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(marker)))
    (ckpt / "tokenizer.json").write_text("{broken")
    _cut(ckpt / WEIGHTS, 50)

    with pytest.raises(ValueError):
        load_tokenizer(ckpt)
    with pytest.raises(ValueError):
        load(ckpt)
    (ckpt / WEIGHTS).unlink()  # only the pickle is left: it is named, never opened
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        load(ckpt)
    assert not marker.exists()
    assert os.listdir(tmp_path) == ["ckpt"]


# ----- through the engine ---------------------------------------------------------------------------------


def _engine(ckpt: Path):
    from diffulex import Diffulex

    return Diffulex(str(ckpt), block_size=4, page_size=8, buffer_size=2, max_model_len=64, max_num_batched_tokens=256)


def test_the_engine_refuses_a_shard_outside_the_folder_naming_it(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "a" / "ckpt", shards=2)
    shutil.move(ckpt / SHARD_2, tmp_path / "outside.safetensors")
    edit_index(ckpt, SHARD_2, "../../outside.safetensors")
    with pytest.raises(ValueError, match=r"outside\.safetensors.*outside the checkpoint folder"):
        _engine(ckpt)


def test_the_engine_refuses_a_config_linked_outside_the_folder(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    shutil.copyfile(ckpt / "config.json", tmp_path / "other.json")
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").symlink_to(tmp_path / "other.json")
    with pytest.raises(ValueError, match=r"config\.json.*outside the checkpoint folder"):
        _engine(ckpt)


def test_the_engine_refuses_a_million_layers_at_once(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    edit_config(ckpt, num_hidden_layers=1_000_000)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="'num_hidden_layers' is 1000000, but the weights"):
        _engine(ckpt)
    assert time.perf_counter() - start < REFUSAL_SECONDS


def test_the_engine_refuses_nan_weights_instead_of_generating_nothing(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    tensors = load_file(str(ckpt / WEIGHTS))
    tensors["model.layers.0.mlp.down_proj.weight"].fill_(float("nan"))
    save_file(tensors, str(ckpt / WEIGHTS))
    with pytest.raises(ValueError, match=r"non-finite weights.*model\.layers\.0\.mlp\.down_proj\.weight in model"):
        _engine(ckpt)
