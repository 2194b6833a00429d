#!/usr/bin/env bash
# DiffusionGemma's GPU fast path in one device call: its tests on the GPU (the sliding-window paged-attention
# kernel at the 26B-A4B shapes, the paged row path against the dense one, decoder passes replayed from CUDA graphs
# against eager steps, the engine against the reference loop, the batched canvas rule against the one-canvas rule,
# steps continued on the device against steps the host launches, the fused acceptance kernel; float32), the canvas
# rule alone at the 26B-A4B shapes (`bench/canvas_rule.py`: batched against per canvas, bit for
# bit) and `diffulex bench canvas` (bf16, random weights of the 26B-A4B geometry, batch 1 and 8, graphs, then eager
# decoder passes).
# Usage (on a GPU machine, from the repository root): tools/diffusion_gemma_gpu.sh [OUT_DIR]
# Writes OUT_DIR/diffusion_gemma_tests.log, OUT_DIR/canvas_rule.json, OUT_DIR/diffusion_gemma_steps.json (graphs) and
# OUT_DIR/diffusion_gemma_steps_eager.json; prints the verdicts and the step times against their floors.
set -uo pipefail
out=${1:-${OUT:-.}}
mkdir -p "$out"
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA device')" || exit 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
start=$(date +%s)
python -m pytest -q -p no:warnings --durations=5 \
  tests/kernels/test_paged_attention_window.py tests/strategy/test_diffusion_gemma_paged.py \
  tests/strategy/test_diffusion_gemma_graphs.py tests/strategy/test_diffusion_gemma_strategy.py \
  tests/strategy/test_diffusion_gemma_canvas_batch.py tests/strategy/test_diffusion_gemma_continuation.py \
  tests/kernels/test_canvas_acceptance.py \
  > "$out/diffusion_gemma_tests.log" 2>&1
tests_rc=$?
echo "tests rc=$tests_rc, $(( $(date +%s) - start )) s"; grep -E "passed|failed|error" "$out/diffusion_gemma_tests.log" | tail -3
PYTHONPATH=. python bench/canvas_rule.py "$out" --batch-sizes 1 8
rule_rc=$?
python -m diffulex.cli bench canvas --batch-sizes 1 8 --out "$out/diffusion_gemma_steps.json"
bench_rc=$?
python -m diffulex.cli bench canvas --batch-sizes 1 8 --steps 6 --enforce-eager --out "$out/diffusion_gemma_steps_eager.json"
eager_rc=$?
echo "total $(( $(date +%s) - start )) s; tests rc=$tests_rc, rule rc=$rule_rc, bench rc=$bench_rc, eager bench rc=$eager_rc"
exit $(( tests_rc || rule_rc || bench_rc || eager_rc ))
