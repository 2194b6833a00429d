#!/bin/bash
# Session-19 GPU runs, queued in session 18 (each part fits one 10-minute device call). Results land in $OUT.
source bench/device_helpers.sh
quiet() { grep -v -i "warn"; }
#   a: session 18's untimed GPU paths: the fused q/k norm + partial rotary (+ store) kernel, the MoE and LLaDA2
#      tests, edit mode and DMax (token merge runs eagerly), then LLaDA2-mini again (it ran the torch rotary in
#      session 18: 7.53 ms/step) and the MoE smoke checks
if [ "$1" = a ]; then
  gpu_tests a tests/kernels/test_qk_norm_rope_store.py tests/kernels/test_fused_norm.py tests/layers \
    tests/models/test_llada2.py tests/models/test_sdar_moe.py tests/engine/test_edit_mode.py
  timeout 240 python bench/llada2_mini_step.py --out $OUT/llada2_mini_step.json 2>&1 | quiet | tail -12
  timeout 120 python bench/moe_smoke.py --family llada2 --out $OUT/moe_smoke_llada2.json 2>&1 | grep -E "agreement|ms_per"
fi
#   b: the MoE geometries through the throughput harness (MoE-aware floor): LLaDA2.0-mini (block 32) and
#      SDAR-30B-A3B (block 4), batch 1 and 8
if [ "$1" = b ]; then
  TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --buffer-sizes 1 --max-seconds 5"
  timeout 250 $TP --models llada2-mini --block-size 32 --batch-sizes 1 8 --out $OUT/tp_llada2_mini.json 2>&1 | quiet | tail -6
  timeout 280 $TP --models 30b-a3b --batch-sizes 1 8 --out $OUT/tp_30b_a3b.json 2>&1 | quiet | tail -6
fi
#   c: (a two-GPU machine, kind nvidia-h100-x2) data-parallel replicas: the tests, then one replica against two on
#      the same prompts
if [ "$1" = c ]; then
  gpu_tests c tests/engine/test_data_parallel.py
fi
