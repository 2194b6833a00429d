#!/bin/bash
# Session-3 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
#   a: kernel tests at realistic shapes, correctness smoke (tiny fp32 == reference, built-in bf16 vs fp32),
#      step anatomy of SDAR-1.7B at batch 1 and 64, the SDAR-1.7B throughput sweep with a batch-1 profile
#   b: SDAR-8B sweep with the linear roofline and a batch-1 profile, SDAR-4B at batch 1/32/128
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds 4 $EXTRA"
quiet() { grep -v -i "warn"; }
if [ "$1" = a ]; then
  python -m pytest tests/kernels -q -x 2>&1 | tail -3
  timeout 200 python bench/gpu_smoke.py --out $OUT/smoke.json --builtin-problems 100 2>&1 | quiet | tail -40
  timeout 150 python bench/step_anatomy.py --model 1.7b --batch 1 64 --steps 30 --top 16 --out $OUT/anatomy.json 2>&1 | quiet
  $TP --models 1.7b --batch-sizes 1 8 32 64 128 --buffer-sizes 1 2 --profile --profile-batch 1 \
    --linear-roofline --roofline-batches 32 128 \
    --out $OUT/tp_1p7b.json 2>&1 | quiet | tail -16
else
  $TP --models 8b --batch-sizes 1 8 32 128 --buffer-sizes 1 --linear-roofline --roofline-batches 32 128 \
    --profile --profile-batch 1 --out $OUT/tp_8b.json 2>&1 | quiet | tail -30
  $TP --models 4b --batch-sizes 1 32 128 --buffer-sizes 1 --out $OUT/tp_4b.json 2>&1 | quiet | tail -6
fi
