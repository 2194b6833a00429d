#!/bin/bash
# Session-12 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# Compiled kernels survive between calls on a warm machine (ignored paths there are kept).
export TRITON_CACHE_DIR=$PWD/.triton_cache
nvidia-smi --query-gpu=name --format=csv,noheader
quiet() { grep -v -i "warn"; }
W="timeout 150 python bench/what_if.py --model 1.7b --steps 100"
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds ${SECONDS_PER_RUN:-3}"
# rows MODEL BATCH MODE...: one throughput row per mode (async-scheduling / no-async-scheduling), in that order
rows() {
  local model=$1 batch=$2; shift 2
  for mode in "$@"; do
    $TP --$mode --models $model --batch-sizes $batch --buffer-sizes 1 --out $OUT/tp_${model/./p}_b${batch}_$mode${TAG:-}.json \
      2>&1 | quiet | grep sdar | sed "s/^/$mode /"
  done
}
ON=async-scheduling OFF=no-async-scheduling
#   a: where the H200's batch-1 replay goes: every kernel's critical-path increment, then upper bounds without
#      the norms, the q/k norm + rotary launch, the attention launch, and all of them; one throughput row
if [ "$1" = a ]; then
  $W --tag timeline --timeline 2>&1 | grep -E "WHATIF|CHAIN"
  for s in norm rope attnkernel attn norm,attn; do $W --tag skip_$s --skip $s 2>&1 | grep WHATIF; done
  rows 1.7b 1 $ON
fi
#   b: (experiment) the skinny-GEMM configs of the batch-1 chain on the H200 (the table was measured on an H100):
#      qkv with 32-column tiles or split in 2, gate_up with 5 stages or 8 warps, down with 128-wide K tiles,
#      baseline first and last
if [ "$1" = b ]; then
  $W --tag base 2>&1 | grep WHATIF
  for t in 4096,2048,4=32,128,4,6,1,1,1 4096,2048,4=64,128,4,6,1,2,1 4096,2048,4=64,128,8,6,1,1,1 \
    12288,2048,4=128,128,4,5,1,1,1 12288,2048,4=128,128,8,4,1,1,1 12288,2048,4=128,64,4,8,1,1,1 \
    2048,6144,4=64,128,4,6,1,4 2048,6144,4=64,256,4,4,1,4 2048,6144,4=32,256,4,3,1,4; do
    $W --tag t --table $t 2>&1 | grep WHATIF | sed "s/^/$t /"
  done
  $W --tag base 2>&1 | grep WHATIF
fi
#   c: (experiment) can o_proj and down_proj stream unsplit? 16-column tiles give 128 programs without K splits
#      (then the RMSNorm after them reads one part); baseline first and last
if [ "$1" = c ]; then
  $W --tag base 2>&1 | grep WHATIF
  for t in 2048,2048,4=16,128,4,6,1,1,1 2048,2048,4=16,256,4,4,1,1,0 2048,2048,4=16,512,4,3,1,1,0 \
    2048,6144,4=16,256,4,4,1,1 2048,6144,4=16,512,4,3,1,1 2048,6144,4=16,512,8,3,1,1 2048,6144,4=16,256,4,6,1,1 \
    "2048,2048,4=16,256,4,4,1,1,0 2048,6144,4=16,256,4,4,1,1"; do
    $W --tag t --table $t 2>&1 | grep WHATIF | sed "s/^/$t /"
  done
  $W --tag base 2>&1 | grep WHATIF
fi
#   d: (experiment) attention's first cached tile loaded into registers before its PDL wait, A/B twice; the upper
#      bound without the RMSNorm launches (the consumer GEMMs then read one split's bits)
if [ "$1" = d ]; then
  timeout 200 python -m pytest tests/kernels/test_paged_attention.py -x -q -p no:warnings > $OUT/pytest_attn.log 2>&1
  echo "attention pytest rc=$?"; tail -2 $OUT/pytest_attn.log
  for p in 1 0 1 0; do DIFFULEX_ATTN_PRELOAD=$p $W --tag preload$p 2>&1 | grep WHATIF; done
  $W --tag skip_norm --skip norm 2>&1 | grep WHATIF
  DIFFULEX_ATTN_PRELOAD=1 $W --tag tl_preload --timeline 2>&1 | grep -E "CHAIN _paged"
fi
#   e: the session's changes on a GPU: the kernels (skinny GEMM with readers, attention preload, top-1,
#      acceptance, advance), the engine tests with real capture, gpu_smoke
if [ "$1" = e ]; then
  timeout 280 python -m pytest tests/kernels/test_skinny_gemm.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_top1.py tests/kernels/test_acceptance.py tests/kernels/test_step_advance.py -x -q \
    -p no:warnings > $OUT/pytest_kernels.log 2>&1
  echo "kernel pytest rc=$?"; tail -2 $OUT/pytest_kernels.log
  timeout 150 python -m pytest tests/engine/test_cuda_graph.py tests/engine/test_continuation.py \
    tests/engine/test_micro_batches.py -x -q -p no:warnings > $OUT/pytest_engine.log 2>&1
  echo "engine pytest rc=$?"; tail -2 $OUT/pytest_engine.log
  timeout 150 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke.json 2>&1 | quiet | tail -16
fi
#   f: throughput A/B on one machine: the LM head skipped when no row is sampled (readers) on / off, alternating,
#      SDAR-1.7B batch 1 (three each) and 64, SDAR-8B batch 1
if [ "$1" = f ]; then
  i=0
  for r in 1 0 1 0 1 0; do
    i=$((i + 1)); DIFFULEX_SKINNY_READERS=$r TAG=_readers${r}_$i rows 1.7b 1 $ON | sed "s/^/readers$r /"
  done
  for r in 1 0; do DIFFULEX_SKINNY_READERS=$r TAG=_readers$r rows 1.7b 64 $ON | sed "s/^/readers$r /"; done
  rows 8b 1 $ON
fi
#   g: what bounds the H200 now: the replay as built, the chain without the RMSNorm launches and the attention layer
#      (q/k norm, rotary, store and attention: the GEMMs and the embedding are left), and the timeline
if [ "$1" = g ]; then
  $W --tag base --timeline 2>&1 | grep -E "WHATIF|CHAIN"
  $W --tag skip_norm_attn --skip norm,attn 2>&1 | grep WHATIF
  $W --tag skip_norm --skip norm 2>&1 | grep WHATIF
fi
#   h: the final code on an H100: GPU tests of the changed kernels, then the throughput rows (SDAR-1.7B batch 1 three
#      times and 64, SDAR-8B batch 1)
if [ "$1" = h ]; then
  timeout 200 python -m pytest tests/kernels/test_skinny_gemm.py tests/kernels/test_paged_attention.py -x -q \
    -p no:warnings > $OUT/pytest_kernels.log 2>&1
  echo "kernel pytest rc=$?"; tail -2 $OUT/pytest_kernels.log
  for i in 1 2 3; do TAG=_$i rows 1.7b 1 $ON; done
  rows 1.7b 64 $ON
  rows 8b 1 $ON
  $W --tag base 2>&1 | grep WHATIF
fi
