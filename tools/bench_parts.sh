# Sourced by tools/gpu_bench.sh and tools/multi_gpu_bench.sh: what a measurement script run by parts on a GPU
# machine shares (not run by itself).

# bench_setup OUT_DIR MIN_GPUS NAME: the output folder, the environment every part runs in, a check that the machine
# has MIN_GPUS CUDA devices (exit 2 with NAME's message else), and the server's wheels (.wheels) when carried.
bench_setup() {
  mkdir -p "$1"
  export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
  python -c "import sys, torch; sys.exit(0 if torch.cuda.device_count() >= $2 else '$3: needs $2 CUDA device(s)')" || exit 2
  nvidia-smi --query-gpu=name --format=csv,noheader
  if [ -d .wheels ]; then python -m pip install -q --no-index -f .wheels fastapi uvicorn httpx >/dev/null 2>&1 || echo "wheels not installed"; fi
  failed=()
}

# run_part OUT_DIR PART LIMIT_S COMMAND...: COMMAND under a time limit, its output in OUT_DIR/PART.log (tail
# printed). A failed part is added to `failed`; a killed one also takes its spawned ranks with it, which would hold
# the GPUs for the parts after it.
run_part() {
  local out=$1 part=$2 limit=$3 start rc
  shift 3
  start=$(date +%s)
  echo "== $part: $* (limit $limit s)"
  timeout -k 10 "$limit" "$@" > "$out/$part.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    failed+=("$part")
    [ $rc -eq 124 ] && { echo "== $part: killed after $limit s"; pkill -9 -f multiprocessing.spawn; sleep 2; }
  fi
  tail -25 "$out/$part.log"
  echo "== $part: $(( $(date +%s) - start )) s, rc $rc"
}

# bench_verdict: exit non-zero, naming them, if any part failed.
bench_verdict() {
  [ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
}
