#!/usr/bin/env bash
# The GPU acceptance (issue 21, steps 1 and 4; first written for issue 13), in one go, on a
# machine with a GPU and no network.
# One JSON line per check on stdout and in $LOGS/results.jsonl (verdicts by
# tests/scripts/acceptance.py); every command runs under `timeout`, its output in $LOGS.
#
#   bash tests/gpu_acceptance.sh                  # on the GPU machine, from the repo root
#   DEVICE=cpu DRY=1 bash tests/gpu_acceptance.sh # CPU dry run: same checks, tiny sizes
#
# Checks: the gpu-marked suite; the whole suite with --device; the kernels' gpu tests under
# compute-sanitizer's racecheck; GPU vs CPU (float64 1e-10,
# float32 1e-4: tests/scripts/gpu_vs_cpu.py); train_gpt.py 200 steps on the device within 2%
# of the CPU's val loss; mpiexec -n 4 train_gpt.py --device with DDP, --zero 3, --tp 2 --amp,
# --dp 2 --pp 2, and --cp 2 with the new kernels, each finite and decreasing (--log-json).
# Exit status 1 if any check failed.
#
# No MPI on the machine: put the mpich and mpi4py wheels in .whl/ (examples/GPU_NOTES.md says
# how); a venv that sees the machine's CuPy is made from them here, once per run.
# Environment: DEVICE (cuda), DRY (0), LOGS (acceptance-logs/<time>), LIMIT (seconds per
# command, 1800), BUDGET (seconds in all: see tests/scripts/gpu_common.sh), STEPS (200),
# MPI_STEPS (60), SUITE (pytest targets, default: all tests).
set -u
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
DRY=${DRY:-0}
LOGS=${LOGS:-acceptance-logs/$(date +%Y%m%d-%H%M%S)}
LIMIT=${LIMIT:-1800}
SUITE=${SUITE:-tests}
if [ "$DRY" = 1 ]; then
    STEPS=${STEPS:-12}; MPI_STEPS=${MPI_STEPS:-8}
    MODEL="--n-layer 2 --n-head 2 --n-embd 32 --block-size 32 --batch-size 8 --eval-iters 2"
else
    STEPS=${STEPS:-200}; MPI_STEPS=${MPI_STEPS:-60}
    MODEL=""
fi
. tests/scripts/gpu_common.sh
TRAIN="examples/train_gpt.py $MODEL --sample 0 --eval-every 0"

# ---- 1. the gpu-marked tests, 2. the whole suite on the device -----------------------------
# on the CPU (dry run) the gpu tests all skip: allowed there, a failure on a GPU
EMPTY=$([ "$DEVICE" = cpu ] && echo allow-empty || echo need-tests)
# (-rfE --tb=short: the log names each failure and error even when the run is cut)
run gpu_suite pytest "$EMPTY" -- "$PY" -m pytest -q -rfE --tb=short -m gpu --device "$DEVICE" \
    $SUITE
run suite_on_device pytest need-tests -- "$PY" -m pytest -q -rfE --tb=short --device "$DEVICE" \
    $SUITE
# the kernels' gpu tests under compute-sanitizer's racecheck: a shared-memory race between two
# barriers (a block reading what another thread of it has not written yet, the flash kernel's
# before 2026-11-29) is invisible to the CPU harness, whose fibers run one block at a time
# (tests/cuda_cpu.py); on the CPU (dry run) the same pytest, without the sanitizer
# compute-sanitizer: the machine's, else unpacked from the nvidia-cuda-sanitizer-api wheel in
# .whl/ (examples/GPU_NOTES.md), else the bare name, whose absence the check's log then says
sanitizer() {
    local w bin="$LOGS/sanitizer/nvidia/cuda_sanitizer_api/bin"
    command -v compute-sanitizer && return
    [ -x /usr/local/cuda/bin/compute-sanitizer ] && echo /usr/local/cuda/bin/compute-sanitizer \
        && return
    for w in .whl/nvidia_cuda_sanitizer_api*.whl; do
        [ -f "$w" ] && "$PY" -m zipfile -e "$w" "$LOGS/sanitizer" && chmod +x "$bin"/* \
            && echo "$bin/compute-sanitizer" && return
    done
    echo compute-sanitizer
}
RACECHECK=()
if [ "$DEVICE" != cpu ] && [[ -z "${ONLY:-}" || " $ONLY " == *" racecheck "* ]]; then
    RACECHECK=("$(sanitizer)" --tool racecheck --error-exitcode 3)
fi
run racecheck pytest "$EMPTY" -- ${RACECHECK[@]+"${RACECHECK[@]}"} "$PY" -m pytest -q -rfE \
    --tb=short -m gpu --device "$DEVICE" tests/test_cuda_kernels.py tests/test_cuda_flash_cpu.py \
    tests/test_cuda_ring_cpu.py tests/test_cuda_llama_cpu.py tests/test_cuda_philox_cpu.py

# ---- 3. GPU vs CPU, same seed ----------------------------------------------------------------
for dt in float64 float32; do
    run "gpu_vs_cpu_$dt" json -- "$PY" tests/scripts/gpu_vs_cpu.py --device "$DEVICE" \
        --dtype "$dt"
done

# ---- 4. train_gpt.py on the device vs the CPU: final val loss within 2% ---------------------
J="$LOGS/train_cpu.jsonl" D="$LOGS/train_dev.jsonl"
rm -f "$J" "$D"
run train_cpu curve "$J" -- "$PY" $TRAIN --device cpu --steps "$STEPS" --log-json "$J"
run train_device curve "$D" -- "$PY" $TRAIN --device "$DEVICE" --steps "$STEPS" --log-json "$D"
run train_val_within_2pct val "$D" "$J" 0.02 -- true

# ---- 5. four ranks on the device: finite and decreasing -------------------------------------
for flags in "" "--zero 3" "--tp 2 --amp" "--dp 2 --pp 2"; do
    name="mpi4_$(echo "${flags:-ddp}" | tr -d '-' | tr ' ' '_')"
    F="$LOGS/$name.jsonl"
    rm -f "$F"
    run "$name" curve "$F" -- "$MPIEXEC" -n 4 "$PY" $TRAIN --device "$DEVICE" \
        --steps "$MPI_STEPS" --log-json "$F" $flags
done
# ring attention (--cp) through the flash kernels (MINIDIST_CUDA_NEW_KERNELS=1): proven on the
# CPU harness only, and no pytest reaches the ring's kernel branch on a GPU (it needs MPI)
F="$LOGS/mpi4_cp_2_new.jsonl"
rm -f "$F"
run mpi4_cp_2_new curve "$F" -- env MINIDIST_CUDA_NEW_KERNELS=1 "$MPIEXEC" -n 4 "$PY" $TRAIN \
    --device "$DEVICE" --steps "$MPI_STEPS" --log-json "$F" --cp 2
# Ulysses (--cp-attention ulysses): its all-to-alls on cupy buffers through host-staged MPI,
# the reorder's device indexing; proven on the CPU only
F="$LOGS/mpi4_cp_2_ulysses.jsonl"
rm -f "$F"
run mpi4_cp_2_ulysses curve "$F" -- "$MPIEXEC" -n 4 "$PY" $TRAIN --device "$DEVICE" \
    --steps "$MPI_STEPS" --log-json "$F" --cp 2 --cp-attention ulysses
# hybrid sharding (--zero-shard): ZeRO-3 in each pair of ranks, the gradient shards
# all-reduced across the pairs (cupy shards through host-staged MPI); proven on the CPU only
F="$LOGS/mpi4_zero_3_shard_2.jsonl"
rm -f "$F"
run mpi4_zero_3_shard_2 curve "$F" -- "$MPIEXEC" -n 4 "$PY" $TRAIN --device "$DEVICE" \
    --steps "$MPI_STEPS" --log-json "$F" --zero 3 --zero-shard 2

only_missing none
"$PY" tests/scripts/acceptance.py summary "$RESULTS" > "$LOGS/summary.json"
status=$?
tee -a "$RESULTS" < "$LOGS/summary.json"
exit $status
