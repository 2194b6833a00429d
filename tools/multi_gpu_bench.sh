#!/usr/bin/env bash
# Everything measured on two GPUs (issue 29's bars), in as few device calls as the 10-minute limit allows:
#   tp         bench/tp_decode.py: TP=2 == TP=1 tokens, SDAR-8B batch 1 TP=2 / TP=1 ms per step (about 2 min)
#   shutdown   bench/tp_shutdown.py: TP=2 engines exit cleanly (about 1 min)
#   ep         bench/ep_decode.py --max-steps 40: EP=2 and TP=2+EP=2 tokens and SDAR-30B-A3B steps (about 4 min)
#   dp         diffulex bench sweep --targets dp: DP=2 against DP=1 through the server (about 6 min)
# Usage (two-GPU machine, repository root): tools/multi_gpu_bench.sh OUT_DIR PART...
# Carry the server's wheels (.wheels: fastapi, uvicorn, httpx and their dependencies) for `dp`; they are installed
# first when present. Each part's log is OUT_DIR/<part>.log; the script goes on after a failed part and exits
# non-zero at the end if any failed. Each part runs under a time limit (PART_LIMIT_S below; a hung part is killed
# and counted failed, so one hang never spends the rest of a device call).
set -uo pipefail
usage="usage: tools/multi_gpu_bench.sh OUT_DIR tp|shutdown|ep|dp..."
out=${1:?$usage}
shift
[ $# -gt 0 ] || { echo "$usage"; exit 2; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
python -c "import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 'multi_gpu_bench: needs two CUDA devices')" || exit 2
if [ -d .wheels ]; then python -m pip install -q --no-index -f .wheels fastapi uvicorn httpx >/dev/null 2>&1 || echo "wheels not installed"; fi
declare -A PART_LIMIT_S=([tp]=240 [shutdown]=150 [ep]=360 [dp]=420)
failed=()
for part in "$@"; do
  start=$(date +%s)
  case "$part" in
    tp) cmd=(python bench/tp_decode.py "$out") ;;
    shutdown) cmd=(python bench/tp_shutdown.py "$out") ;;
    ep) cmd=(python bench/ep_decode.py "$out" --max-steps 40) ;;
    dp) cmd=(python -m diffulex.cli bench sweep --targets dp --out "$out/sweep_dp" --max-seconds 330) ;;
    *) echo "$usage (got '$part')"; exit 2 ;;
  esac
  echo "== $part: ${cmd[*]} (limit ${PART_LIMIT_S[$part]} s)"
  timeout -k 10 "${PART_LIMIT_S[$part]}" "${cmd[@]}" > "$out/$part.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    failed+=("$part")
    # a killed part may leave its spawned ranks holding the GPUs: end them before the next part
    [ $rc -eq 124 ] && { echo "== $part: killed after ${PART_LIMIT_S[$part]} s"; pkill -9 -f multiprocessing.spawn; sleep 2; }
  fi
  tail -25 "$out/$part.log"
  echo "== $part: $(( $(date +%s) - start )) s"
done
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
