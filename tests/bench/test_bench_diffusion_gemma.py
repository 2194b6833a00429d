"""``diffulex bench`` with the DiffusionGemma example config (configs/diffusion_gemma_gsm8k.yml) on a tiny random
DiffusionGemma checkpoint: the harness runs the ``diffusion_gemma`` strategy end to end and reports its metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffulex.cli import main
from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_the_example_config_runs_on_a_tiny_checkpoint(tmp_path: Path) -> None:
    """Two GSM8K problems, 24 tokens each (two 16-token canvases): every request answers, the report names the
    strategy, and tokens per forward are those of whole canvases (at most 24 / 2 forwards per request)."""
    pytest.importorskip("lm_eval")
    folder = write_tiny_diffusion_gemma_checkpoint(tmp_path / "tiny", layer_output_scale=0.5)
    code = main([
        "bench", "--config", str(REPO / "configs" / "diffusion_gemma_gsm8k.yml"), "--model-path", str(folder),
        "--dataset-limit", "2", "--set", "eval.max_tokens=24", "--set", "eval.use_tqdm=false",
        "--output-dir", str(tmp_path / "out"),
    ])  # fmt: skip
    assert code == 0
    (run_dir,) = (tmp_path / "out").iterdir()
    report = json.loads((run_dir / "metrics.json").read_text())
    assert report["engine_resolved"]["decoding_strategy"] == "diffusion_gemma"
    assert report["engine_resolved"]["block_size"] == 16
    metrics = report["metrics"]
    assert metrics["num_requests"] == 2 and metrics["num_rejected"] == 0
    assert 0 < metrics["generated_tokens"] <= 48
    assert 0 < metrics["tpf"] <= 12
