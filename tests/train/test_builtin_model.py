"""The shipped built-in model: a real SDAR checkpoint that solves held-out arithmetic problems on CPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import diffulex

BUILTIN = Path(getattr(diffulex, "BUILTIN_MODEL", Path(diffulex.__file__).parent / "builtin_model"))

pytestmark = pytest.mark.skipif(not (BUILTIN / "model.safetensors").is_file(), reason="no built-in model")


def test_builtin_model_is_a_small_sdar_checkpoint() -> None:
    size = sum(p.stat().st_size for p in BUILTIN.iterdir() if p.is_file())
    assert size <= 20 * 1024 * 1024
    config = json.loads((BUILTIN / "config.json").read_text())
    assert config["model_type"] == "sdar" and config["torch_dtype"] == "bfloat16" and config["block_size"] == 8
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (BUILTIN / name).is_file()


def test_builtin_model_solves_unseen_problems_in_phrasings_it_never_saw() -> None:
    """Unseen problems told by the training templates, by templates never trained on and by held-out composed
    wordings, at the TPF of block diffusion with blocks of 8."""
    from diffulex.train.evaluate import evaluate_setting, evaluation_sets

    start = time.time()
    rows = evaluate_setting(str(BUILTIN), evaluation_sets(50), buffer_size=1, accept_threshold=0.9)
    elapsed = time.time() - start
    result = {r["set"]: r for r in rows}
    assert all(r["block_size"] == 8 for r in rows)  # taken from config.json
    # the 95% target less a margin for a sample of 50
    assert result["train-templates"]["correct"] >= 46, result["train-templates"]
    # the 80% target less a margin for a sample of 50
    assert result["held-out-templates"]["correct"] >= 38, result["held-out-templates"]
    assert result["held-out-pieces"]["correct"] >= 38, result["held-out-pieces"]
    assert all(r["tpf"] >= 2.5 for r in rows), rows  # block size 8: above the bound of 2 of block size 4
    assert all(r["with_final_line"] == r["n"] for r in rows), rows
    assert elapsed < 120, f"took {elapsed:.1f}s"
