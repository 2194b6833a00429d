"""A checkpoint file resolves inside its folder or is refused; the hub cache's snapshot links are inside."""

from __future__ import annotations

import shutil

import pytest
import torch

from diffulex.checkpoint_folder import checkpoint_path
from diffulex.models.loader import build_model
from diffulex.testing import write_tiny_checkpoint
from diffulex.tokenizer import load_tokenizer


@pytest.mark.parametrize("name", ["../x.json", "a/../../x.json", "a/b/../../../x.json"])
def test_a_name_that_climbs_out_is_refused_even_if_nothing_is_there(tmp_path, name):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match="leads outside the checkpoint folder"):
        checkpoint_path(tmp_path / "ckpt", name)


def test_a_name_that_climbs_back_inside_is_accepted(tmp_path):
    (tmp_path / "ckpt" / "a").mkdir(parents=True)
    assert checkpoint_path(tmp_path / "ckpt", "a/../config.json") == tmp_path / "ckpt" / "a/../config.json"


@pytest.mark.parametrize("name", ["", None, 3])
def test_a_name_that_is_not_a_non_empty_string_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="non-empty string"):
        checkpoint_path(tmp_path, name)


def test_a_folder_reached_through_a_link_is_its_own_inside(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "real")
    (tmp_path / "alias").symlink_to(ckpt, target_is_directory=True)
    build_model("sdar", tmp_path / "alias", torch.float32, "cpu")
    load_tokenizer(tmp_path / "alias")


def test_a_hub_cache_snapshot_of_links_into_its_blobs_loads(tmp_path):
    """``models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>``, as huggingface_hub downloads it."""
    source = write_tiny_checkpoint(tmp_path / "source", seed=4)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{i:04d}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(f"../../blobs/{blob.name}")
    model = build_model("sdar", snapshot, torch.float32, "cpu")
    expected = build_model("sdar", source, torch.float32, "cpu")
    assert torch.equal(model.lm_head.weight, expected.lm_head.weight)
    assert load_tokenizer(snapshot).encode("The old lighthouse") == load_tokenizer(source).encode("The old lighthouse")


def test_a_hub_snapshot_link_to_another_repos_blobs_is_refused(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "hub" / "models--org--a" / "snapshots" / "rev")
    (tmp_path / "hub" / "models--org--a" / "blobs").mkdir()
    other_blobs = tmp_path / "hub" / "models--org--b" / "blobs"
    other_blobs.mkdir(parents=True)
    shutil.move(ckpt / "model.safetensors", other_blobs / "weights")
    (ckpt / "model.safetensors").symlink_to(other_blobs / "weights")
    with pytest.raises(ValueError, match="model.safetensors.*outside the checkpoint folder"):
        build_model("sdar", ckpt, torch.float32, "cpu")
