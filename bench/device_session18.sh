#!/bin/bash
# Session-18 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
source bench/device_helpers.sh
quiet() { grep -v -i "warn"; }
#   a: session 17's untimed changes on a GPU: the warm-up tests of top-1 and acceptance, the q/k rotary reading its
#      angles after the PDL wait, the store-only step's skipped tail (engine tests with real capture), a step loop,
#      compiles while serving mixed greedy/drawing batches (expect 0), and gpu_smoke (float32 = reference)
if [ "$1" = a ]; then
  gpu_tests a tests/kernels/test_top1.py tests/kernels/test_acceptance.py tests/kernels/test_fused_norm.py \
    tests/kernels/test_qk_norm_rope_store.py tests/kernels/test_skinny_gemm.py tests/engine/test_cuda_graph.py \
    tests/engine/test_engine_matches_reference.py tests/engine/test_continuation.py
  $W --tag final 2>&1 | grep WHATIF
  timeout 200 python bench/jit_watch.py --mix 2>&1 | quiet | tail -8
  timeout 150 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke.json 2>&1 | quiet | tail -10
fi
#   b: the store-only step's skipped tail against the whole forward (DIFFULEX_FORWARD_READERS=0), alternating, then
#      the throughput rows of record
if [ "$1" = b ]; then
  alternate readers all DIFFULEX_FORWARD_READERS=0
  bash bench/device_session13.sh l
fi
#   c: which paged-attention variants compile while serving (jit_watch names the arguments whose specialization
#      changed); on an H200 the rows of record first
if [ "$1" = c ]; then
  case "$GPU" in *H200*) bash bench/device_session13.sh l ;; esac
  timeout 200 python bench/jit_watch.py --mix 2>&1 | quiet | tail -8
fi
#   d: the attention kernel's split count as a runtime argument, two tile classes, and its variants compiled at
#      build (paged_attention.warm_up): kernel and engine tests with real capture, compiles while serving
#      (expect 0), then whole steps against session 17's tree (bench/_ab/s17, carried), alternating
if [ "$1" = d ]; then
  gpu_tests d tests/kernels/test_paged_attention.py tests/kernels/test_attention_op.py \
    tests/engine/test_cuda_graph.py tests/engine/test_engine_matches_reference.py
  timeout 200 python bench/jit_watch.py --mix 2>&1 | quiet | tail -6
  alternate runtime s17 PYTHONPATH=$PWD/bench/_ab/s17
fi
#   e: part d's kernel tests with their durations (d's pytest ran out of time), the engine tests, then the split
#      count rounded up to a power of two (bench/_ab/pow2) against as built, alternating
if [ "$1" = e ]; then
  timeout 330 python -m pytest tests/kernels/test_paged_attention.py -x -q -p no:warnings --durations=12 > $OUT/pytest_e.log 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|error|s call" $OUT/pytest_e.log | head -16
  gpu_tests e2 tests/kernels/test_attention_op.py tests/engine/test_cuda_graph.py tests/engine/test_engine_matches_reference.py
  alternate runtime pow2 PYTHONPATH=$PWD/bench/_ab/pow2
fi
#   f: on an H200 only, the rows of record and the step loops (nothing on an H100)
if [ "$1" = f ]; then
  case "$GPU" in *H200*) bash bench/device_session13.sh l; $W --tag h200 2>&1 | grep WHATIF; $W8 --tag h200 2>&1 | grep WHATIF ;; esac
fi
#   g: SDAR-MoE on a GPU: the MoE and SDAR-MoE tests (the grouped and dense paths captured in a CUDA graph; the
#      float32 engine against the reference decoder), then bf16 graphs against eager on a small MoE geometry
if [ "$1" = g ]; then
  gpu_tests g tests/layers/test_moe.py tests/models/test_sdar_moe.py tests/models/test_families.py -k "moe"
  grep -E "passed|failed" $OUT/pytest_g.log | tail -2
  timeout 200 python bench/moe_smoke.py --out $OUT/moe_smoke.json 2>&1 | quiet | tail -14
fi
#   h: where graphs and eager part in part g: float32 (the dense path), and bf16 with the dense path forced
if [ "$1" = h ]; then
  for args in "--dtype float32" "--impl dense" "--impl grouped"; do
    timeout 150 python bench/moe_smoke.py $args 2>&1 | grep -E "agreement|ms_per|paths|rror"
  done
fi
#   i: LLaDA2 on a GPU: its tests and the MoE tests with real CUDA (families, layers, config), then graphs against
#      eager on a small LLaDA2 geometry (block 32) in bf16 and float32
if [ "$1" = i ]; then
  gpu_tests i tests/layers tests/models/test_llada2.py tests/models/test_families.py -k "llada2 or moe or rotary"
  for args in "" "--dtype float32"; do
    timeout 150 python bench/moe_smoke.py --family llada2 $args --out $OUT/moe_smoke_llada2${args:+_fp32}.json 2>&1 \
      | grep -E "agreement|ms_per|paths|engine_steps|rror"
  done
fi
#   j: a random-weight LLaDA2.0-mini geometry (16B, 256 experts, block 32), one request: ms per step with graphs
if [ "$1" = j ]; then
  timeout 240 python bench/llada2_mini_step.py --out $OUT/llada2_mini_step.json 2>&1 | quiet | tail -14
fi
