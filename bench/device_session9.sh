#!/bin/bash
# Session-9 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# Compiled kernels survive between calls on a warm machine (ignored paths there are kept): the GPU kernel tests
# compile a few hundred kernel variants (~7 s per paged-attention test when cold), so they fit a call only warm.
export TRITON_CACHE_DIR=$PWD/.triton_cache
nvidia-smi --query-gpu=name --format=csv,noheader
quiet() { grep -v -i "warn"; }
W="timeout 150 python bench/what_if.py --model 1.7b --steps 100"
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds ${SECONDS_PER_RUN:-3}"
GPU_TESTS="tests/engine/test_cuda_graph.py tests/engine/test_micro_batches.py tests/kernels/test_top1.py
  tests/kernels/test_acceptance.py tests/kernels/test_skinny_gemm.py tests/kernels/test_fused_norm.py
  tests/kernels/test_activation.py tests/kernels/test_paged_attention.py tests/kernels/test_qk_norm_rope_store.py
  tests/kernels/test_attention_op.py tests/attention"
#   a: session 8's last commit on a GPU (tests with real capture, gpu_smoke), then upper bounds of the attention
#      chain at batch 1: without the q/k-norm + rotary + store launch, without the attention launch, without both,
#      attention unsplit
if [ "$1" = a ]; then
  timeout 300 python -m pytest $GPU_TESTS -x -q -p no:warnings > $OUT/pytest_gpu.log 2>&1
  echo "pytest rc=$?"; tail -2 $OUT/pytest_gpu.log
  timeout 200 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke.json 2>&1 | quiet | tail -12
  $W --tag base 2>&1 | grep WHATIF
  $W --tag norope --skip rope 2>&1 | grep WHATIF
  $W --tag noattnkernel --skip attnkernel 2>&1 | grep WHATIF
  $W --tag noattn --skip attn 2>&1 | grep WHATIF
  $W --tag split1 --attn-splits 1 2>&1 | grep WHATIF
  $W --tag base2 2>&1 | grep WHATIF
fi
#   b: attention with cached and new keys in separate splits, the first cached tile loaded before the PDL wait:
#      GPU attention tests, then the batch-1 replay (part a's base on the same machine: 1.502 / 1.501 ms)
if [ "$1" = b ]; then
  timeout 240 python -m pytest tests/kernels/test_paged_attention.py tests/kernels/test_attention_op.py \
    tests/kernels/test_qk_norm_rope_store.py tests/attention -x -q -p no:warnings --durations=5 > $OUT/pytest_attn.log 2>&1
  echo "pytest rc=$?"; tail -9 $OUT/pytest_attn.log
  $W --tag sep 2>&1 | grep WHATIF
  $W --tag sep_noattnkernel --skip attnkernel 2>&1 | grep WHATIF
  $W --tag sep2 2>&1 | grep WHATIF
fi
#   c: A/B of the two attention changes (separate splits for new keys; first cached tile before the wait)
if [ "$1" = c ]; then
  for sp in "0 0" "1 0" "0 1" "1 1" "0 0" "1 0"; do
    set -- $sp
    DIFFULEX_ATTN_SEPARATE=$1 DIFFULEX_ATTN_PRELOAD=$2 $W --tag sep$1_pre$2 2>&1 | grep WHATIF
  done
fi
#   d: A/B of the split combine: partials loaded one split per round trip (group 1) or 4 / 8 at once
if [ "$1" = d ]; then
  timeout 200 python -m pytest tests/kernels/test_paged_attention.py -x -q -p no:warnings -k "split or auto" \
    > $OUT/pytest_attn.log 2>&1; echo "pytest rc=$?"; tail -1 $OUT/pytest_attn.log
  for sg in "0 1" "1 1" "1 4" "1 8" "0 1" "1 4"; do
    set -- $sg
    DIFFULEX_ATTN_SEPARATE=$1 DIFFULEX_ATTN_COMBINE_GROUP=$2 $W --tag sep$1_group$2 2>&1 | grep WHATIF
  done
fi
#   e: the split combine loading four partials per round trip (explicitly), against part d's numbers
if [ "$1" = e ]; then
  timeout 200 python -m pytest tests/kernels/test_paged_attention.py -x -q -p no:warnings -k "split or auto" \
    > $OUT/pytest_attn.log 2>&1; echo "pytest rc=$?"; tail -1 $OUT/pytest_attn.log
  $W --tag noattnkernel --skip attnkernel 2>&1 | grep WHATIF
  for sp in 1 0 1; do DIFFULEX_ATTN_SEPARATE=$sp $W --tag sep${sp}_combine4 2>&1 | grep WHATIF; done
fi
#   f: the kept attention change (cached and new keys in separate splits): GPU attention and graph tests, the
#      critical-path increment of every kernel of the batch-1 replay, then the throughput rows
if [ "$1" = f ]; then
  timeout 240 python -m pytest tests/kernels/test_paged_attention.py tests/engine/test_cuda_graph.py \
    tests/kernels/test_attention_op.py -x -q -p no:warnings --durations=8 > $OUT/pytest_gpu.log 2>&1
  echo "pytest rc=$?"; tail -12 $OUT/pytest_gpu.log
  $W --tag timeline --timeline 2>&1 | grep -E "WHATIF|CHAIN"
  $TP --models 1.7b --batch-sizes 1 64 --buffer-sizes 1 --out $OUT/tp_1p7b.json 2>&1 | quiet | tail -4
fi
#   g: (experiment) the norm's chain cost: unsummed products off, and the norm at 4 / 16 warps
if [ "$1" = g ]; then
  DIFFULEX_UNSUMMED=0 $W --tag unsummed0 --timeline 2>&1 | grep -E "WHATIF|CHAIN" | head -5
  for w in 4 16 2; do DIFFULEX_NORM_WARPS=$w $W --tag normwarps$w --timeline 2>&1 | grep -E "WHATIF|CHAIN _rms"; done
fi
#   h: (experiment) the split-KV cap at batch 1: fewer, longer splits mean fewer partials to combine
if [ "$1" = h ]; then
  for c in 2 3 4 8 16; do $W --tag attnsplits$c --attn-splits $c 2>&1 | grep WHATIF; done
fi
#   i: (experiment, reverted) q/k norm + rotary + KV store folded into attention at decode shapes: GPU tests, A/B
#      of the batch-1 replay (fused 1.600 / 1.603 ms against 1.497 / 1.498 two launches), gpu_smoke, the rows
if [ "$1" = i ]; then
  timeout 150 python -m pytest tests/kernels/test_fused_rotary_attention.py tests/kernels/test_qk_norm_rope_store.py \
    tests/engine/test_cuda_graph.py -x -q -p no:warnings > $OUT/pytest_gpu.log 2>&1
  echo "pytest rc=$?"; tail -3 $OUT/pytest_gpu.log
  for r in 1 0 1 0; do DIFFULEX_FUSED_ROTARY=$r $W --tag fused_rotary$r 2>&1 | grep WHATIF; done
  timeout 150 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke.json 2>&1 | quiet | tail -12
  $TP --models 1.7b --batch-sizes 1 64 --buffer-sizes 1 --out $OUT/tp_1p7b.json 2>&1 | quiet | tail -4
fi
#   j: final code: gpu_smoke (float32 = reference; bf16 vs fp32 agreement) and the throughput rows
if [ "$1" = j ]; then
  timeout 150 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke.json 2>&1 | quiet | tail -16
  $TP --models 1.7b --batch-sizes 1 64 --buffer-sizes 1 --out $OUT/tp_1p7b.json 2>&1 | quiet | tail -4
fi
