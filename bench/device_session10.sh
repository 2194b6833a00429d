#!/bin/bash
# Session-10 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# Compiled kernels survive between calls on a warm machine (ignored paths there are kept): the GPU kernel tests
# compile a few hundred kernel variants (~7 s per paged-attention test when cold), so they fit a call only warm.
export TRITON_CACHE_DIR=$PWD/.triton_cache
# parts b-d time experiment switches and stamps that live in a patch, applied for the part and taken out after it
STAMPS=bench/patches/attention_stamps.patch
case "$1" in b|c|d|f|trace) patch -p1 -s < $STAMPS; trap 'patch -p1 -R -s < $STAMPS' EXIT ;; esac
nvidia-smi --query-gpu=name --format=csv,noheader
quiet() { grep -v -i "warn"; }
W="timeout 150 python bench/what_if.py --model 1.7b --steps 100"
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds ${SECONDS_PER_RUN:-3}"
#   a: the last two sessions' kernel changes on a GPU (skinny epilogue of 828c736, `_cache_rows` of a228cbe): the
#      skinny-GEMM and paged-attention tests, each in its own time budget; which profilers the machine has
if [ "$1" = a ]; then
  which ncu nsys 2>&1; ls -d /usr/local/cuda*/bin 2>&1 | head -3
  timeout 270 python -m pytest tests/kernels/test_skinny_gemm.py -q -p no:warnings > $OUT/pytest_skinny.log 2>&1
  echo "skinny pytest rc=$?"; tail -3 $OUT/pytest_skinny.log
  timeout 270 python -m pytest tests/kernels/test_paged_attention.py -q -p no:warnings > $OUT/pytest_attn.log 2>&1
  echo "attention pytest rc=$?"; tail -3 $OUT/pytest_attn.log
fi
#   b: (experiment) what attention's ~7 us in the batch-1 chain are made of: globaltimer stamps inside the launch
#      (bench/attention_trace.py, with the stamping patch applied), then Nsight Compute's per-instruction stall
#      samples of one attention launch of a graph replay (run alone by the profiler)
if [ "$1" = b ] || [ "$1" = trace ]; then
  timeout 150 python bench/attention_trace.py 2>&1 | grep -E "TRACE|SUMMARY|programs|event|Error|error" | head -80
fi
if [ "$1" = b ]; then
  timeout 240 ncu --kernel-name regex:_paged_attention_kernel --launch-skip 400 --launch-count 1 --set full \
    --import-source yes --cache-control none --warp-sampling-interval 0 -f -o $OUT/attn \
    python bench/what_if.py --model 1.7b --steps 20 > $OUT/ncu.log 2>&1
  echo "ncu rc=$?"; tail -3 $OUT/ncu.log
  ncu -i $OUT/attn.ncu-rep --page source --csv --print-source sass > $OUT/attn_sass.csv 2>&1
  ncu -i $OUT/attn.ncu-rep --page details > $OUT/attn_details.txt 2>&1
  grep -E "Duration|Elapsed Cycles|Registers|Achieved Occupancy|Warp Cycles Per Issued" $OUT/attn_details.txt | head
fi
#   c: (experiment) when attention lets the next GEMM start (its weight prefetch floods the memory system while
#      attention's own loads are in flight): stamps and the replay, releasing at the start / after the key loops /
#      after publishing the partial, with and without the cached-key prefetch before the wait
if [ "$1" = c ]; then
  for v in "start 128" "loops 128" "publish 128" "start 0" "loops 0" "start 128" "loops 128"; do
    set -- $v
    export DIFFULEX_ATTN_RELEASE=$1 DIFFULEX_ATTN_PREFETCH_KEYS=$2
    echo "== release=$1 prefetch_keys=$2"
    timeout 100 python bench/attention_trace.py 2>&1 | grep -E "SUMMARY|Error"
    $W --tag release_$1_pk$2 2>&1 | grep WHATIF
  done
fi
#   d: (experiment) upper bounds of the split combine (partials published but not combined; partials stored with
#      no fence or count), and the tile's own cost: warps, pipeline stages, 32-key tiles
if [ "$1" = d ]; then
  for v in "full 4 2 0 64" "nocombine 4 2 0 64" "noatomic 4 2 0 64" "full 2 2 0 64" "full 8 2 0 64" \
      "full 4 1 0 64" "full 4 2 32 32" "full 2 1 32 32" "full 4 2 0 64"; do
    set -- $v
    export DIFFULEX_ATTN_COMBINE=$1 DIFFULEX_ATTN_WARPS=$2 DIFFULEX_ATTN_STAGES=$3 DIFFULEX_ATTN_BLOCK_N=$4 \
      DIFFULEX_ATTN_MIN_SPLIT=$5
    echo "== combine=$1 warps=$2 stages=$3 block_n=$4 min_split=$5"
    [ -n "$TRACE" ] && timeout 100 python bench/attention_trace.py 2>&1 | grep -E "SUMMARY|Error"
    $W --tag v_$1_$2_$3_$4 2>&1 | grep -E "WHATIF|Error"
  done
fi
#   e: one pipeline stage for split attention programs: GPU split tests, the batch-1 replay A/B (two each,
#      alternating), the batch-1 attention alone at contexts 128-4096, then one decode step's anatomy at batch 1
if [ "$1" = e ]; then
  timeout 150 python -m pytest tests/kernels/test_paged_attention.py -x -q -p no:warnings -k "split or auto" \
    > $OUT/pytest_attn.log 2>&1; echo "pytest rc=$?"; tail -1 $OUT/pytest_attn.log
  RW="timeout 150 python bench/run_with.py diffulex.kernels.paged_attention._STAGES_SPLIT"
  for st in 1 2 1 2; do $RW=$st -- bench/what_if.py --model 1.7b --steps 100 --tag stages$st 2>&1 | grep WHATIF; done
  for st in 1 2; do
    $RW=$st -- bench/attention_splits.py --out $OUT/attention_splits_stages$st.json 2>&1 | quiet | tail -12
  done
  timeout 200 python bench/step_anatomy.py --model 1.7b --batch 1 --steps 40 --top 30 2>&1 | quiet | tail -50
fi
#   f: (experiment, run before the change landed; the patch applies to commit 4d00991 only) the qkv GEMM lets the kernels after it start before its weight stream (its successors, the q/k
#      norm + rotary and attention, then do their prologues while it streams): stamps and replays, alternating
if [ "$1" = f ]; then
  patch -p1 -s < bench/patches/early_release.patch
  trap 'patch -p1 -R -s < bench/patches/early_release.patch; patch -p1 -R -s < $STAMPS' EXIT
  for n in none 4096 none 4096 all; do
    export DIFFULEX_EARLY_RELEASE_N=$n
    echo "== early release for N=$n"
    [ -n "$TRACE" ] && timeout 100 python bench/attention_trace.py 2>&1 | grep -E "SUMMARY|Error"
    $W --tag early_$n 2>&1 | grep -E "WHATIF|Error"
  done
fi
#   g: final code on a GPU: the kernel and graph tests touched this session, gpu_smoke (float32 = reference,
#      bf16 against float32)
if [ "$1" = g ]; then
  timeout 330 python -m pytest tests/kernels/test_skinny_gemm.py tests/engine/test_cuda_graph.py \
    tests/kernels/test_attention_op.py tests/engine/test_micro_batches.py -x -q -p no:warnings > $OUT/pytest_gpu.log 2>&1
  echo "pytest rc=$?"; tail -3 $OUT/pytest_gpu.log
  timeout 200 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke.json 2>&1 | quiet | tail -16
fi
#   h: final code: the batch-1 replay kernel by kernel, then the throughput rows (SDAR-1.7B batch 1 and 64,
#      SDAR-8B batch 1)
if [ "$1" = h ]; then
  $W --tag final --timeline 2>&1 | grep -E "WHATIF|CHAIN"
  $TP --models 1.7b --batch-sizes 1 64 --buffer-sizes 1 --out $OUT/tp_1p7b.json 2>&1 | quiet | tail -4
  $TP --models 8b --batch-sizes 1 --buffer-sizes 1 --out $OUT/tp_8b.json 2>&1 | quiet | tail -3
fi
#   i: (check) batch 64 against session 8's code, in alternating order on one machine; before the call:
#      mkdir ab_old && git archive 17d1882 diffulex | tar -x -C ab_old (untracked, so it travels; delete it after): batch 64 runs cuBLAS GEMMs and unsplit attention, which no change since
#      was meant to touch
if [ "$1" = i ]; then
  for tree in new old new old; do
    if [ $tree = old ]; then P=$PWD/ab_old; else P=$PWD; fi
    PYTHONPATH=$P $TP --models 1.7b --batch-sizes 64 --buffer-sizes 1 --out $OUT/tp_b64_$tree.json 2>&1 | quiet \
      | grep sdar | sed "s/^/$tree /"
  done
fi
