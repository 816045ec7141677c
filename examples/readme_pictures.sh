#!/bin/bash
# Regenerate the README's pictures, examples/img/*.png (needs matplotlib: pip install -e ".[plot]"):
#
#   bash examples/readme_pictures.sh
#
#   loss_1rank_ddp_zero3.png   one process, DDP x2 and ZeRO-3 x2 on the same seed and global
#                              batch: loss, tokens/s, memory per rank (examples/plot.py)
#   ddp_timeline.png           one DDP step on 2 ranks from a --trace file: the bucket
#                              all-reduces (--bucket-mb 0.05: about ten) inside backward
#
# Arguments go to every examples/train_gpt.py run (e.g. --data input.txt). STEPS (default 200)
# and TRACE_STEPS (default 6) set the runs' lengths, OUT (default examples/img) where the
# pictures go, PYTHON and MPIRUN the programs. The logs go to a temporary folder, removed after.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-200}
TRACE_STEPS=${TRACE_STEPS:-6}
OUT=${OUT:-examples/img}
PYTHON=${PYTHON:-python}
MPIRUN=${MPIRUN:-mpirun}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"

flags=(--steps "$STEPS" --n-layer 2 --n-embd 64 --seed 1 --eval-every 0 --sample 0 "$@")
set -x
"$PYTHON" examples/train_gpt.py "${flags[@]}" --log-json "$work/one.jsonl"
"$MPIRUN" -n 2 "$PYTHON" examples/train_gpt.py "${flags[@]}" --log-json "$work/ddp.jsonl"
"$MPIRUN" -n 2 "$PYTHON" examples/train_gpt.py "${flags[@]}" --zero 3 \
    --log-json "$work/zero3.jsonl"
"$PYTHON" examples/plot.py "$work/one.jsonl" "$work/ddp.jsonl" "$work/zero3.jsonl" \
    -o "$OUT/loss_1rank_ddp_zero3.png" --labels "1 rank,DDP x2 ranks,ZeRO-3 x2 ranks"
"$MPIRUN" -n 2 "$PYTHON" examples/train_gpt.py "${flags[@]}" --steps "$TRACE_STEPS" \
    --bucket-mb 0.05 --trace "$work/t.json"
"$PYTHON" examples/plot.py --trace "$work/t.json" -o "$OUT/ddp_timeline.png"
