#!/bin/bash
# Session-10 GPU runs (each part fits one 10-minute device call). Results land in $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# Compiled kernels survive between calls on a warm machine (ignored paths there are kept): the GPU kernel tests
# compile a few hundred kernel variants (~7 s per paged-attention test when cold), so they fit a call only warm.
export TRITON_CACHE_DIR=$PWD/.triton_cache
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
