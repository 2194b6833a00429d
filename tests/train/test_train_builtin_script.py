"""``tools/train_builtin.sh``, the one-command reproduction run on the GPU machine, end to end on a tiny model:
prepare (arithmetic only), a 3-step training run, the evaluation, and what lands in OUT_DIR."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "train_builtin.sh"
TINY_TRAIN = ("--steps 3 --batch-size 8 --warmup 1 --log-every 1 --hidden-size 32 --num-layers 2 --head-dim 8 "
              "--intermediate-size 64 --max-position-embeddings 256")  # fmt: skip

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "DATA": str(tmp_path / "data"),
                "RUN_DIR": str(tmp_path / "run"), **env}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=ROOT, env=full_env, text=True,
                          capture_output=True, timeout=300)  # fmt: skip


def test_script_prepares_trains_and_evaluates_into_at_most_eight_flat_files(tmp_path: Path) -> None:
    proc = run_script(tmp_path, NO_TEXT="1", PREPARE_ARGS="--n-problems 300 --vocab-size 512",
                      TRAIN_ARGS=TINY_TRAIN, EVAL_ARGS="--n 3 --max-tokens 16")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    files = {p.name for p in out.iterdir()}
    assert all(p.is_file() for p in out.iterdir()) and len(files) <= 8  # what the device sends back
    assert {"checkpoint.tar", "train.log", "eval.json", "eval_qa.json", "eval.log"} <= files
    assert "done: 3 steps" in (out / "train.log").read_text()
    with tarfile.open(out / "checkpoint.tar") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names

    chat = json.loads((out / "eval.json").read_text())
    settings = {(r["set"], r["buffer_size"], r["accept_threshold"]) for r in chat["results"]}
    test_sets = ("train-templates", "held-out-templates", "held-out-pieces")
    assert settings == {(s, k, tau) for s in test_sets for k in (1, 2) for tau in (0.5, 0.7, 0.9)}
    assert all(r["n"] == 3 and r["prompt_format"] == "chat" and r["nfe"] > 0 for r in chat["results"])
    assert chat["targets"]["checked"] and chat["targets"]["all_met"] is False  # 3 steps learn nothing
    qa = json.loads((out / "eval_qa.json").read_text())
    assert {r["prompt_format"] for r in qa["results"]} == {"qa"} and len(qa["results"]) == 2 * len(test_sets)

    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["text_tokens"] == 0 and meta["templates"] == "train"


def test_script_reuses_a_prepared_folder_keeps_its_time_budget_and_needs_prose_only_if_asked(tmp_path: Path) -> None:
    from diffulex.train.data import prepare

    prepare(tmp_path / "data", n_problems=200, vocab_size=512, texts=[])
    # a folder without prose: the script trains with --text-fraction 0 on its own
    # past its time budget (QA_EVAL_AFTER_S) the script leaves the second evaluation out
    proc = run_script(tmp_path, TRAIN_ARGS=TINY_TRAIN, EVAL_ARGS="--n 2 --max-tokens 8 --buffer-sizes 1 "
                      "--thresholds 0.9", QA_EVAL_AFTER_S="0")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "using the prepared data folder" in proc.stdout and "preparing" not in proc.stdout
    assert "skipping the Question/Answer-format evaluation" in proc.stdout
    assert (tmp_path / "out" / "eval.json").is_file() and not (tmp_path / "out" / "eval_qa.json").exists()
    # asking for prose anyway is a clear error naming the flag, the value and the fix
    proc = run_script(tmp_path, TRAIN_ARGS=TINY_TRAIN + " --text-fraction 0.2", EVAL_ARGS="--n 2")
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "text_fraction=0.2 needs prose" in output and "pass --text-fraction 0" in output


def test_script_without_arguments_prints_its_usage(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, text=True, capture_output=True, timeout=30)
    assert proc.returncode == 2 and "usage: tools/train_builtin.sh OUT_DIR" in proc.stderr
