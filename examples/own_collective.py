"""A collective algorithm of your own beside minidist's: examples/recursive_doubling.py
registered with comm.register_algo, a group built with it, and its all-reduce checked against
the ring's and the MPI library's on the same data, then timed; its broadcast checked too (any
rank count).

    mpiexec -n 4 python examples/own_collective.py
    mpiexec -n 3 python examples/own_collective.py --sizes 1,7,100003 --iters 50

Rank 0 prints one JSON line per size: the largest difference of the registered algorithm's
sum from the ring's and MPI's (float64; another order of additions: ~1e-16 relative), whether
every rank holds the same bits, whether its broadcast from the last rank gave every rank that
rank's buffer exactly, and microseconds per all-reduce of each (one run on this machine;
examples/bench_collectives.py --ops all_reduce --algos ring,mpi,examples/recursive_doubling.py
sweeps sizes properly). Exit status 1 when a difference exceeds --tol or a broadcast differs.
"""
import json
import sys
import time

import numpy as np

import recursive_doubling
from minidist import backend, comm
from minidist.backend import to_device, to_host
from minidist.train.args import check_at_least, example_parser


def timed(group, buf, iters):
    """Microseconds per all-reduce of `buf` on `group`, the slowest rank's."""
    group.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        group.all_reduce(buf)
    took = np.array([(time.perf_counter() - t0) / iters * 1e6])
    group.all_reduce(took, op="max")
    return float(took[0])


def main():
    p = example_parser(__doc__)
    p.add_argument("--sizes", default="1,1000,100003",
                   help="comma-separated buffer lengths (float64 elements)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size and algorithm")
    p.add_argument("--tol", type=float, default=1e-12, help="largest relative difference")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the buffers live (cuda: staged through the host for MPI)")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    check_at_least(p, args, [("--iters", 1, "calls to time")])
    if not sizes or min(sizes) < 1:
        p.error(f"--sizes {args.sizes}: give lengths of at least 1")
    comm.register_algo("recursive_doubling", recursive_doubling)   # every rank, before init
    groups = {name: comm.init(name) for name in ("recursive_doubling", "ring", "mpi")}
    backend.setup(threads=1, device=args.device)
    own = groups["recursive_doubling"]
    worst = 0.0
    for n in sizes:
        data = to_device(np.random.default_rng([own.rank, n]).standard_normal(n))
        out = {}
        for name, group in groups.items():
            out[name] = data.copy()
            group.all_reduce(out[name])
        out = {name: to_host(a) for name, a in out.items()}
        scale = float(np.abs(out["ring"]).max())
        diffs = {f"vs_{name}": float(np.abs(out["recursive_doubling"] - out[name]).max()) / scale
                 for name in ("ring", "mpi")}
        gathered = np.empty(own.size * n)
        groups["mpi"].all_gather(gathered, out["recursive_doubling"])   # (it has no gather)
        same = bool((gathered.reshape(own.size, n) == out["recursive_doubling"]).all())
        sent = data.copy()
        own.broadcast(sent, root=own.size - 1)
        last = data.copy()
        groups["mpi"].broadcast(last, root=own.size - 1)
        flags = np.array([float(np.array_equal(to_host(sent), to_host(last)))])
        groups["mpi"].all_reduce(flags, op="min")
        broadcast = bool(flags[0])
        worst = max(worst, *diffs.values(), 0.0 if same and broadcast else np.inf)
        us = {f"{name}_us": round(timed(group, data.copy(), args.iters), 1)
              for name, group in groups.items()}
        if own.rank == 0:
            print(json.dumps({"ranks": own.size, "elements": n, **diffs,
                              "same_on_every_rank": same, "broadcast_exact": broadcast, **us}),
                  flush=True)
    sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
    main()
