#!/bin/bash
# Session-7 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
#   a: the sampling graph on the GPU: graph/kernel tests with real capture, gpu_smoke (graphs vs eager vs the
#      reference decoder, bf16 vs fp32 on the built-in model)
#   b: SDAR-1.7B decode throughput with the sampling graph off and on (A/B on one machine), then the host phases
#      of a batch-64 step with it on
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds ${SECONDS_PER_RUN:-3} $EXTRA"
quiet() { grep -v -i "warn"; }
if [ "$1" = a ]; then
  timeout 240 python -m pytest tests/engine/test_cuda_graph.py tests/engine/test_micro_batches.py \
    tests/kernels/test_top1.py tests/kernels/test_acceptance.py -x -q -p no:warnings > $OUT/pytest_gpu.log 2>&1
  echo "pytest rc=$?"; tail -3 $OUT/pytest_gpu.log
  timeout 300 python bench/gpu_smoke.py --builtin-problems 40 --out $OUT/gpu_smoke.json 2>&1 | quiet | tail -40
elif [ "$1" = b ]; then
  for gs in 0 1; do
    echo "== DIFFULEX_GRAPH_SAMPLING=$gs"
    DIFFULEX_GRAPH_SAMPLING=$gs $TP --models 1.7b --batch-sizes 1 64 128 --buffer-sizes 1 \
      --out $OUT/tp_1p7b_gs$gs.json 2>&1 | quiet | tail -5
  done
  timeout 120 python bench/step_phases.py --batch 64 2>&1 | quiet | tail -22
fi
if [ "$1" = c ]; then
  # micro-batches again, now that a greedy step's host launch no longer includes the sampler's launches
  for mb in 1 2; do
    echo "== micro_batches=$mb"
    $TP --models 1.7b --batch-sizes 32 64 128 --buffer-sizes 1 --micro-batches $mb \
      --out $OUT/tp_1p7b_mb$mb.json 2>&1 | quiet | tail -4
  done
  timeout 120 python bench/step_phases.py --batch 1 2>&1 | quiet | tail -16
fi
if [ "$1" = d ]; then
  # the engine reports a step after launching the next one; the sampling graph on; then an H200-comparable set
  $TP --models 1.7b --batch-sizes 1 64 128 --buffer-sizes 1 --out $OUT/tp_1p7b.json 2>&1 | quiet | tail -5
  timeout 120 python bench/step_phases.py --batch 64 2>&1 | quiet | tail -16
  [ -n "$WITH_8B" ] && $TP --models 8b --batch-sizes 1 --buffer-sizes 1 --out $OUT/tp_8b.json 2>&1 | quiet | tail -3
fi
if [ "$1" = e ]; then
  # A/B on one machine: reporting after the next launch (this tree) against completing before it (ENGINE_PREV,
  # the previous engine.py, swapped in and restored)
  for run in new prev new2 prev2; do
    case $run in prev*) cp diffulex/engine/engine.py /tmp/engine_new.py; cp "$ENGINE_PREV" diffulex/engine/engine.py;; esac
    echo "== $run"
    $TP --models 1.7b --batch-sizes 1 64 128 --buffer-sizes 1 --out $OUT/tp_1p7b_$run.json 2>&1 | quiet | tail -4
    case $run in prev*) cp /tmp/engine_new.py diffulex/engine/engine.py;; esac
  done
fi
