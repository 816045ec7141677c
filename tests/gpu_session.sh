#!/usr/bin/env bash
# Issue 21's first GPU sitting in one device call: the checks of tests/gpu_acceptance.sh and
# tests/gpu_speed.sh, the most telling first, under one BUDGET. A session is lent 15 minutes
# of device time, the machine's start (a few minutes) included, and one command runs 10 at
# most: this gets every verdict it has time for out of one call, and records the rest as
# skipped ("BUDGET spent") instead of being killed with nothing written.
#
#   BUDGET=480 LOGS=/tmp/s bash tests/gpu_session.sh; tar czf $OUT/s.tgz -C /tmp s
#   (the logs outside $OUT: the device tool returns only a few files from it)
#   DEVICE=cpu DRY=1 SUITE=tests/test_bfloat16.py bash tests/gpu_session.sh   # CPU dry run
#
# The parts, in order (each script run with ONLY = its checks and BUDGET = what is left, its
# logs and results.jsonl in $LOGS/<part>/, each command under LIMIT seconds at most):
#   1 kernels  (acceptance, LIMIT 150) gpu_suite, gpu_vs_cpu_float64, gpu_vs_cpu_float32:
#              do the kernels compute the right numbers
#   2 speed    (speed, LIMIT 100) bf16, bf16_new, torch_eager_bf16: the headline, tokens/s
#              of --amp against PyTorch eager bf16, with and without the new kernels
#   3 ranks    (acceptance, LIMIT 100) mpi4_ddp, mpi4_zero_3, mpi4_tp_2_amp, mpi4_dp_2_pp_2,
#              mpi4_cp_2_new, mpi4_cp_2_ulysses, mpi4_zero_3_shard_2: four ranks on the one GPU through
#              host-staged MPI
#   4 speed2   (speed, LIMIT 100) fp32, tf32, bf16_new_tiled, bf16_new_g32, bf16_new_graph,
#              torch_compile_bf16, torch_eager_tf32, bf16_new_drop, bf16_new_drop_graph
#   5 training (acceptance, LIMIT 150) train_cpu, train_device, train_val_within_2pct
#   6 races    (acceptance, LIMIT 120) racecheck: the kernels' gpu tests under
#              compute-sanitizer's racecheck (shared-memory races the CPU harness cannot see)
#   7 suite    (acceptance, LIMIT 300) suite_on_device: the whole suite on the device, the
#              longest and least telling (most tests build their arrays on the host), last
# Then one `speed` line (the table over parts 2 and 4, each run against part 2's peer) and
# one `summary` line (every check; the skipped ones named apart), both also in
# $LOGS/results.jsonl. Exit status 1 if any check failed or was skipped.
# Environment: DEVICE (cuda), DRY (0), LOGS (session-logs/<time>), BUDGET (480 seconds),
# SUITE (suite_on_device's pytest targets), and what the two scripts read (TORCH_REF, PEAK,
# STEPS, MPI_STEPS).
set -u
cd "$(dirname "$0")/.."
export DEVICE=${DEVICE:-cuda} DRY=${DRY:-0}
LOGS=${LOGS:-session-logs/$(date +%Y%m%d-%H%M%S)}
BUDGET=${BUDGET:-480}
. tests/scripts/gpu_common.sh       # the venv from .whl/ once, on PATH for every part
SESSION_START=$T_START TOTAL=$BUDGET
unset BUDGET

# part NAME SCRIPT LIMIT CHECKS...: SCRIPT with only CHECKS, under the session's budget left
part() {
    local name=$1 script=$2 limit=$3; shift 3
    local left=$((TOTAL - ($(date +%s) - SESSION_START)))
    [ "$left" -lt 0 ] && left=0
    ONLY="$*" BUDGET=$left LIMIT=$limit LOGS="$LOGS/$name" bash "tests/$script" \
        | grep -v '"check": "\(summary\|speed\)"'
}

part kernels gpu_acceptance.sh 150 gpu_suite gpu_vs_cpu_float64 gpu_vs_cpu_float32
part speed gpu_speed.sh 100 bf16 bf16_new torch_eager_bf16
part ranks gpu_acceptance.sh 100 mpi4_ddp mpi4_zero_3 mpi4_tp_2_amp mpi4_dp_2_pp_2 \
    mpi4_cp_2_new mpi4_cp_2_ulysses mpi4_zero_3_shard_2
part speed2 gpu_speed.sh 100 fp32 tf32 bf16_new_tiled bf16_new_g32 bf16_new_graph \
    torch_compile_bf16 torch_eager_tf32 bf16_new_drop bf16_new_drop_graph
part training gpu_acceptance.sh 150 train_cpu train_device train_val_within_2pct
part races gpu_acceptance.sh 120 racecheck
part suite gpu_acceptance.sh 300 suite_on_device

PARTS=("$LOGS"/{kernels,speed,ranks,speed2,training,races,suite}/results.jsonl)
"$PY" tests/scripts/acceptance.py speed "$LOGS/speed/results.jsonl" \
    "$LOGS/speed2/results.jsonl" | tee -a "$RESULTS"
"$PY" tests/scripts/acceptance.py summary "${PARTS[@]}" | tee -a "$RESULTS"
status=${PIPESTATUS[0]}
exit "$status"
