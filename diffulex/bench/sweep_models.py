"""The checkpoint folders the sweep measures: real geometries with random weights (``load_format="dummy"``, only a
config and a tokenizer are written) and tiny random checkpoints with weights for ``--quick``.

SDAR, LLaDA2 and Fast-dLLM v2 (7B) geometries are `diffulex.bench.throughput`'s writers. DiffusionGemma has none
there: its folder here is the tiny writer's files (tokenizer, generation config, the family's config keys) with
the geometry's sizes written over the config, so that the engine builds the full-size model from it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A DiffusionGemma layout (five sliding-window layers, then one global) at SDAR-1.7B-like sizes with a small MoE
# beside each dense MLP, as the family's layers have. No published size is claimed: it gives the strategy's step a
# GPU-sized shape to be measured against its own floor.
DIFFUSION_GEMMA_LAYERS = 24
DIFFUSION_GEMMA_TEXT: dict[str, Any] = {
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": DIFFUSION_GEMMA_LAYERS,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "global_head_dim": 256,
    "num_global_key_value_heads": 4, "num_experts": 32, "top_k_experts": 4, "moe_intermediate_size": 512,
    "sliding_window": 512, "vocab_size": 262144, "max_position_embeddings": 32768,
    "layer_types": [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                    for i in range(DIFFUSION_GEMMA_LAYERS)],
}  # fmt: skip


def _sdar(size: str) -> Callable[[Path, str | None], Path]:
    def write(path: Path, data_dir: str | None) -> Path:
        from diffulex.bench.throughput import write_sdar_checkpoint

        return write_sdar_checkpoint(path, size, data_dir)

    return write


def _llada2(size: str) -> Callable[[Path, str | None], Path]:
    def write(path: Path, data_dir: str | None) -> Path:
        from diffulex.bench.throughput import write_llada2_checkpoint

        return write_llada2_checkpoint(path, size)

    return write


def _weightless(path: Path, source: Path, sizes: dict[str, Any], section: str | None) -> Path:
    """Copy `source` without its weight files and write `sizes` over its config (or its `section`); the weights
    the engine draws are bfloat16, as the published checkpoints are (the tiny writer's are float32)."""
    path.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copyfile(item, path / item.name)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    (config[section] if section else config).update(sizes)
    for key in ("torch_dtype", "dtype"):
        config[key] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def _fast_dllm_v2_7b(path: Path, data_dir: str | None) -> Path:
    from diffulex.bench.throughput import write_fast_dllm_v2_checkpoint

    return write_fast_dllm_v2_checkpoint(path, "fdv2-7b", data_dir)


def _diffusion_gemma_geometry(path: Path, data_dir: str | None) -> Path:
    from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        return _weightless(path, write_tiny_diffusion_gemma_checkpoint(Path(tmp) / "tiny"), DIFFUSION_GEMMA_TEXT,
                           "text_config")


def _tiny(family: str) -> Callable[[Path, str | None], Path]:
    def write(path: Path, data_dir: str | None) -> Path:
        from diffulex.testing.checkpoints import write_tiny_checkpoint, write_tiny_diffusion_gemma_checkpoint

        if family == "diffusion_gemma":
            return write_tiny_diffusion_gemma_checkpoint(path)
        return write_tiny_checkpoint(path, family=family, seed=0)

    return write


# name -> writer(path, data_dir)
MODELS: dict[str, Callable[[Path, str | None], Path]] = {
    "sdar-1.7b": _sdar("1.7b"),
    "sdar-8b": _sdar("8b"),
    "sdar-30b-a3b": _sdar("30b-a3b"),
    "llada2-mini": _llada2("llada2-mini"),
    "fast-dllm-v2-7b": _fast_dllm_v2_7b,
    "diffusion-gemma": _diffusion_gemma_geometry,
    "tiny-sdar": _tiny("sdar"),
    "tiny-sdar-moe": _tiny("sdar_moe"),
    "tiny-llada2": _tiny("llada2"),
    "tiny-fast-dllm-v2": _tiny("fast_dllm_v2"),
    "tiny-diffusion-gemma": _tiny("diffusion_gemma"),
}


def write_model(name: str, path: Path, data_dir: str | None = None) -> Path:
    """Write the folder of geometry `name` into `path`; returns it."""
    if name not in MODELS:
        raise ValueError(f"model {name!r} is invalid: must be one of {', '.join(MODELS)}")
    return MODELS[name](Path(path), data_dir)
