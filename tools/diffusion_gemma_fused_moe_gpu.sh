#!/usr/bin/env bash
# DiffusionGemma's experts on the fused MoE kernels (GELU-tanh epilogue), checked and measured in one device call:
# 1. the fused kernels' tests and DiffusionGemma's model and row-path tests on the GPU (stops here if any fails:
#    a wrong kernel is not worth timing);
# 2. bench/fused_moe_bench.py on the 26B-A4B expert geometry: fused against grouped at 1, 2, 4 and 8 canvases of
#    256 rows, against the selected experts' floor;
# 3. `diffulex bench canvas` at batch 1 and 8 with each step's own expert path (fused at batch 1), then batch 1
#    with the grouped GEMM forced: the baseline of the same machine.
# Usage (on a GPU machine, from the repository root): tools/diffusion_gemma_fused_moe_gpu.sh [OUT_DIR]
# Writes OUT_DIR/fused_moe_tests.log, OUT_DIR/fused_moe.json, OUT_DIR/diffusion_gemma_steps.json and
# OUT_DIR/diffusion_gemma_steps_grouped.json; prints the verdicts and the step times against their floors.
set -uo pipefail
out=${1:-${OUT:-.}}
mkdir -p "$out"
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA device')" || exit 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
python -m pytest -q -p no:warnings --durations=5 \
  tests/kernels/test_fused_moe.py tests/models/test_diffusion_gemma.py tests/models/test_diffusion_gemma_config.py \
  tests/strategy/test_diffusion_gemma_paged.py \
  > "$out/fused_moe_tests.log" 2>&1
tests_rc=$?
echo "tests rc=$tests_rc, $(( $(date +%s) - start )) s"; grep -E "passed|failed|error" "$out/fused_moe_tests.log" | tail -3
if [ "$tests_rc" -ne 0 ]; then
  grep -E "^(FAILED|ERROR)" "$out/fused_moe_tests.log" | head -20
  echo "error: the tests failed (log: $out/fused_moe_tests.log); nothing timed"
  exit 1
fi
PYTHONPATH=. python bench/fused_moe_bench.py "$out" --geometries diffusion-gemma-26b-a4b --sweep-seconds 30
kernel_rc=$?
python -m diffulex.cli bench canvas --batch-sizes 1 8 --out "$out/diffusion_gemma_steps.json"
canvas_rc=$?
python -m diffulex.cli bench canvas --batch-sizes 1 --experts-impl grouped \
  --out "$out/diffusion_gemma_steps_grouped.json"
grouped_rc=$?
echo "total $(( $(date +%s) - start )) s; kernel bench rc=$kernel_rc, canvas rc=$canvas_rc, grouped canvas rc=$grouped_rc"
exit $(( kernel_rc || canvas_rc || grouped_rc ))
