#!/usr/bin/env bash
# Long prompts on the GPU, in one device call (about 6 minutes on an H100 or H200): the paged-attention kernel tests
# (the long-query tile class among them) natively; then a prompt's attention alone in the 64-row class and the
# long-query candidates against the flops floor (bench/prefill_attention_bench.py: prints the configuration to
# keep); then where a cold 2k / 8k / 32k prompt's time to first token goes, per kernel class against each class's
# floor, SDAR-1.7B and 8B geometries (bench/prefill_anatomy.py).
# Usage (GPU machine, repository root): tools/prefill_gpu_check.sh OUT_DIR
# Writes OUT_DIR/kernel_tests.log, OUT_DIR/attention/prefill_attention.json, OUT_DIR/anatomy/prefill_anatomy.json;
# exits non-zero at the first part that fails (the kernel tests first: a wrong kernel is not timed).
set -euo pipefail
out=${1:?usage: tools/prefill_gpu_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'prefill_gpu_check: no CUDA device')"
nvidia-smi --query-gpu=name --format=csv,noheader
python -m pytest -x -q -p no:warnings tests/kernels/test_paged_attention_long_query.py \
  tests/kernels/test_paged_attention.py tests/kernels/test_paged_attention_window.py \
  tests/kernels/test_paged_attention_key_tails.py > "$out/kernel_tests.log" 2>&1 \
  || { tail -40 "$out/kernel_tests.log"; echo "prefill_gpu_check: paged-attention kernel tests failed"; exit 1; }
tail -1 "$out/kernel_tests.log"
python bench/prefill_attention_bench.py "$out/attention"
python bench/prefill_anatomy.py "$out/anatomy"
