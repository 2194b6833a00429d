"""The manifest of a build's kernel variants: named by what decides them, written whole, trusted only where every
variant it names is cached, and what a build adds to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffulex.kernels import build_manifest
from diffulex.kernels.build_manifest import (
    BuildManifest,
    load_manifest,
    manifest_key,
    manifest_path,
    save_manifest,
)
from diffulex.kernels.parallel_compile import KernelVariant

FIELDS = {"engine": {"block_size": 4, "max_num_reqs": 8}, "dtype": "torch.bfloat16", "device": ["H100", [9, 0]]}
A, B, C = (KernelVariant("diffulex.kernels.k", name, '{"rows": 16}') for name in "abc")


@pytest.fixture
def cached(monkeypatch) -> set[KernelVariant]:
    """The variants Triton's cache holds (a stand-in for its lookup)."""
    held: set[KernelVariant] = set()
    monkeypatch.setattr(build_manifest, "cached_or_unknown_false", lambda variant, target: variant in held)
    return held


def test_the_key_names_the_fields_whatever_their_order_and_changes_with_any_of_them() -> None:
    reordered = {"device": FIELDS["device"], "dtype": FIELDS["dtype"], "engine": {"max_num_reqs": 8, "block_size": 4}}
    assert manifest_key(reordered) == manifest_key(FIELDS)
    assert manifest_key({**FIELDS, "engine": {"block_size": 4, "max_num_reqs": 16}}) != manifest_key(FIELDS)
    assert manifest_key({**FIELDS, "dtype": "torch.float16"}) != manifest_key(FIELDS)


def test_a_saved_manifest_loads_back_once_per_variant_in_order(tmp_path: Path) -> None:
    path = manifest_path(tmp_path, manifest_key(FIELDS))
    save_manifest(path, [B, A, B, C])
    assert load_manifest(path) == [B, A, C]
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file is left beside it"


def test_a_missing_or_unreadable_manifest_is_none(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    assert load_manifest(path) is None
    path.write_text('[{"module": "x"')
    assert load_manifest(path) is None
    path.write_text('[{"module": "x", "colour": "red"}]')
    assert load_manifest(path) is None


def test_a_manifest_is_ready_only_when_the_cache_holds_every_variant_it_names(tmp_path: Path, cached) -> None:
    assert not BuildManifest.open(tmp_path, FIELDS, "hopper").ready, "no manifest yet"
    save_manifest(manifest_path(tmp_path, manifest_key(FIELDS)), [A, B])
    cached.add(A)
    assert not BuildManifest.open(tmp_path, FIELDS, "hopper").ready
    cached.add(B)
    assert BuildManifest.open(tmp_path, FIELDS, "hopper").ready
    assert not BuildManifest.open(tmp_path, {**FIELDS, "dtype": "torch.float16"}, "hopper").ready, "another engine"
    save_manifest(manifest_path(tmp_path, manifest_key(FIELDS)), [])
    assert not BuildManifest.open(tmp_path, FIELDS, "hopper").ready, "an empty list vouches for nothing"


def test_a_ready_manifest_gains_what_a_build_launched_and_one_not_ready_is_replaced(tmp_path: Path, cached) -> None:
    path = manifest_path(tmp_path, manifest_key(FIELDS))
    save_manifest(path, [A, B])
    cached.update({A, B})
    BuildManifest.open(tmp_path, FIELDS, "hopper").record([B, C])
    assert load_manifest(path) == [A, B, C], "a second build in one process launches only what it lacked"
    cached.discard(A)  # e.g. its kernel's source changed: no longer found in the cache
    BuildManifest.open(tmp_path, FIELDS, "hopper").record([B, C])
    assert load_manifest(path) == [B, C]


def test_a_build_that_launched_nothing_leaves_the_manifest_as_it_was(tmp_path: Path, cached) -> None:
    path = manifest_path(tmp_path, manifest_key(FIELDS))
    save_manifest(path, [A])
    before = path.stat().st_mtime_ns
    BuildManifest.open(tmp_path, FIELDS, "hopper").record([])
    cached.add(A)
    BuildManifest.open(tmp_path, FIELDS, "hopper").record([A])
    assert load_manifest(path) == [A] and path.stat().st_mtime_ns == before
