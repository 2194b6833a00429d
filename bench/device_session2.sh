#!/bin/bash
# Session-2 GPU run B: locate the smoke's device-side assert, built-in bf16/fp32 agreement, 1.7B quick check of
# the step-time fixes, 8B and 4B sweeps with the linear roofline. Results land in $OUT.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
CUDA_LAUNCH_BLOCKING=1 timeout 120 python -c "
import sys, json; sys.path.insert(0, 'bench'); import gpu_smoke
r = {}; gpu_smoke.tiny_checks('triton_grouped', r); print(json.dumps(r))" > $OUT/tiny_debug.log 2>&1
grep -v Warn $OUT/tiny_debug.log | grep -B2 -A12 -m1 "Traceback" | head -60; tail -2 $OUT/tiny_debug.log | cut -c1-1500
timeout 150 python bench/gpu_smoke.py --out $OUT/smoke.json --builtin-problems 100 --skip-tiny 2>&1 | grep -v Warn | tail -25
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --enable-cudagraph-torch-compile --max-seconds 5"
$TP --models 1.7b --batch-sizes 1 64 --buffer-sizes 1 --profile --profile-batch 1 --out $OUT/tp_1p7b_check.json 2>&1 | grep -v Warn | tail -5
$TP --models 8b --batch-sizes 1 8 32 128 --buffer-sizes 1 --linear-roofline --roofline-batches 32 128 \
  --profile --profile-batch 1 --out $OUT/tp_8b.json --plot $OUT/tp_8b.png 2>&1 | grep -v Warn | tail -22
$TP --models 4b --batch-sizes 1 32 128 --buffer-sizes 1 --out $OUT/tp_4b.json 2>&1 | grep -v Warn | tail -6
