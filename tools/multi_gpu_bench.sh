#!/usr/bin/env bash
# Everything measured on two GPUs (issue 29's bars), in as few device calls as the 10-minute limit allows:
#   tp         bench/tp_decode.py: TP=2 == TP=1 tokens, SDAR-8B batch 1 TP=2 / TP=1 ms per step (about 4 min)
#   allreduce  bench/all_reduce_norm_latency.py: NCCL all-reduce + RMSNorm against the fused peer-memory kernel
#   shutdown   bench/tp_shutdown.py: TP=2 engines exit cleanly (about 1 min)
#   ep         bench/ep_decode.py --max-steps 40: EP=2 and TP=2+EP=2 tokens and SDAR-30B-A3B steps (about 4 min)
#   dp         diffulex bench sweep --targets dp: DP=2 against DP=1 through the server (about 6 min)
#   engines    the tensor- and expert-parallel engine tests on the GPUs (NCCL, graphs captured, float32): every family
#              and strategy over two ranks against one, LoRA and DMax's token merge included (about 5 min)
#   dgemma     DiffusionGemma over two GPUs: its engine tests of TP=2, EP=2 and both against one rank (float32, NCCL,
#              graphs captured), then `diffulex bench canvas` (26B-A4B geometry, batch 1 and 8) at TP=1 and TP=2
# Usage (two-GPU machine, repository root): tools/multi_gpu_bench.sh OUT_DIR PART...
# Carry the server's wheels (.wheels: fastapi, uvicorn, httpx and their dependencies) for `dp`; they are installed
# first when present. Each part's log is OUT_DIR/<part>.log; the script goes on after a failed part and exits
# non-zero at the end if any failed. Each part runs under a time limit (PART_LIMIT_S below, `run_part` of
# tools/bench_parts.sh: a hung part is killed and counted failed, so one hang never spends the rest of a device call).
set -uo pipefail
usage="usage: tools/multi_gpu_bench.sh OUT_DIR tp|allreduce|shutdown|ep|dp|engines|dgemma..."
out=${1:?$usage}
shift
[ $# -gt 0 ] || { echo "$usage"; exit 2; }
source tools/bench_parts.sh
bench_setup "$out" 2 multi_gpu_bench
declare -A PART_LIMIT_S=([tp]=360 [allreduce]=120 [shutdown]=150 [ep]=360 [dp]=420 [engines]=540 [dgemma]=500)
for part in "$@"; do
  case "$part" in
    tp) cmd=(python bench/tp_decode.py "$out") ;;
    allreduce) cmd=(env PYTHONPATH=. python bench/all_reduce_norm_latency.py "$out") ;;
    shutdown) cmd=(python bench/tp_shutdown.py "$out") ;;
    ep) cmd=(python bench/ep_decode.py "$out" --max-steps 40) ;;
    dp) cmd=(python -m diffulex.cli bench sweep --targets dp --out "$out/sweep_dp" --max-seconds 330) ;;
    engines) cmd=(python -m pytest -q -o addopts= -p no:cacheprovider tests/engine/test_tensor_parallel_engine.py
                  tests/engine/test_expert_parallel_engine.py) ;;
    dgemma) cmd=(bash -c 'python -m pytest -q -o addopts= -p no:cacheprovider tests/engine/test_tensor_parallel_engine.py \
                 -k diffusion_gemma && for tp in 1 2; do python -m diffulex.cli bench canvas --batch-sizes 1 8 \
                 --tensor-parallel-size "$tp" --out "$1/canvas_tp$tp.json" || exit 1; done' _ "$out") ;;
    *) echo "$usage (got '$part')"; exit 2 ;;
  esac
  run_part "$out" "$part" "${PART_LIMIT_S[$part]}" "${cmd[@]}"
done
bench_verdict
