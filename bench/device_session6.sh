#!/bin/bash
# Session-6 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
#   a: micro-batch tests on the GPU (captured graphs, staging outside the graph, pinned async results), the
#      kernel smoke, then SDAR-1.7B decode throughput with micro_batches 1 and 2 (A/B on one machine)
#   b: SDAR-8B and SDAR-4B with micro_batches 1 and 2 at the batch sizes where the host path matters
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
TP="python -m diffulex.cli bench throughput --data-dir tests/data/sdar-4b-chat --max-seconds ${SECONDS_PER_RUN:-3} $EXTRA"
quiet() { grep -v -i "warn"; }
if [ "$1" = a ]; then
  timeout 200 python -m pytest tests/engine/test_micro_batches.py tests/engine/test_cuda_graph.py -x -q \
    > $OUT/pytest_gpu.log 2>&1
  echo "pytest rc=$?"; tail -2 $OUT/pytest_gpu.log
  python bench/host_path.py --batch-sizes 1 64 128 --json $OUT/host_path.json 2>&1 | tail -4
  for mb in 1 2; do
    $TP --models 1.7b --batch-sizes 1 32 64 128 --buffer-sizes 1 --micro-batches $mb \
      --out $OUT/tp_1p7b_mb$mb.json 2>&1 | quiet | tail -7
  done
elif [ "$1" = b ]; then
  for mb in 1 2; do
    timeout 280 $TP --models 8b --batch-sizes 32 64 --buffer-sizes 1 --micro-batches $mb \
      --out $OUT/tp_8b_mb$mb.json 2>&1 | quiet | tail -4
  done
fi
