#!/usr/bin/env bash
# Issue 21, step 2, in one go: minidist's GPT-2 124M training step on the GPU in five settings,
# beside the PyTorch reference step (the peer, ../shared/gpu/torch_reference_step.py, copied into
# the git-ignored .gpu/ folder and carried to the GPU machine; never imported by minidist).
# One JSON line per run on stdout and in $LOGS/results.jsonl, then a `speed` line: tokens/s,
# ms/step, kernels/step, MFU, and each run's tokens/s over PyTorch eager bf16's (target >= 1.0,
# kernels/step <= 1,500). Measurements, not pass/fail: a run fails only if it crashes, times out
# or its loss is not finite.
#
#   BUDGET=560 bash tests/gpu_speed.sh          # on the GPU machine, from the repo root
#   DEVICE=cpu DRY=1 bash tests/gpu_speed.sh    # CPU dry run: same runs, tiny sizes, no peer
#
# minidist runs (examples/bench_step.py): fp32 (the CUDA kernels on), tf32 (MINIDIST_TF32=1),
# bf16 (--amp), bf16_new (MINIDIST_CUDA_NEW_KERNELS=1: the parts proven on the CPU only, the
# batched GEMMs through cuBLAS among them),
# bf16_new_tiled (the same with --attention tiled), bf16_new_g32 (the same with --grad-dtype
# float32: the _g32 kernels, float32 gradients, proven on the CPU only), on a GPU bf16_new_graph (bf16_new's step
# captured as a CUDA graph and replayed: its loss must equal bf16_new's), bf16_new_drop
# (bf16_new with --dropout 0.1: what dropout costs there) and on a GPU bf16_new_drop_graph
# (bf16_new_drop's step captured: the masks' step on the device, each replay its own; its loss
# and last dropout step must be bf16_new_drop's). Peer runs: torch_eager_bf16,
# torch_eager_tf32, torch_compile_bf16 (skipped when TORCH_REF is missing or torch is not there).
# Environment: DEVICE (cuda), DRY (0), LOGS (speed-logs/<time>), LIMIT (seconds per run, 300),
# BUDGET (seconds in all, unset: tests/scripts/gpu_common.sh), TORCH_REF
# (.gpu/torch_reference_step.py), PEAK (989: dense bf16 TFLOP/s of an H100 SXM, for MFU).
set -u
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
DRY=${DRY:-0}
LOGS=${LOGS:-speed-logs/$(date +%Y%m%d-%H%M%S)}
LIMIT=${LIMIT:-300}
TORCH_REF=${TORCH_REF:-.gpu/torch_reference_step.py}
PEAK=${PEAK:-989}
if [ "$DRY" = 1 ]; then
    SIZE="--n-layer 2 --n-head 2 --n-embd 32 --block-size 32 --batch-size 4 --vocab-size 101"
    STEPS="--steps 2 --warmup 1"; AMP_DTYPE=float16     # numpy: no ml_dtypes needed
else
    SIZE="--n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --batch-size 16 \
--vocab-size 50257"
    STEPS="--steps 10 --warmup 3"; AMP_DTYPE=bfloat16
fi
. tests/scripts/gpu_common.sh
BENCH="examples/bench_step.py $SIZE $STEPS --device $DEVICE --peak-tflops $PEAK"
AMP="--amp --amp-dtype $AMP_DTYPE"

run fp32 bench -- "$PY" $BENCH
run tf32 bench -- env MINIDIST_TF32=1 "$PY" $BENCH
run bf16 bench -- "$PY" $BENCH $AMP
run bf16_new bench -- env MINIDIST_CUDA_NEW_KERNELS=1 "$PY" $BENCH $AMP
run bf16_new_tiled bench -- env MINIDIST_CUDA_NEW_KERNELS=1 "$PY" $BENCH $AMP \
    --attention tiled
run bf16_new_g32 bench -- env MINIDIST_CUDA_NEW_KERNELS=1 "$PY" $BENCH $AMP \
    --grad-dtype float32

if [ -f "$TORCH_REF" ] && "$PY" -c "import torch" 2>/dev/null; then
    PEER="$TORCH_REF $SIZE $STEPS --device $DEVICE --peak-tflops $PEAK"
    run torch_eager_bf16 bench -- "$PY" $PEER --prec bf16
    run torch_eager_tf32 bench -- "$PY" $PEER --prec tf32
    run torch_compile_bf16 bench -- "$PY" $PEER --prec bf16 --compile
fi

# last, so a short BUDGET spends itself on the runs above (the peer is the yardstick)
if [ "$DEVICE" = cuda ]; then     # a CUDA graph of bf16_new's step: its loss must be bf16_new's
    run bf16_new_graph bench -- env MINIDIST_CUDA_NEW_KERNELS=1 "$PY" $BENCH $AMP --cuda-graph
fi

# dropout's cost on the device (Philox numbers computed there: one kernel per residual site
# and step, inside the flash kernels for the attention weights): the lowest priority, last
run bf16_new_drop bench -- env MINIDIST_CUDA_NEW_KERNELS=1 "$PY" $BENCH $AMP --dropout 0.1
if [ "$DEVICE" = cuda ]; then     # a CUDA graph with dropout: bf16_new_drop's loss and step
    run bf16_new_drop_graph bench -- env MINIDIST_CUDA_NEW_KERNELS=1 "$PY" $BENCH $AMP \
        --dropout 0.1 --cuda-graph
fi

only_missing bench "torch_eager_bf16 torch_eager_tf32 torch_compile_bf16 bf16_new_graph \
    bf16_new_drop_graph"        # (with the peer; on CUDA)
"$PY" tests/scripts/acceptance.py speed "$RESULTS" > "$LOGS/speed.json"
status=$?
tee -a "$RESULTS" < "$LOGS/speed.json"
exit $status
