"""The shipped built-in model: a real SDAR checkpoint that solves held-out arithmetic problems on CPU."""

from __future__ import annotations

import json
import re
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


def test_builtin_model_solves_held_out_problems() -> None:
    from diffulex import Diffulex, SamplingParams
    from diffulex.bench.arithmetic import generate_problems

    start = time.time()
    llm = Diffulex(model=str(BUILTIN), decoding_strategy="multi_bd", buffer_size=1, accept_threshold=0.9)
    assert llm.config.block_size == 8  # taken from config.json
    problems = generate_problems(50, 1234)
    prompts = [p["question"] for p in problems]  # generate asks a chat model through its template
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=128), use_tqdm=False)
    correct = 0
    for p, text in zip(problems, out.texts, strict=True):
        m = re.search(r"####\s*(-?\d+)", text)
        correct += bool(m) and m.group(1) == p["answer"].rsplit("####", 1)[-1].strip()
    elapsed = time.time() - start
    assert correct >= 43, f"{correct}/50 correct"  # >= 85%
    assert out.tpf >= 2.5, f"TPF {out.tpf:.2f}"  # block size 8: above the bound of 2 of block size 4
    assert elapsed < 120, f"took {elapsed:.1f}s"
    assert all(t.completion_reason == "eos_token_generated" for t in out.trajectories)
