#!/usr/bin/env bash
# The one-GPU measurements by part, each under a time limit, so that a device call runs the parts it has room for
# and a hung part never spends the rest of it (the two-GPU ones are tools/multi_gpu_bench.sh):
#   tests     tools/gpu_tests.sh: the GPU test suite over 16 workers (about 5 min)
#   start     tools/start_gpu_check.sh: engine start, cold and warm caches (about 1 min)
#   fdv2      Fast-dLLM v2 7B at batch 1: bench/step_anatomy.py beside multi_bd, and `bench throughput` (about 3 min)
#   prefill   `bench sweep --targets prefill`: TTFT, decoders beside a chunked prompt, prefix hits (about 5 min)
#   serving   `bench sweep --targets serving` and bench/server_step_rate.py (about 5 min)
#   moe       `bench sweep --targets moe`: MoE geometries against the selected experts' floor, and
#             bench/moe_routing_bench.py: the routers' selection per rows-per-program (about 5 min)
#   batch     `bench sweep --targets batch strategies`: large batches and every strategy (about 5 min)
#   phit      bench/prefix_hit_anatomy.py: a 32k prefix hit's time to first token, phase by phase, with a 256-token
#             tail (its prefill bucket full: the first block replays a decode graph of its own) and a 250-token
#             one (the block rides in the tail's forward) (about 2 min)
#   canvas    `bench canvas --batch-sizes 1 8 --profile`: DiffusionGemma steps, kernels by kind, then the same on the
#             sweep's layout at batch 1 and 32 (`--geometry sweep`), sampled and greedy (`--temperature 0`, the
#             sweep's rule) (about 4 min)
#   attention bench/prefill_attention_bench.py: a prompt's attention per tile class against its floor (about 2 min)
#   cold      bench/prefill_anatomy.py: a cold 2,048-token prompt (1.7B, 8B) run eagerly (prefill graphs up to 512
#             rows) and replayed in one prefill graph (up to 2,048, the default) (about 4 min)
# Usage (GPU machine, repository root): tools/gpu_bench.sh OUT_DIR PART...
# Carry the server's wheels (.wheels) for `serving`; they are installed first when present. Each part's log is
# OUT_DIR/<part>.log (its tail printed), its results under OUT_DIR/<part>/; sweep folders are packed into
# OUT_DIR/<part>.tgz, since a device call brings back only a few files. Exits non-zero if any part failed.
set -uo pipefail
usage="usage: tools/gpu_bench.sh OUT_DIR tests|start|fdv2|prefill|serving|moe|batch|phit|canvas|attention|cold..."
out=${1:?$usage}
shift
[ $# -gt 0 ] || { echo "$usage"; exit 2; }
source tools/bench_parts.sh
bench_setup "$out" 1 gpu_bench
declare -A PART_LIMIT_S=([tests]=420 [start]=200 [fdv2]=300 [prefill]=380 [serving]=360 [moe]=330 [batch]=380
  [phit]=240 [canvas]=400 [attention]=200 [cold]=300)

measure() {
  local part=$1 dir=$out/$1
  mkdir -p "$dir"
  case "$part" in
    tests) tools/gpu_tests.sh "$dir" ;;
    start) tools/start_gpu_check.sh "$dir" ;;
    fdv2)
      for strategy in fast_dllm_v2 multi_bd; do
        python bench/step_anatomy.py --model fdv2-7b --strategy "$strategy" --batch 1 --steps 40 --top 12 \
          --out "$dir/anatomy_$strategy.json" || return 1
      done
      python -m diffulex.cli bench throughput --strategy fast_dllm_v2 --models fdv2-7b --block-cache on \
        --batch-sizes 1 --out "$dir/throughput.json" ;;
    prefill) python -m diffulex.cli bench sweep --targets prefill --out "$dir/sweep" --max-seconds 320 ;;
    serving)
      python -m diffulex.cli bench sweep --targets serving --out "$dir/sweep" --max-seconds 240 || return 1
      CUDA_VISIBLE_DEVICES= python bench/server_step_rate.py --clients 64 128 --seconds 6 --json "$dir/ssr.json" ;;
    moe)
      PYTHONPATH=. python bench/moe_routing_bench.py --out "$dir/routing.json" || return 1
      python -m diffulex.cli bench sweep --targets moe --out "$dir/sweep" --max-seconds 240 ;;
    batch) python -m diffulex.cli bench sweep --targets batch strategies --out "$dir/sweep" --total-seconds 330 --max-seconds 170 ;;
    phit)
      PYTHONPATH=. python bench/prefix_hit_anatomy.py "$dir/tail256" || return 1
      PYTHONPATH=. python bench/prefix_hit_anatomy.py "$dir/tail250" --tail 250 ;;
    canvas) python -m diffulex.cli bench canvas --batch-sizes 1 8 --profile --out "$dir/diffusion_gemma_steps.json" \
              && python -m diffulex.cli bench canvas --geometry sweep --batch-sizes 1 32 --profile \
                   --out "$dir/diffusion_gemma_sweep_layout_steps.json" \
              && python -m diffulex.cli bench canvas --geometry sweep --batch-sizes 1 32 --temperature 0 \
                   --out "$dir/diffusion_gemma_sweep_layout_greedy_steps.json" ;;
    attention) PYTHONPATH=. python bench/prefill_attention_bench.py "$dir" ;;
    cold)
      for rows in 512 2048; do
        PYTHONPATH=. python bench/prefill_anatomy.py "$dir/graphs$rows" --lengths 2048 \
          --max-prefill-graph-tokens "$rows" || return 1
      done ;;
  esac
}

export -f measure
export out usage
for part in "$@"; do
  [ -n "${PART_LIMIT_S[$part]:-}" ] || { echo "$usage (got '$part')"; exit 2; }
  run_part "$out" "$part" "${PART_LIMIT_S[$part]}" bash -c "measure $part"
  if [ -d "$out/$part/sweep" ]; then tar czf "$out/$part.tgz" -C "$out/$part" sweep && rm -rf "$out/$part/sweep"; fi
done
bench_verdict
