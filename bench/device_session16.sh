#!/bin/bash
# Session-16 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
source bench/device_helpers.sh
#   a: upper bound of folding the RMSNorms into the GEMMs after them, in the current chain: every norm removed,
#      also with o_proj releasing early (after the fold gate_up follows o_proj directly); baseline first and last
if [ "$1" = a ]; then
  $W --tag base 2>&1 | grep WHATIF
  $W --tag nonorm --skip norm 2>&1 | grep WHATIF
  $W --tag nonorm_oearly --skip norm --release-early 2048,2048 2>&1 | grep WHATIF
  $W --tag base 2>&1 | grep WHATIF
  $W --tag nonorm --skip norm 2>&1 | grep WHATIF
  $W8 --tag base8 2>&1 | grep WHATIF
  $W8 --tag nonorm8 --skip norm 2>&1 | grep WHATIF
fi
#   b: (experiment, code since removed: bench/patches/normed_gemm.patch) RMSNorm folded into the GEMM after it
#      (`NormedInput`) against the separate norm launch; the skinny-GEMM kernel tests on the GPU; the timeline
if [ "$1" = b ]; then
  alternate fold nofold DIFFULEX_NORMED_GEMM=0
  timeout 200 python -m pytest -q -x tests/kernels/test_skinny_gemm.py 2>&1 | tail -3
  $W --tag fold_timeline --timeline --by-gemm 2>&1 | grep -E "WHATIF|CHAIN|^ " | head -40
fi
#   d: upper bound of the norm folded into the producer's split-K sum: o_proj / down_proj summing their splits
#      in the kernel (DIFFULEX_UNSUMMED=0), with and without the norm launches
if [ "$1" = d ]; then
  export DIFFULEX_NORMED_GEMM=0
  O4=2048,2048,4=64,128,4,6,1,4,1  # o_proj in 4 K splits, as unsummed
  for i in 1 2; do
    $W --tag base 2>&1 | grep WHATIF
    DIFFULEX_UNSUMMED=0 $W --table $O4 --tag summed 2>&1 | grep WHATIF
    DIFFULEX_UNSUMMED=0 $W --table $O4 --tag summed_nonorm --skip norm 2>&1 | grep WHATIF
    $W --tag nonorm --skip norm 2>&1 | grep WHATIF
  done
fi
#   e: a few whole batch-1 steps in order around the decoder layers (what_if --step-sequence), 1.7B
if [ "$1" = e ]; then
  $W --tag seq --step-sequence 2>&1 | grep -E "WHATIF|SEQ" | head -120
fi
#   f: the step's result stored home by a kernel (host_publish) and the one-gather embedding / rotary angles: the
#      kernel and graph tests on the GPU, then whole steps with and without the kernel store, alternating, and
#      the step's sequence as built
if [ "$1" = f ]; then
  gpu_tests f tests/kernels/test_host_publish.py tests/engine/test_cuda_graph.py tests/engine/test_continuation.py \
    tests/engine/test_micro_batches.py tests/kernels/test_fused_norm.py
  alternate publish copy DIFFULEX_KERNEL_PUBLISH=0
  $W --tag seq --step-sequence 2>&1 | grep -E "WHATIF|SEQ" | head -40
fi
#   g: the step's glue removed (top-1 and acceptance write the [2, N] result in place; kernel store home; one gather
#      each for the embedding and the rotary angles): the touched kernel and graph tests on the GPU, then whole
#      steps of this tree against the session's starting tree (bench/_ab/old, carried), alternating
if [ "$1" = g ]; then
  gpu_tests g tests/kernels/test_host_publish.py tests/kernels/test_top1.py tests/kernels/test_acceptance.py \
    tests/engine/test_cuda_graph.py tests/engine/test_continuation.py tests/engine/test_micro_batches.py
  alternate new old PYTHONPATH=$PWD/bench/_ab/old
  $W --tag seq --step-sequence 2>&1 | grep -E "SEQ" | head -16
fi
#   h: the embedding rows and the rotary angles in one launch (kernels/token_inputs.py): its test and the graph
#      tests on the GPU, whole steps against the tree before it (bench/_ab/prev, carried), alternating, and the
#      step's sequence
if [ "$1" = h ]; then
  gpu_tests h tests/kernels/test_token_inputs.py tests/engine/test_cuda_graph.py tests/engine/test_continuation.py
  alternate new prev PYTHONPATH=$PWD/bench/_ab/prev
  $W --tag seq --step-sequence 2>&1 | grep -E "SEQ" | head -10
fi
#   i: the final tree: nothing compiles inside a capture or a step (bench/jit_watch.py), the graph tests, one step loop
if [ "$1" = i ]; then
  gpu_tests i tests/engine/test_cuda_graph.py tests/engine/test_continuation.py tests/kernels/test_top1.py \
    tests/kernels/test_acceptance.py
  timeout 200 python bench/jit_watch.py --batch 1 2>&1 | grep -v -i warn | tail -6
  $W --tag final 2>&1 | grep WHATIF
fi
