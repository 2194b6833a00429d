#!/usr/bin/env bash
# Fast-dLLM v2 on the GPU fast path, in one device call (about 5 minutes on an H100):
#  1. its GPU tests: the Triton attention with key tails, float32 CUDA graphs against the oracle (block cache on and
#     off), the static path and the engine tests on the GPU;
#  2. the throughput sweep of the Fast-dLLM-v2-7B geometry (Qwen2.5-7B shapes, random weights, bf16, CUDA graphs,
#     sub-blocks of 8 in blocks of 32, block cache on and off, batch 1 and 32): ms per step, NFE, tokens/s, the
#     step's floors and the ratio, then cache on against cache off.
# Usage (GPU machine, repository root): tools/fdv2_gpu_check.sh OUT_DIR [MAX_SECONDS] [all|tests|bench]
# (MAX_SECONDS: timed decode per configuration, default 15; the third argument runs one part only, default all).
# Writes OUT_DIR/fdv2_gpu_tests.log and OUT_DIR/fdv2_7b_throughput.json; exits non-zero on the first failure.
set -euo pipefail
usage="usage: tools/fdv2_gpu_check.sh OUT_DIR [MAX_SECONDS] [all|tests|bench]"
out=${1:?$usage}
max_seconds=${2:-15}
part=${3:-all}
case "$part" in all|tests|bench) ;; *) echo "$usage (got part '$part')"; exit 2 ;; esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'fdv2_gpu_check: no CUDA device')"
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
if [ "$part" != bench ]; then
  python -m pytest -n 4 -q -p no:warnings \
    tests/kernels/test_paged_attention_key_tails.py tests/engine/test_fast_dllm_v2_graphs_gpu.py \
    tests/engine/test_fast_dllm_v2_graphs.py tests/engine/test_fast_dllm_v2_engine.py \
    > "$out/fdv2_gpu_tests.log" 2>&1 || { tail -40 "$out/fdv2_gpu_tests.log"; echo "fdv2_gpu_check: tests failed"; exit 1; }
  tail -1 "$out/fdv2_gpu_tests.log"
  echo "tests: $(( $(date +%s) - start )) s"
fi
[ "$part" = tests ] && exit 0
python -m diffulex.cli bench throughput --strategy fast_dllm_v2 --models fdv2-7b --batch-sizes 1 32 \
  --prompt-len 128 --max-tokens 256 --max-seconds "$max_seconds" --out "$out/fdv2_7b_throughput.json"
python - "$out/fdv2_7b_throughput.json" <<'PY'
import json
import sys

rows = [r for r in json.load(open(sys.argv[1]))["results"] if not r["error"]]
for batch in sorted({r["batch"] for r in rows}):
    by = {r["variant"]: r for r in rows if r["batch"] == batch}
    if {"cache on", "cache off"} <= by.keys():
        on, off = by["cache on"], by["cache off"]
        print(f"batch {batch}: cache on {on['ms_per_step_mean']:.3f} ms/step ({on['floor_ratio']:.2f}x floor, NFE "
              f"{on['nfe_per_request']:.0f}), off {off['ms_per_step_mean']:.3f} ms/step ({off['floor_ratio']:.2f}x, "
              f"NFE {off['nfe_per_request']:.0f}): off/on step time {off['ms_per_step_mean'] / on['ms_per_step_mean']:.2f}")
PY
echo "total: $(( $(date +%s) - start )) s"
