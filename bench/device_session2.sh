#!/bin/bash
# Session-2 GPU checks: graphs/compile correctness, builtin bf16 agreement, quick step timings eager vs graphs.
export PYTHONPATH=$PWD DIFFULEX_SHARED_DATA=$PWD/tests/data/sdar-4b-chat
set -x
nvidia-smi --query-gpu=name,memory.total --format=csv
python bench/gpu_smoke.py --out $OUT/smoke.json --builtin-problems 100 --attn-impl triton_grouped 2>&1 | grep -v Warning | tail -60
for mode in "--enforce-eager" "" "--enable-cudagraph-torch-compile"; do
  python -m diffulex.cli bench throughput --models 1.7b --batch-sizes 1 64 --buffer-sizes 1 --quick $mode \
    --out $OUT/tp_1p7b${mode// /}.json 2>&1 | tail -6
done
