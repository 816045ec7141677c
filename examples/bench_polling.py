"""How waiting for messages behaves when ranks outnumber cores: one table, many settings.

    python examples/bench_polling.py                  # 4 ranks; about two minutes
    python examples/bench_polling.py --ranks 2 --sizes 64K,8M

Runs examples/bench_collectives.py (all_reduce, ring and mpi) under mpiexec once per setting
below and prints busbw (GB/s) per size. The settings: minidist's wait policy
(MINIDIST_COMM_WAIT, minidist/comm/progress.py), MPICH's polling knobs (MPIR_CVAR_*, read by
MPICH at MPI_Init), BLAS threads per rank (OPENBLAS_NUM_THREADS), and two busy-looping
processes started beside the job (cores shared with other work, as when ranks still
computing share them with ranks waiting).
One JSON line per (setting, size) on stdout: {"setting", "ranks", "bytes", "busy",
"ring_busbw_GBps", "mpi_busbw_GBps"}, or for a run that failed {"setting", "ranks", "bytes",
"busy", "error" (the run's `error:` line, else the last line of its stderr), "rc" (its exit
status; null when it ran past 300 s)}; the table on stderr says "failed (rc N)" or "timed
out" there, and "not run" for a size above a setting's largest. (The MPI thread level, once
a setting, is refused below multiple on several ranks: minidist/comm/README.md.) Results:
examples/BENCHMARKS.md, "When ranks outnumber cores"; what they mean:
minidist/comm/README.md, "When ranks outnumber cores (MPICH's busy polling)".
Tests: tests/test_bench_flags.py.
"""
import json
import os
import signal
import subprocess
import sys
from minidist.train.args import example_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETTINGS = {  # name -> (environment, largest size worth running, busy processes beside the job)
    "default (wait=block)": ({}, None, 0),
    "wait=poll": ({"MINIDIST_COMM_WAIT": "poll"}, None, 0),
    "CH4_PROGRESS_THROTTLE=1": ({"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}, None, 0),
    "POLLS_BEFORE_YIELD=1": ({"MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}, None, 0),
    "BLAS threads=2": ({"MINIDIST_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}, None, 0),
    # (thread level single, with MPICH's algorithm choice or mpich.py's: refused on several
    # ranks since first-use walk 32, comm/__init__.py; BENCHMARKS.md keeps the old rows)
    "2 busy processes, wait=block": ({}, None, 2),
    "2 busy processes, wait=poll": ({"MINIDIST_COMM_WAIT": "poll"}, None, 2),
}


def parse_bytes(text):
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def parse_sizes(text):
    """--sizes: byte counts, comma-separated; each at least one float32 element."""
    sizes = [parse_bytes(s) for s in text.split(",")]
    if min(sizes) < 4:
        raise ValueError(f"{min(sizes)} bytes is less than one float32")
    return sizes


def run(ranks, env, sizes, repeats, busy=0):
    """{bytes: result} (_run's), with `busy` spinning processes on the same cores."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(busy)]
    try:
        return _run(ranks, env, sizes, repeats)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _run(ranks, env, sizes, repeats):
    """{bytes: {"ring": busbw, "mpi": busbw}} from one bench_collectives.py job per size, or
    {bytes: {"error": why, "rc": exit status}} for a job that failed (None: timed out)."""
    results = {}
    for size in sizes:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks),
               sys.executable, "examples/bench_collectives.py", "--ops", "all_reduce",
               "--algos", "ring,mpi", "--min-bytes", str(size), "--max-bytes", str(size),
               "--repeats", str(repeats)]
        full_env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MINIDIST_THREADS": "1", **env}
        job = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = job.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)         # mpiexec and every rank it started
            job.communicate()
            results[size] = {"error": "timed out after 300 s", "rc": None}
            continue
        try:
            rows = [json.loads(line) for line in out.splitlines()]
        except json.JSONDecodeError:
            rows = []
        if job.returncode or not rows:
            results[size] = {"error": failure_line(err, out), "rc": job.returncode}
            continue
        results[size] = {r["algo"]: r["busbw_GBps"] for r in rows}
    return results


def failure_line(err, out):
    """What a failed job said: its `error:` line, else the last line of its stderr (a
    traceback's exception), else of its stdout."""
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [line for line in out.splitlines() if line.strip()] or
            ["no output"])[-1]


def cell(result, algo):
    """One table cell: the busbw, or why there is none."""
    if result is None:
        return "not run"
    if "error" in result:
        return "timed out" if result["rc"] is None else f"failed (rc {result['rc']})"
    return f"{result[algo]:.3f}"


def main():
    p = example_parser(__doc__)
    p.add_argument("--ranks", type=int, default=4, help="MPI processes per run (2 or more)")
    p.add_argument("--sizes", default="64K,1M,8M,64M", type=parse_sizes,
                   help="all_reduce sizes in bytes, comma-separated (K, M suffixes)")
    p.add_argument("--repeats", type=int, default=3, help="bench_collectives.py's --repeats")
    args = p.parse_args()
    if args.ranks < 2:
        p.error(f"--ranks {args.ranks}: an all-reduce needs 2 ranks or more")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be at least 1 (timed repeats per size)")
    sizes = args.sizes
    head = "".join(f"{algo} {s >> 10}K".rjust(16) for s in sizes for algo in ("ring", "mpi"))
    print(f"all_reduce busbw GB/s, {args.ranks} ranks on {os.cpu_count()} cores\n"
          f"{'setting':<38}{head}", file=sys.stderr, flush=True)
    for name, (env, largest, busy) in SETTINGS.items():
        todo = [s for s in sizes if largest is None or s <= largest]
        results = run(args.ranks, env, todo, args.repeats, busy)
        for size, result in results.items():
            row = {"setting": name, "ranks": args.ranks, "bytes": size, "busy": busy}
            if "error" in result:
                row.update(result)
            else:
                row.update(ring_busbw_GBps=result["ring"], mpi_busbw_GBps=result["mpi"])
            print(json.dumps(row), flush=True)
        cells = "".join(cell(results.get(s), a).rjust(16) for s in sizes for a in ("ring", "mpi"))
        print(f"{name:<38}{cells}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
