"""How waiting for messages behaves when ranks outnumber cores: one table, many settings.

    python examples/bench_polling.py                  # 4 ranks; about two minutes
    python examples/bench_polling.py --ranks 2 --sizes 64K,8M

Runs examples/bench_collectives.py (all_reduce, ring and mpi) under mpiexec once per setting
below and prints busbw (GB/s) per size. The settings: minidist's wait policy
(MINIDIST_COMM_WAIT, minidist/comm/progress.py), MPICH's polling knobs (MPIR_CVAR_*, read by
MPICH at MPI_Init), the MPI thread level mpi4py asks for (MPI4PY_RC_THREAD_LEVEL), BLAS threads
per rank (OPENBLAS_NUM_THREADS), and two busy-looping processes started beside the job (cores
shared with other work, as when ranks still computing share them with ranks waiting).
Results: examples/BENCHMARKS.md, "When ranks outnumber cores"; what they mean:
minidist/comm/README.md, "When ranks outnumber cores (MPICH's busy polling)".
"""
import json
import os
import subprocess
import sys
from minidist.train.args import example_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

AUTO = {f"MPIR_CVAR_{op}_POSIX_INTRA_ALGORITHM": "auto"   # MPICH's own choice, not mpich.py's
        for op in ("BARRIER", "BCAST", "REDUCE", "ALLREDUCE")}
SETTINGS = {  # name -> (environment, largest size worth running, busy processes beside the job)
    "default (wait=block)": ({}, None, 0),
    "wait=poll": ({"MINIDIST_COMM_WAIT": "poll"}, None, 0),
    "CH4_PROGRESS_THROTTLE=1": ({"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1"}, None, 0),
    "POLLS_BEFORE_YIELD=1": ({"MPIR_CVAR_POLLS_BEFORE_YIELD": "1"}, None, 0),
    "BLAS threads=2": ({"MINIDIST_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"}, None, 0),
    "thread level single": ({"MPI4PY_RC_THREAD_LEVEL": "single", **AUTO}, 64 << 10, 0),
    "single + mpich.py defaults": ({"MPI4PY_RC_THREAD_LEVEL": "single"}, None, 0),
    "2 busy processes, wait=block": ({}, None, 2),
    "2 busy processes, wait=poll": ({"MINIDIST_COMM_WAIT": "poll"}, None, 2),
}


def parse_bytes(text):
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def run(ranks, env, sizes, repeats, busy=0):
    """busbw per (algo, bytes), with `busy` spinning processes on the same cores."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(busy)]
    try:
        return _run(ranks, env, sizes, repeats)
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _run(ranks, env, sizes, repeats):
    rows = {}
    for size in sizes:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks),
               sys.executable, "examples/bench_collectives.py", "--ops", "all_reduce",
               "--algos", "ring,mpi", "--min-bytes", str(size), "--max-bytes", str(size),
               "--repeats", str(repeats)]
        full_env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MINIDIST_THREADS": "1", **env}
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                                 timeout=300)
        except subprocess.TimeoutExpired:
            continue
        for line in out.stdout.splitlines():
            r = json.loads(line)
            rows[(r["algo"], r["bytes"])] = r["busbw_GBps"]
    return rows


def main():
    p = example_parser(__doc__)
    p.add_argument("--ranks", type=int, default=4, help="MPI processes per run")
    p.add_argument("--sizes", default="64K,1M,8M,64M",
                   help="all_reduce sizes in bytes, comma-separated (K, M suffixes)")
    p.add_argument("--repeats", type=int, default=3, help="bench_collectives.py's --repeats")
    args = p.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    head = "".join(f"{algo} {s >> 10}K".rjust(13) for s in sizes for algo in ("ring", "mpi"))
    print(f"all_reduce busbw GB/s, {args.ranks} ranks on {os.cpu_count()} cores\n"
          f"{'setting':<38}{head}", flush=True)
    for name, (env, largest, busy) in SETTINGS.items():
        todo = [s for s in sizes if largest is None or s <= largest]
        rows = run(args.ranks, env, todo, args.repeats, busy)
        cells = "".join((f"{rows[(a, s)]:.3f}" if (a, s) in rows else "-").rjust(13)
                        for s in sizes for a in ("ring", "mpi"))
        print(f"{name:<38}{cells}", flush=True)


if __name__ == "__main__":
    main()
