#!/bin/bash
# Session-2 GPU run A: fast-path correctness (graphs, compiled forward, bf16 on the built-in model) and the
# SDAR-1.7B throughput sweep with a profile at batch 1. Results land in $OUT.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python bench/gpu_smoke.py --out $OUT/smoke.json --builtin-problems 100 --attn-impl triton_grouped \
  2>&1 | grep -v Warn | tail -45
python -m diffulex.cli bench throughput --models 1.7b --batch-sizes 1 8 32 64 128 --buffer-sizes 1 2 \
  --max-seconds 6 --data-dir tests/data/sdar-4b-chat --enable-cudagraph-torch-compile \
  --profile --profile-batch 1 --out $OUT/throughput.json --plot $OUT/throughput.png 2>&1 | grep -v Warn | tail -30
