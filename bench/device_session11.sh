#!/bin/bash
# Session-11 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# Compiled kernels survive between calls on a warm machine (ignored paths there are kept).
export TRITON_CACHE_DIR=$PWD/.triton_cache
nvidia-smi --query-gpu=name --format=csv,noheader
quiet() { grep -v -i "warn"; }
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds ${SECONDS_PER_RUN:-3}"
# engine_tests: the graph, continuation and micro-batch tests with real capture
engine_tests() {
  timeout 200 python -m pytest tests/engine/test_cuda_graph.py tests/engine/test_continuation.py \
    tests/engine/test_micro_batches.py -x -q -p no:warnings > $OUT/pytest_engine.log 2>&1
  echo "engine pytest rc=$?"; tail -2 $OUT/pytest_engine.log
}
# rows MODEL BATCH MODE...: one throughput row per mode (async-scheduling / no-async-scheduling), in that order
rows() {
  local model=$1 batch=$2; shift 2
  for mode in "$@"; do
    $TP --$mode --models $model --batch-sizes $batch --buffer-sizes 1 --out $OUT/tp_${model/./p}_b${batch}_$mode.json \
      2>&1 | quiet | grep sdar | sed "s/^/$mode /"
  done
}
ON=async-scheduling OFF=no-async-scheduling
#   a: continuation steps on a GPU: the kernels they changed or added (top-1's rows that are not read, acceptance
#      of rows at -inf, the input advance), the engine tests, and gpu_smoke (float32 = reference decoder with
#      graphs, now continued; bf16 against float32)
if [ "$1" = a ]; then
  timeout 200 python -m pytest tests/kernels/test_top1.py tests/kernels/test_acceptance.py \
    tests/kernels/test_step_advance.py -x -q -p no:warnings > $OUT/pytest_kernels.log 2>&1
  echo "kernel pytest rc=$?"; tail -2 $OUT/pytest_kernels.log
  engine_tests
  timeout 170 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke.json 2>&1 | quiet | tail -16
fi
#   b: the throughput rows with and without continuation steps, alternating on one machine: SDAR-1.7B batch 1
#      (twice each) and 64, SDAR-8B batch 1
if [ "$1" = b ]; then
  rows 1.7b 1 $ON $OFF $ON $OFF
  for mode in $ON $OFF; do rows 1.7b 64 $mode; rows 8b 1 $mode; done
fi
#   c: after continuations that only store are applied without a wait: the engine tests, then the SDAR-1.7B rows
#      with and without continuations, alternating (batch 1 three times each, batch 64 once)
if [ "$1" = c ]; then
  engine_tests
  rows 1.7b 1 $ON $OFF $ON $OFF $ON $OFF
  rows 1.7b 64 $ON $OFF
fi
#   d: the rows on another machine (an H200): SDAR-1.7B batch 1 with and without continuations (twice each,
#      alternating), batch 64 with and without, SDAR-8B batch 1 with
if [ "$1" = d ]; then
  rows 1.7b 1 $ON $OFF $ON $OFF
  rows 1.7b 64 $ON $OFF
  rows 8b 1 $ON
fi
