#!/bin/bash
# Session-4 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
#   pdl: kernel tests, then SDAR-1.7B/8B batch-1 and 1.7B batch-64 throughput with programmatic dependent launch
#        on and off, then the PDL token-equality check (PDL on == off)
#   anatomy: step anatomy with PDL on and off, then the row-gated PDL at batch 1/4/8/64
#   a: kernel tests at realistic shapes, correctness (tiny fp32 == reference, built-in bf16 vs fp32, PDL on == off)
#   b: the SDAR-1.7B sweep with the linear roofline and a batch-1 profile
#   c: step anatomy of SDAR-1.7B at batch 1 and 64, the SDAR-8B sweep with the linear roofline and a batch-1
#      profile, SDAR-4B at batch 1/32/128
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds ${SECONDS_PER_RUN:-3} $EXTRA"
quiet() { grep -v -i "warn"; }
if [ "$1" = pdl ]; then
  timeout 150 python -m pytest tests/kernels -q -x 2>&1 | tail -3
  for pdl in 1 0; do
    DIFFULEX_PDL=$pdl timeout 100 $TP --models 1.7b --batch-sizes 1 64 --buffer-sizes 1 \
      --out $OUT/tp_1p7b_pdl$pdl.json 2>&1 | quiet | tail -4
  done
  for pdl in 1 0; do
    DIFFULEX_PDL=$pdl timeout 100 $TP --models 8b --batch-sizes 1 --buffer-sizes 1 \
      --out $OUT/tp_8b_pdl$pdl.json 2>&1 | quiet | tail -3
  done
  DIFFULEX_PDL=1 timeout 90 python bench/pdl_check.py --out $OUT/pdl_on.json 2>&1 | quiet | tail -3
  DIFFULEX_PDL=0 timeout 90 python bench/pdl_check.py --out $OUT/pdl_off.json --compare $OUT/pdl_on.json 2>&1 \
    | quiet | tail -3
elif [ "$1" = anatomy ]; then
  # where a batch-1 step goes with PDL on and off; then the gated PDL on larger batches
  for pdl in 1 0; do
    DIFFULEX_PDL=$pdl timeout 120 python bench/step_anatomy.py --model 1.7b --batch 1 --steps 30 --top 14 \
      --out $OUT/anatomy_pdl$pdl.json 2>&1 | quiet
  done
  timeout 150 $TP --models 1.7b --batch-sizes 1 4 8 64 --buffer-sizes 1 --out $OUT/tp_1p7b.json 2>&1 | quiet | grep -v "^\[" | tail -12
elif [ "$1" = a ]; then
  timeout 280 python -m pytest tests/kernels tests/attention -x -v --durations=12 > $OUT/pytest_gpu.log 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|error" $OUT/pytest_gpu.log | tail -3
  timeout 200 python bench/gpu_smoke.py --out $OUT/smoke.json --builtin-problems 100 2>&1 | quiet | tail -30
  DIFFULEX_PDL=1 timeout 90 python bench/pdl_check.py --out $OUT/pdl_on.json 2>&1 | quiet | tail -1
  DIFFULEX_PDL=0 timeout 90 python bench/pdl_check.py --out $OUT/pdl_off.json --compare $OUT/pdl_on.json 2>&1 \
    | quiet | tail -1
elif [ "$1" = b ]; then
  $TP --models 1.7b --batch-sizes 1 8 32 64 128 --buffer-sizes 1 2 --profile --profile-batch 1 \
    --linear-roofline --roofline-batches 32 64 128 --out $OUT/tp_1p7b.json 2>&1 | quiet | grep -v "^\[" | tail -40
elif [ "$1" = c ]; then
  timeout 100 python -m pytest tests/kernels/test_qk_norm_rope_store.py tests/attention -q 2>&1 | tail -1
  timeout 150 python bench/step_anatomy.py --model 1.7b --batch 1 64 --steps 30 --top 16 --out $OUT/anatomy.json \
    2>&1 | quiet
  $TP --models 8b --batch-sizes 1 8 32 128 --buffer-sizes 1 --linear-roofline --roofline-batches 32 64 128 \
    --profile --profile-batch 1 --out $OUT/tp_8b.json 2>&1 | quiet | grep -v "^\[" | tail -30
  $TP --models 4b --batch-sizes 1 32 128 --buffer-sizes 1 --out $OUT/tp_4b.json 2>&1 | quiet | tail -6
fi
