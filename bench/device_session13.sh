#!/bin/bash
# Session-13 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
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
# alternate TAG_A TAG_B VAR=VALUE...: the batch-1 replay at 1.7B twice and 8B once, as built (TAG_A) and with the
# variables set (TAG_B), in turn
alternate() {
  local a=$1 b=$2; shift 2
  for w in "$W" "$W" "$W8"; do
    $w --tag $a 2>&1 | grep WHATIF
    env "$@" $w --tag $b 2>&1 | grep WHATIF
  done
}
#   a: (experiment, code since removed) every skinny GEMM's first K tiles loaded into registers before its PDL wait:
#      slower (docs/benchmarks.md, session 13)
#   b: (experiment) which skinny GEMMs should let their dependents start at once (qkv does already), and the L2
#      prefetch budget per matrix with every GEMM releasing early; baseline first and last, then the timeline
if [ "$1" = b ]; then
  $W --tag base 2>&1 | grep WHATIF
  $W --tag early_all --release-early all 2>&1 | grep WHATIF
  for s in 2048,2048 12288,2048 2048,6144; do $W --tag early_$s --release-early $s 2>&1 | grep WHATIF; done
  for mb in 8 12 24; do $W --tag early_all_mb$mb --release-early all --prefetch-mb $mb 2>&1 | grep WHATIF; done
  $W --tag base 2>&1 | grep WHATIF
  $W --tag early_all_timeline --release-early all --timeline 2>&1 | grep -E "WHATIF|CHAIN"
fi
#   c: (experiment) smaller L2 prefetch budgets with every GEMM (or all but o_proj) releasing early, and the budget
#      alone; baseline first and last
if [ "$1" = c ]; then
  $W --tag base 2>&1 | grep WHATIF
  for mb in 0 2 4 6 8; do $W --tag early_all_mb$mb --release-early all --prefetch-mb $mb 2>&1 | grep WHATIF; done
  for mb in 4 8; do
    $W --tag early_noo_mb$mb --release-early 12288,2048 2048,6144 --prefetch-mb $mb 2>&1 | grep WHATIF
  done
  $W --tag late_mb8 --prefetch-mb 8 2>&1 | grep WHATIF
  $W --tag base 2>&1 | grep WHATIF
fi
#   d: the large GEMMs releasing early with a 4 MB prefetch budget (as built now) against the old rule (every release
#      after the stream, 16 MB), alternating, SDAR-1.7B and 8B (8B also with 8 MB); upper bounds and the timeline in
#      the new regime
OLD="env DIFFULEX_SKINNY_EARLY_RELEASE=0"
W8="${W/1.7b/8b}"
if [ "$1" = d ]; then
  for i in 1 2; do
    $W --tag new 2>&1 | grep WHATIF
    $OLD $W --tag old --prefetch-mb 16 2>&1 | grep WHATIF
  done
  $W8 --tag new 2>&1 | grep WHATIF
  $OLD $W8 --tag old --prefetch-mb 16 2>&1 | grep WHATIF
  $W8 --tag new_mb8 --prefetch-mb 8 2>&1 | grep WHATIF
  for s in norm attn norm,attn; do $W --tag skip_$s --skip $s 2>&1 | grep WHATIF; done
  $W --tag timeline --timeline 2>&1 | grep -E "WHATIF|CHAIN"
fi
#   e: throughput rows of the final code; the kernels and the engine with real capture, gpu_smoke
if [ "$1" = e ]; then
  for i in 1 2; do TAG=_$i rows 1.7b 1 $ON; done
  rows 1.7b 64 $ON
  rows 8b 1 $ON
  timeout 200 python -m pytest tests/kernels/test_skinny_gemm.py tests/kernels/test_paged_attention.py \
    tests/kernels/test_top1.py -x -q -p no:warnings > $OUT/pytest_kernels.log 2>&1
  echo "kernel pytest rc=$?"; tail -2 $OUT/pytest_kernels.log
  timeout 120 python -m pytest tests/engine/test_cuda_graph.py tests/engine/test_continuation.py \
    -x -q -p no:warnings > $OUT/pytest_engine.log 2>&1
  echo "engine pytest rc=$?"; tail -2 $OUT/pytest_engine.log
fi
#   f: (session 14, on the machine if drawn) the final code's batch-1 replay, two variants in the new regime
#      (down_proj with 128-wide K tiles and 6 stages; attention capped at 2 splits), baseline first and last;
#      throughput rows
if [ "$1" = f ]; then
  $W --tag new 2>&1 | grep WHATIF
  $W --tag down_k128 --table 2048,6144,4=64,128,4,6,1,4 2>&1 | grep WHATIF
  $W --tag attn2 --attn-splits 2 2>&1 | grep WHATIF
  $W --tag new 2>&1 | grep WHATIF
  for i in 1 2; do TAG=_$i rows 1.7b 1 $ON; done
  rows 8b 1 $ON
  rows 1.7b 64 $ON
fi
#   g: (session 14, experiment) warps of the RMSNorm (8 built for 2048-wide rows) and q/k norm + rotary (4 built)
#      programs in the batch-1 chain; baseline first and last
if [ "$1" = g ]; then
  $W --tag new 2>&1 | grep WHATIF
  for w in 2 4 16; do $W --tag norm_w$w --norm-warps $w 2>&1 | grep WHATIF; done
  for w in 1 2; do $W --tag rope_w$w --rope-warps $w 2>&1 | grep WHATIF; done
  $W --tag new 2>&1 | grep WHATIF
fi
#   h: (session 15, experiment, code since removed: slower) q/k norm + rotary + KV store inside the attention launch
#      (DIFFULEX_ATTN_ROTARY=1)
#      against the separate launch: its kernel tests, the engine tests and gpu_smoke with it on, then the batch-1
#      replay alternating (1.7B twice each, 8B once each) and the timeline with it on (h1: the tests, h2: the timings)
ROT="env DIFFULEX_ATTN_ROTARY=1"
if [ "$1" = h ] || [ "$1" = h1 ]; then
  $ROT timeout 200 python -m pytest tests/kernels/test_paged_attention.py -x -q -p no:warnings -k "rotat or rotary" \
    > $OUT/pytest_rotary.log 2>&1; echo "rotary kernel pytest rc=$?"; tail -2 $OUT/pytest_rotary.log
  $ROT timeout 200 python -m pytest tests/engine/test_cuda_graph.py tests/engine/test_continuation.py -x -q \
    -p no:warnings > $OUT/pytest_engine_rotary.log 2>&1; echo "engine pytest rc=$?"; tail -2 $OUT/pytest_engine_rotary.log
  $ROT timeout 150 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke_rotary.json 2>&1 | quiet | tail -6
fi
if [ "$1" = h ] || [ "$1" = h2 ]; then
  alternate separate rotary DIFFULEX_ATTN_ROTARY=1
  $ROT $W --tag rotary_timeline --timeline 2>&1 | grep -E "WHATIF|CHAIN"
  # the RMSNorm's warps: 32 at 1.7B, and the 8B's 16 (built, unmeasured) against its former 8
  $W --tag norm_w32 --norm-warps 32 2>&1 | grep WHATIF
  $W8 --tag norm_w8 --norm-warps 8 2>&1 | grep WHATIF
  $W8 --tag norm_w16 2>&1 | grep WHATIF
fi
#   i: (session 15) where a whole batch-1 step goes beyond the forward replay (sampling graph, copies, gaps)
if [ "$1" = i ]; then
  $W --tag step_timeline --step-timeline 2>&1 | grep -E "WHATIF|STEP"
fi
#   j: (session 15, experiment) L2 prefetch budgets of single matrices at 1.7B (o_proj 2048x2048 whole = 8 MB, q/k/v
#      4096x2048 8 / 16 MB, down 8 MB, gate_up 12 MB; 4 MB each as built), and the upper bound of attention
#      handing its split partials on uncombined (what folding the combine into o_proj could save at most);
#      baseline first and last
if [ "$1" = j ]; then
  $W --tag base 2>&1 | grep WHATIF
  $W --tag o8 --prefetch-for 2048,2048=8 2>&1 | grep WHATIF
  $W --tag qkv8 --prefetch-for 4096,2048=8 2>&1 | grep WHATIF
  $W --tag qkv16 --prefetch-for 4096,2048=16 2>&1 | grep WHATIF
  $W --tag down8 --prefetch-for 2048,6144=8 2>&1 | grep WHATIF
  $W --tag gateup12 --prefetch-for 12288,2048=12 2>&1 | grep WHATIF
  $W --tag o8_qkv16 --prefetch-for 2048,2048=8 4096,2048=16 2>&1 | grep WHATIF
  patch -p1 -s < bench/patches/attention_no_combine.patch
  $W --tag attn_no_combine 2>&1 | grep WHATIF
  patch -p1 -R -s < bench/patches/attention_no_combine.patch
  $W --tag base 2>&1 | grep WHATIF
fi
#   k: (session 15, experiment, code since removed: slower; bench/patches/attention_partials_in_o_proj.patch applies
#      it) o_proj merges attention's split partials (DIFFULEX_ATTN_PARTIALS, on) against attention merging its own (=0): the kernel tests, the engine tests with real capture and gpu_smoke, then the batch-1 replay
#      alternating (1.7B twice each, 8B once each) and the timeline (k1: the tests, k2: the timings)
if [ "$1" = k ] || [ "$1" = k1 ]; then
  timeout 300 python -m pytest tests/kernels/test_paged_attention.py tests/kernels/test_skinny_gemm.py -x -q \
    -p no:warnings > $OUT/pytest_kernels.log 2>&1; echo "kernel pytest rc=$?"; tail -2 $OUT/pytest_kernels.log
  timeout 150 python -m pytest tests/engine/test_cuda_graph.py tests/engine/test_continuation.py -x -q \
    -p no:warnings > $OUT/pytest_engine.log 2>&1; echo "engine pytest rc=$?"; tail -2 $OUT/pytest_engine.log
  timeout 240 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke.json 2>&1 | quiet | tail -8
fi
if [ "$1" = k ] || [ "$1" = k2 ]; then
  alternate partials merged DIFFULEX_ATTN_PARTIALS=0
  $W --tag partials_timeline --timeline 2>&1 | grep -E "WHATIF|CHAIN"
fi
#   l: (session 15) throughput rows of the final code
if [ "$1" = l ]; then
  for i in 1 2; do TAG=_$i rows 1.7b 1 $ON; done
  rows 8b 1 $ON
  rows 1.7b 64 $ON
fi
#   m: (session 15, experiment, code since removed: cuBLAS wins every shape) a tiled Triton GEMM against cuBLAS at
#      M = 256 and 512 (batch 64 and 128)
if [ "$1" = m ]; then
  timeout 500 python bench/tiled_gemm_bench.py --out $OUT/tiled_gemm.json 2>&1 | grep -E "BEST|WRONG|peak|rror"
fi
#   n: (session 15, experiment) fewer attention splits with more of their keys in L2 before the PDL wait: unsplit
#      (with 128 / 512 prefetched keys), at least 128 / 256 keys per split, 256 prefetched keys; baseline first and
#      last
if [ "$1" = n ]; then
  $W --tag base 2>&1 | grep WHATIF
  $W --tag unsplit --attn-splits 1 2>&1 | grep WHATIF
  $W --tag unsplit_pf512 --attn-splits 1 --attn-prefetch-keys 512 2>&1 | grep WHATIF
  $W --tag min128 --attn-min-keys 128 2>&1 | grep WHATIF
  $W --tag min256_pf256 --attn-min-keys 256 --attn-prefetch-keys 256 2>&1 | grep WHATIF
  $W --tag pf256 --attn-prefetch-keys 256 2>&1 | grep WHATIF
  $W --tag base 2>&1 | grep WHATIF
fi
#   o: (session 15, experiment) the batch-1 chain per projection (--by-gemm), then skinny-GEMM configs tried in the
#      chain rather than alone: q/k/v with 128 programs (32-column tiles) / 8 stages / 2 K splits; o_proj with
#      32-column tiles (2 splits) / 4 stages; gate_up with 6 stages / 64-wide K tiles and 8 stages; down_proj through
#      TMA with 128-wide K tiles / 32-column tiles (2 splits); baseline first and last
if [ "$1" = o ]; then
  $W --tag base --timeline --by-gemm 2>&1 | grep -E "WHATIF|CHAIN"
  for t in 4096,2048,4=32,128,4,6,1,1,1 4096,2048,4=64,128,4,8,1,1,1 4096,2048,4=64,128,4,6,1,2,1 \
           2048,2048,4=32,128,4,6,1,1,1 2048,2048,4=64,128,4,4,1,1,1 \
           12288,2048,4=128,128,4,6,1,1,1 12288,2048,4=128,64,4,8,1,1,1 \
           2048,6144,4=64,128,4,6,1,4,1 2048,6144,4=32,256,4,3,1,2,0; do
    $W --tag cfg --table $t 2>&1 | grep WHATIF
  done
  $W --tag base 2>&1 | grep WHATIF
fi
