#!/usr/bin/env bash
# The GPU test suite in one device call: the tests that run real kernels (kernels, layers, model families, CUDA
# graphs, continuations, the strategies' engine steps, plugins), spread over pytest-xdist workers so that Triton's
# first compiles run in parallel.
# Usage (on a GPU machine, from the repository root): tools/gpu_tests.sh [LOG_DIR] [WORKERS]
# Writes LOG_DIR/gpu_tests.log (one line per test as it finishes, so a killed run still names its failures;
# default: $OUT, else the current folder) and LOG_DIR/compile.jsonl (every Triton compile), and prints the failures,
# the verdict, the wall time, the slowest tests, the time by file and the compiles by process, kernel and test.
set -uo pipefail
log_dir=${1:-${OUT:-.}}
workers=${2:-16}
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
# each worker's engine builds: at most 8 compile helpers apiece (the measured setting; a lone build takes every idle
# core), since the workers already keep the cores busy
export DIFFULEX_COMPILE_HELPERS=${DIFFULEX_COMPILE_HELPERS:-8}
# the engines leave the attention variants of eager steps to their first launch where their helpers compile the
# graphs' variants anyway (docs/configuration.md): each of the suite's engine geometries would otherwise compile some
# 25 of them (about 10 CPU-seconds each), while its test launches a few; the warm-up's own tests set it back
# (tests/engine/test_assembly.py) or call the warm-up directly
export DIFFULEX_ATTENTION_WARM_UP=${DIFFULEX_ATTENTION_WARM_UP:-0}
# every Triton compile of the workers and of their engines' compile helpers, logged (diffulex/kernels/compile_log.py)
# for tools/compile_time_report.py: where the suite's time goes (the cores are busy, mostly compiling)
if [ -z "${DIFFULEX_TRITON_COMPILE_LOG:-}" ]; then
  export DIFFULEX_TRITON_COMPILE_LOG=$log_dir/compile.jsonl
  rm -f "$DIFFULEX_TRITON_COMPILE_LOG"  # this run's compiles only
fi
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$6+$7+$8, $5}' /proc/stat; }  # busy, idle (all cores)
read -r busy0 idle0 <<< "$(cpu_ticks)"
# The compile helpers' tests compile for a Hopper target through a stand-in driver on CPU tensors, the same on any
# machine (CI runs them, 5 CPU-minutes here); of them only the one whose launch needs a GPU runs here.
python -m pytest -n "$workers" --dist worksteal --durations=0 --durations-min=0.5 -o addopts= -v -p no:warnings \
  -k "not test_parallel_compile or _gpu" \
  tests/kernels tests/layers tests/models tests/engine/test_assembly.py tests/engine/test_cuda_graph.py tests/engine/test_continuation.py \
  tests/engine/test_engine_matches_reference.py tests/engine/test_fast_dllm_v2_engine.py tests/engine/test_edit_mode.py \
  tests/engine/test_static_soft_inputs.py tests/engine/test_prefill_graphs.py \
  tests/engine/test_fast_dllm_v2_graphs.py tests/engine/test_fast_dllm_v2_graphs_gpu.py \
  tests/strategy tests/test_plugins.py \
  > "$log_dir/gpu_tests.log" 2>&1
rc=$?
echo "Triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries, $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
read -r busy1 idle1 <<< "$(cpu_ticks)"
echo "pytest rc=$rc, wall $(( $(date +%s) - start )) s with $workers workers;" \
  "CPU busy $(( 100 * (busy1 - busy0) / (busy1 - busy0 + idle1 - idle0) ))% of $(nproc) cores"
grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$log_dir/gpu_tests.log" | sort -u | head -20
grep -E "passed|failed|error" "$log_dir/gpu_tests.log" | tail -1
sed -n '/slowest/,/^$/p' "$log_dir/gpu_tests.log" | head -42
# where the workers' time went: the suite is throughput-bound, so the sum matters more than the longest test
python tools/test_time_by_file.py "$log_dir/gpu_tests.log" --workers "$workers" --top 25
python tools/compile_time_report.py "$DIFFULEX_TRITON_COMPILE_LOG" --top 12
exit $rc
