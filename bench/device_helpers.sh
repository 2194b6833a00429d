# Shared by the device scripts from session 16 on (sourced, not run): the environment, the what_if step loops and
# two helpers. Results land in $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$PWD/.triton_cache  # compiled kernels survive between calls on a warm machine
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
W="timeout 150 python bench/what_if.py --model 1.7b --steps 100"
W8="${W/1.7b/8b}"
# alternate TAG_A TAG_B VAR=VALUE...: the batch-1 step loop at 1.7B twice and 8B once, as built (TAG_A) and with
# the variables set (TAG_B), in turn
alternate() {
  local a=$1 b=$2; shift 2
  for w in "$W" "$W" "$W8"; do
    $w --tag $a 2>&1 | grep -E "WHATIF|Error|error" | head -5
    env "$@" $w --tag $b 2>&1 | grep -E "WHATIF|Error|error" | head -5
  done
}
# gpu_tests TAG FILE...: pytest on the GPU, its log in $OUT/pytest_TAG.log
gpu_tests() {
  local tag=$1; shift
  timeout 250 python -m pytest "$@" -x -q -p no:warnings > $OUT/pytest_$tag.log 2>&1; echo "pytest rc=$?"
  tail -3 $OUT/pytest_$tag.log
}
