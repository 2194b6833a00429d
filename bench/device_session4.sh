#!/bin/bash
# Session-4 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
#   pdl: kernel tests, then SDAR-1.7B/8B batch-1 and 1.7B batch-64 throughput with programmatic dependent launch
#        on and off, then the PDL token-equality check (graph == eager, PDL on == off)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds 3 $EXTRA"
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
elif [ "$1" = early ]; then
  # GEMMs releasing their dependents before (1) or after (0) their weight stream; attention prefetch; graph copy
  timeout 150 python -m pytest tests/kernels -q -x 2>&1 | tail -2
  for early in 1 0; do
    DIFFULEX_PDL_EARLY=$early timeout 100 $TP --models 1.7b 8b --batch-sizes 1 --buffer-sizes 1 \
      --out $OUT/tp_early$early.json 2>&1 | quiet | grep "decode steps"
  done
  DIFFULEX_PDL_EARLY=1 timeout 120 python bench/step_anatomy.py --model 1.7b --batch 1 --steps 30 --top 8 \
    --out $OUT/anatomy_early.json 2>&1 | quiet
  DIFFULEX_PDL=1 DIFFULEX_PDL_EARLY=1 timeout 90 python bench/pdl_check.py --out $OUT/pdl_on.json 2>&1 | quiet | tail -2
  DIFFULEX_PDL=0 timeout 90 python bench/pdl_check.py --out $OUT/pdl_off.json --compare $OUT/pdl_on.json 2>&1 \
    | quiet | tail -2
fi
