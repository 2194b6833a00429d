#!/bin/bash
# Session-5 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
#   a: kernel and attention-layer tests at realistic shapes, correctness (tiny fp32 == reference, built-in bf16 vs
#      fp32, PDL on == off), then the launch what-ifs at SDAR-1.7B batch 1 (graph replay with launches removed)
#      and A/B of TMA weight loads (the rope-in-attention launch A/B of this session ran as a separate call and its
#      code was dropped: see docs/benchmarks.md)
#   b: the SDAR-1.7B sweep with a batch-1 profile, the SDAR-8B batch-1 step, step anatomy at batch 1 and 64
#   h200: the machine: SDAR-1.7B batch 1 and 64, SDAR-8B batch 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds ${SECONDS_PER_RUN:-3} $EXTRA"
quiet() { grep -v -i "warn"; }
whatif() { timeout 90 python bench/what_if.py "$@" 2>&1 | grep -E "WHATIF|Error" | tail -2; }
if [ "$1" = a ]; then
  timeout 240 python -m pytest tests/kernels tests/attention -x -q > $OUT/pytest_gpu.log 2>&1
  echo "pytest rc=$?"; tail -2 $OUT/pytest_gpu.log
  timeout 200 python bench/gpu_smoke.py --out $OUT/smoke.json --builtin-problems 100 2>&1 | quiet | tail -12
  DIFFULEX_PDL=1 timeout 90 python bench/pdl_check.py --out $OUT/pdl_on.json 2>&1 | quiet | tail -1
  DIFFULEX_PDL=0 timeout 90 python bench/pdl_check.py --out $OUT/pdl_off.json --compare $OUT/pdl_on.json 2>&1 \
    | quiet | tail -1
  for skip in "" norm,silu attn attn,norm,silu; do whatif --skip "$skip" --tag removed; done
  for i in 1 2; do
    whatif --tag all-on
    DIFFULEX_SKINNY_TMA=0 whatif --tag tma-off
  done
elif [ "$1" = b ]; then
  $TP --models 1.7b --batch-sizes 1 8 32 64 128 --buffer-sizes 1 2 --profile --profile-batch 1 \
    --out $OUT/tp_1p7b.json 2>&1 | quiet | grep -v "^\[" | tail -20
  timeout 100 $TP --models 8b --batch-sizes 1 --buffer-sizes 1 --out $OUT/tp_8b.json 2>&1 | quiet | tail -3
  timeout 150 python bench/step_anatomy.py --model 1.7b --batch 1 64 --steps 30 --top 12 --out $OUT/anatomy.json \
    2>&1 | quiet | grep -v "^  void\|^  Memcpy"
elif [ "$1" = h200 ]; then
  $TP --models 1.7b --batch-sizes 1 64 --buffer-sizes 1 --out $OUT/tp_1p7b_h200.json 2>&1 | quiet | tail -4
  timeout 150 $TP --models 8b --batch-sizes 1 --buffer-sizes 1 --out $OUT/tp_8b_h200.json 2>&1 | quiet | tail -3
  whatif --tag h200
fi
