#!/bin/bash
# Session-2 GPU runs. Part "a": built-in bf16/fp32 agreement and the SDAR-1.7B sweep; part "b": SDAR-8B and 4B
# sweeps with the linear roofline and batch-1 profiles. Results land in $OUT; merge them with merge_reports.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --enable-cudagraph-torch-compile --max-seconds 5"
if [ "$1" = a ]; then
  timeout 150 python bench/gpu_smoke.py --out $OUT/smoke.json --builtin-problems 100 --skip-tiny 2>&1 | grep -v Warn | tail -22
  $TP --models 1.7b --batch-sizes 1 8 32 64 128 --buffer-sizes 1 2 --profile --profile-batch 1 \
    --out $OUT/tp_1p7b.json 2>&1 | grep -v Warn | tail -16
else
  $TP --models 8b --batch-sizes 1 8 32 128 --buffer-sizes 1 --linear-roofline --roofline-batches 32 128 \
    --profile --profile-batch 1 --out $OUT/tp_8b.json 2>&1 | grep -v Warn | tail -30
  $TP --models 4b --batch-sizes 1 32 128 --buffer-sizes 1 --out $OUT/tp_4b.json 2>&1 | grep -v Warn | tail -6
fi
