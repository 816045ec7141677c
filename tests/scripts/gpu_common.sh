# Sourced by tests/gpu_acceptance.sh and tests/gpu_speed.sh (not run on its own): the Python
# environment of a GPU machine with no MPI and no network, and `run`, which times one check
# under `timeout` and hands its output to a verdict of tests/scripts/acceptance.py.
#
# Reads: LOGS (created), LIMIT (seconds per command), BUDGET (seconds for the whole script,
# default none: a device call is cut at 10 minutes, so a script given BUDGET=560 finishes its
# checks inside one call, each command's limit shortened to what is left, the rest recorded as
# skipped), ONLY (check names, space-separated: only these run, the others print nothing;
# tests/gpu_session.sh orders both scripts' checks by it). Sets: PY, MPIEXEC, RESULTS
# ($LOGS/results.jsonl, emptied), PYTHONPATH.
mkdir -p "$LOGS"
RESULTS="$LOGS/results.jsonl"
: > "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
T_START=$(date +%s)

# mpi4py + mpich from .whl/ when the machine has no MPI (examples/GPU_NOTES.md says how). "No
# MPI": mpi4py cannot load an MPI library (`import mpi4py` alone loads none: review 40) or no
# mpiexec. With neither an MPI nor the wheels every check would fail at its import: one failed
# `setup` row, exit 1, before the budget is spent.
if ! python3 -c "from mpi4py import MPI" 2>/dev/null || ! command -v mpiexec >/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
        PYV=$(python3 -c "import sys; v = sys.version_info; print(f'python{v[0]}.{v[1]}')")
        V=$(mktemp -d)/venv
        python3 -m venv "$V" && echo "$SP" > "$V/lib/$PYV/site-packages/base.pth"
        "$V/bin/python" -m pip install -q --no-index --no-deps .whl/*.whl > "$LOGS/venv.log" 2>&1
        export PATH="$V/bin:$PATH"
    fi
    if ! python3 -c "from mpi4py import MPI" 2>/dev/null; then
        printf '{"check": "setup", "verdict": "setup", "ok": false, "error": "%s %s"}\n' \
            "no MPI: python3 cannot load mpi4py.MPI and .whl/ holds no mpi4py and mpich" \
            "wheels (examples/GPU_NOTES.md: pip download them into .whl/ and carry it)" \
            | tee -a "$RESULTS"
        exit 1
    fi
fi
PY=${PY:-$(command -v python3)}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || echo mpiexec)

# run NAME KIND [verdict args] -- COMMAND...: COMMAND under timeout, its output in
# $LOGS/NAME.log, then one JSON verdict line on stdout and in $RESULTS
run() {
    local name=$1 kind=$2; shift 2
    local extra=()
    while [ "$1" != "--" ]; do extra+=("$1"); shift; done
    shift
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return
    fi
    local log="$LOGS/$name.log" limit=$LIMIT t0 rc
    if [ -n "${BUDGET:-}" ]; then
        local left=$((BUDGET - ($(date +%s) - T_START)))
        if [ "$left" -lt 15 ]; then
            printf '{"check": "%s", "verdict": "%s", "ok": false, "skipped": "BUDGET spent"}\n' \
                "$name" "$kind" | tee -a "$RESULTS"
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    t0=$(date +%s.%N)
    # SIGINT, not SIGTERM: a pytest cut by its limit still prints its failures and summary
    # (killed by SIGTERM its log held progress dots only: review 40); KILL 20 s later
    timeout -s INT -k 20 "$limit" "$@" > "$log" 2>&1
    rc=$?
    local dt
    dt=$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$t0" \
        "$(date +%s.%N)")
    "$PY" tests/scripts/acceptance.py "$kind" "$name" "$rc" "$dt" "$log" "${extra[@]}" \
        | tee -a "$RESULTS"
}

# only_missing VERDICT [NAMES]: a failed row (of VERDICT's kind) for each name in ONLY that no
# `run` of this script recorded and NAMES (checks the script runs only on some machines: the
# PyTorch peer, CUDA graphs) does not hold: a misspelt check ran nothing, which is no pass
only_missing() {
    local name
    for name in ${ONLY:-}; do
        grep -q "\"check\": \"$name\"" "$RESULTS" && continue
        [[ " ${2:-} " == *" $name "* ]] && continue
        printf '{"check": "%s", "verdict": "%s", "ok": false, "error": "no check %s in %s"}\n' \
            "$name" "$1" "$name" "$(basename "$0")" | tee -a "$RESULTS"
    done
}
