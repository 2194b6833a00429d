"""Benchmark harness: YAML run configs, lm-eval tasks on local data, and throughput metrics.

    diffulex bench --config configs/sdar_chat_gsm8k.yml --dataset-limit 20
    diffulex bench compare runs/run_A runs/run_B
    diffulex bench throughput --models 1.7b --batch-sizes 1 8 --out runs/throughput.json
    diffulex bench sweep --out runs/sweep --total-seconds 330

Modules (lm-eval is imported lazily, only by ``runner`` and ``lm_eval_model``):

* ``config``: the YAML schema (``engine:`` + ``eval:``), validation with errors that name the key;
* ``metrics``: the metric definitions of docs/benchmarks.md as pure functions over trajectories;
* ``lm_eval_model``: the ``diffulex`` model class for lm-eval (``generate_until`` only);
* ``tasks/``: lm-eval task YAMLs that read the JSON files shipped in ``data/``;
* ``scoring``: answer extraction, math equivalence and sandboxed code execution used by the tasks;
* ``runner``: one benchmark run (engine + lm-eval + metrics + files); ``report``: markdown, plot, compare;
* ``arithmetic``: the generator of the built-in model's arithmetic test set (whole templates, a held-out split);
* ``composed_problems``: arithmetic problems composed from clause and question pieces (the built-in model's
  many-phrasings training data, and a held-out-pieces test set);
* ``throughput``: ``diffulex bench throughput`` (decode steps of real SDAR geometries with random weights), with
  ``roofline`` (bytes and flops of a step, its floors), ``hardware`` (measured copy bandwidth and matmul peak) and
  ``gpu_profile`` (GPU busy/idle share of decode steps from a torch.profiler trace);
* ``sweep``: ``diffulex bench sweep`` (every performance target against its floor, one JSON, plot and table per
  target), its targets in ``sweep_decode`` (batch, strategies, MoE), ``sweep_prefill``, ``sweep_start`` and
  ``sweep_serving``, its geometries in ``sweep_models``;
* ``load``: the HTTP load client (closed loop for ``bench/load_test.py``, open-loop Poisson for the sweep).
"""

from __future__ import annotations

from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
TASKS_DIR = BENCH_DIR / "tasks"
DATA_DIR = BENCH_DIR / "data"

__all__ = ["BENCH_DIR", "DATA_DIR", "TASKS_DIR"]
