#!/bin/bash
# Session-17 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
source bench/device_helpers.sh
#   a: session 16's last change on a GPU (the kernel store's probe at graph build: graph, continuation and store
#      tests), then a step loop as built; on an H200 the rows of record first
if [ "$1" = a ]; then
  case "$GPU" in *H200*) bash bench/device_session13.sh l ;; esac
  gpu_tests a tests/kernels/test_host_publish.py tests/engine/test_cuda_graph.py tests/engine/test_continuation.py
  $W --tag base 2>&1 | grep WHATIF
  $W --tag seq --step-sequence 2>&1 | grep -E "SEQ" | head -30
fi
#   b: (experiment, code since removed: bench/patches/l2_warm.patch) the q/k norm + rotary launch, once q/k/v are done, brings the first MB of the layer's gate_up
#      weight into L2 (bulk prefetch) while attention and o_proj run: budgets swept, baseline first and last
if [ "$1" = b ]; then
  for mb in 0 8 16 24 32 0; do DIFFULEX_L2_WARM_MB=$mb $W --tag warm$mb 2>&1 | grep -E "WHATIF|rror" | head -3; done
  for mb in 0 16 32 0; do DIFFULEX_L2_WARM_MB=$mb $W8 --tag warm8b_$mb 2>&1 | grep -E "WHATIF|rror" | head -3; done
fi
#   c: (experiment, removed: bench/patches/l2_warm.patch) the same with small budgets, and per-line prefetches instead of bulk requests
if [ "$1" = c ]; then
  for mb in 0 2 4; do DIFFULEX_L2_WARM_MB=$mb $W --tag warm$mb 2>&1 | grep -E "WHATIF|rror" | head -3; done
  for mb in 2 8; do DIFFULEX_L2_WARM_LINES=1 DIFFULEX_L2_WARM_MB=$mb $W --tag warmlines$mb 2>&1 | grep -E "WHATIF|rror" | head -3; done
  DIFFULEX_L2_WARM_MB=0 $W --tag warm0 2>&1 | grep -E "WHATIF|rror" | head -3
fi
#   d: (experiment, removed: bench/patches/l2_warm.patch) the warm-up as a kernel of its own on a side stream of the graph (after q/k/v, joined at the
#      final norm), so that its requests are off the critical path: bulk and per-line, budgets
if [ "$1" = d ]; then
  export DIFFULEX_L2_WARM_SIDE=1
  for mb in 0 4 8 16; do DIFFULEX_L2_WARM_MB=$mb $W --tag side$mb 2>&1 | grep -E "WHATIF|rror" | head -3; done
  for mb in 4 8 16; do DIFFULEX_L2_WARM_LINES=1 DIFFULEX_L2_WARM_MB=$mb $W --tag sidelines$mb 2>&1 | grep -E "WHATIF|rror" | head -3; done
  DIFFULEX_L2_WARM_PROGRAMS=64 DIFFULEX_L2_WARM_LINES=1 DIFFULEX_L2_WARM_MB=8 $W --tag sidelines8_p64 2>&1 | grep -E "WHATIF|rror" | head -3
  DIFFULEX_L2_WARM_MB=0 $W --tag side0 2>&1 | grep -E "WHATIF|rror" | head -3
fi
#   e: a greedy batch-1 step as one graph (forward and sampling, `DecodeGraphs.fuses_forward`): the engine tests
#      with real capture, whole steps fused and not (DIFFULEX_FUSED_STEP_GRAPH=0), alternating, and the step's
#      sequence
if [ "$1" = e ]; then
  gpu_tests e tests/engine/test_engine_matches_reference.py tests/engine/test_cuda_graph.py \
    tests/engine/test_continuation.py tests/engine/test_micro_batches.py
  alternate fused split DIFFULEX_FUSED_STEP_GRAPH=0
  $W --tag seq --step-sequence 2>&1 | grep -E "SEQ" | head -14
fi
#   f: the sampler's kernels (top-1, acceptance, advance, host store) chained by programmatic dependent launch:
#      their kernel tests and the engine tests with real capture, then whole steps against the tree before it
#      (bench/_ab/fused, carried), alternating, and the step's sequence
if [ "$1" = f ]; then
  gpu_tests f tests/kernels/test_top1.py tests/kernels/test_acceptance.py tests/kernels/test_step_advance.py \
    tests/kernels/test_host_publish.py tests/engine/test_engine_matches_reference.py tests/engine/test_cuda_graph.py \
    tests/engine/test_continuation.py tests/engine/test_micro_batches.py
  alternate pdl fused PYTHONPATH=$PWD/bench/_ab/fused
  $W --tag seq --step-sequence 2>&1 | grep -E "SEQ" | head -8
fi
#   g: (not run in session 17: the device budget was spent) the last changes on a GPU: the warm-up tests of top-1
#      and acceptance, the q/k rotary reading its angles after the PDL wait (its kernel tests and a step loop),
#      and compiles while serving mixed greedy/drawing batches (bench/jit_watch.py --mix, expect 0)
if [ "$1" = g ]; then
  gpu_tests g tests/kernels/test_top1.py tests/kernels/test_acceptance.py tests/kernels/test_fused_norm.py \
    tests/kernels/test_qk_norm_rope_store.py tests/engine/test_cuda_graph.py
  $W --tag final 2>&1 | grep WHATIF
  timeout 300 python bench/jit_watch.py --mix 2>&1 | grep -v -i warn | tail -12
fi
#   h: (for session 18) a step that reads no row (it only stores a finished block) skips the last layer's o_proj,
#      gate_up and down: the engine tests with real capture and gpu_smoke-style correctness, then whole steps with
#      and without (DIFFULEX_FORWARD_READERS=0), alternating
if [ "$1" = h ]; then
  gpu_tests h tests/kernels/test_skinny_gemm.py tests/engine/test_engine_matches_reference.py \
    tests/engine/test_cuda_graph.py tests/engine/test_continuation.py
  alternate readers all DIFFULEX_FORWARD_READERS=0
fi
