"""Collective bandwidth, nccl-tests style: one JSON line per (op, algorithm, size).

    mpiexec -n 4 python examples/bench_collectives.py                     # all ops and algos
    mpiexec -n 4 python examples/bench_collectives.py --ops all_reduce --algos ring,mpi \\
        --min-bytes 8M --max-bytes 64M --repeats 5
    mpiexec -n 2 python examples/bench_collectives.py --overlap          # async progress
    mpiexec -n 4 python examples/bench_collectives.py --interleave --max-bytes 2M  # sync cost
    mpiexec -n 4 python examples/bench_collectives.py --max-bytes 1M --trace comm.json
    mpiexec -n 4 python examples/bench_collectives.py --ops all_reduce --algos ring,hier,mpi \
        --ranks-per-node 2                             # hierarchical: 2 simulated nodes x 2
    mpiexec -n 4 python examples/bench_collectives.py --ops all_reduce \
        --algos ring,mpi,examples/recursive_doubling.py   # an algorithm of your own

Each line: {"op", "algo", "ranks", "bytes", "time_s", "algbw_GBps", "busbw_GBps"}, with
nccl-tests' definitions (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
algbw = bytes / time; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for reduce_scatter,
all_gather and all_to_all, x 1 for broadcast, which is the bandwidth a link must carry,
comparable across rank counts and algorithms. `bytes` is the full buffer (reduce_scatter's
input, all_gather's output, all_to_all's input: ring is the pairwise exchange, mpi
MPI_Alltoallv), each size rounded down to whole --dtype elements. time_s: `--iters`
back-to-back calls averaged, the slowest rank's, best of `--repeats` (the best, because
other processes share this machine's cores; the algorithms take turns inside each repeat so
that they meet the same conditions). Rank 0 prints the lines on
stdout and a ring/mpi busbw table on stderr. --overlap measures how much of an async
all-reduce hides behind numpy work (the stream thread vs MPI_Iallreduce): "hidden" is the
fraction of the shorter of the two that disappeared from the total (1: perfect overlap).
--ranks-per-node N groups world ranks r into simulated nodes r // N for the `hier` algorithm
(minidist/comm/hier.py; it sets MINIDIST_RANKS_PER_NODE; default: the launcher's ranks on this
node). examples/calibrate_here.py fits the alpha-beta model to these lines.
It needs 2 ranks or more (busbw is 0 on one). Every flag is checked before MPI starts: a bad
one is one `error:` line from rank 0, exit status 2 (tests/test_bench_flags.py).
"""
import importlib.util
import json
import os
import sys
import time

import numpy as np

from minidist import backend, comm
from minidist.backend import get_xp, synchronize
from minidist.comm import mpi as mpi_algo, trace
from minidist.launcher import world_size_from_env
from minidist.train.args import a_path, check_at_least, example_parser
from minidist.train.cli import UsageError, check_out_file
from mpi4py import MPI   # after minidist.comm: MPI starts in comm.init(), not on import

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
              "all_to_all": lambda n: (n - 1) / n}


DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int32", "int64")
# (flag, lowest allowed value, what it is), checked in this order
AT_LEAST = (("--factor", 2, "each size is the last one times it"),
            ("--repeats", 1, "timed repeats per size"),
            ("--iters", 0, "calls timed per repeat; 0: by size"),
            ("--warmup", 0, "untimed calls per size"),
            ("--ranks-per-node", 0, "0: MINIDIST_RANKS_PER_NODE or the launcher's"),
            ("--compute-iters", 0, "0: sized to the all-reduce"))


def parse_bytes(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if not text:
        raise ValueError("no size")
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units \
        else int(text)


def sizes(lo, hi, factor):
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def make_call(group, op, nbytes, dtype):
    """A zero-argument function running `op` once on `nbytes` of `dtype`."""
    xp, n = get_xp(), nbytes // np.dtype(dtype).itemsize
    full = xp.full(n, 0, dtype=dtype)   # zeros stay zeros under repeated sums (no overflow);
    lo, hi = group.chunk(n)             # full(), not zeros(): calloc'd pages would read free
    part = xp.full(hi - lo, 0, dtype=dtype)
    n_even = n - n % group.size                       # all_to_all: equal chunks
    a2a_in, a2a_out = full[:n_even].copy(), xp.empty(n_even, dtype=dtype)
    return {"all_to_all": lambda: group.all_to_all(a2a_out, a2a_in),
            "all_reduce": lambda: group.all_reduce(full),
            "reduce_scatter": lambda: group.reduce_scatter(part, full),
            "all_gather": lambda: group.all_gather(full, part),
            "broadcast": lambda: group.broadcast(full)}[op]


def time_call(group, call, iters, warmup, repeats):
    """Seconds per call: mean over `iters`, slowest rank, best of `repeats`."""
    for _ in range(warmup):
        call()
    return min(time_once(group, call, iters) for _ in range(repeats))


def time_once(group, call, iters):
    """Mean seconds per call over `iters` back-to-back calls, on the slowest rank."""
    group.comm.Barrier()
    t = time.perf_counter()
    for _ in range(iters):
        call()
    synchronize()
    return group.comm.allreduce((time.perf_counter() - t) / iters, op=MPI.MAX)


def bench(args):
    """One row per (op, size, algo). The algorithms take turns within each repeat, so a
    burst of other work on the machine hits them alike; each keeps its best repeat."""
    results = []
    groups = {algo: comm.init(algo) for algo in args.algos}
    world = next(iter(groups.values()))
    itemsize = np.dtype(args.dtype).itemsize
    for op in args.ops:
        for size in sizes(args.min_bytes, args.max_bytes, args.factor):
            nbytes = size // itemsize * itemsize       # whole elements: what the calls move
            calls = {algo: make_call(g, op, nbytes, args.dtype) for algo, g in groups.items()}
            iters = args.iters or max(2, min(50, (32 << 20) // nbytes))
            for call in calls.values():
                for _ in range(args.warmup):
                    call()
            best = {algo: float("inf") for algo in calls}
            for _ in range(args.repeats):
                for algo, call in calls.items():
                    best[algo] = min(best[algo], time_once(world, call, iters))
            for algo, t in best.items():
                n = world.size
                algbw = nbytes / t / 1e9
                row = {"op": op, "algo": algo, "ranks": n, "bytes": nbytes, "time_s": t,
                       "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](n)}
                results.append(row)
                if world.rank == 0:
                    print(json.dumps(row), flush=True)
    return results


def ratio_table(results, num="ring", den="mpi"):
    """busbw(num) / busbw(den) per (op, size), printed on stderr."""
    by = {(r["op"], r["algo"], r["bytes"]): r["busbw_GBps"] for r in results}
    lines = [f"{'op':<15}{'bytes':>10}  {num:>8} GB/s  {den:>8} GB/s  {num}/{den}"]
    for (op, algo, nbytes), bw in by.items():
        if algo == num and (op, den, nbytes) in by:
            ref = by[(op, den, nbytes)]
            lines.append(f"{op:<15}{nbytes:>10}  {bw:>13.3f}  {ref:>13.3f}  {bw / ref:.2f}")
    sys.stderr.write("\n".join(lines) + "\n")


def overlap(args):
    """Seconds for: compute alone, all-reduce alone, both through the stream thread
    (async_op=True), both through MPI_Iallreduce started before the compute and waited after.
    The compute is sized to take about as long as the all-reduce, so perfect overlap would
    halve the time of doing both: 256x256 float64 matmuls (`--compute matmul`, which need a
    core, and release the GIL), or sleeping (`--compute sleep`: the main thread waiting, as it
    does for GPU kernels), which shows whether communication progresses at all meanwhile."""
    group = comm.init("ring")
    buf = np.zeros(args.max_bytes // 4, np.float32)
    a = np.random.default_rng(0).standard_normal((256, 256))
    t_comm = time_call(group, lambda: group.all_reduce(buf), 3, 1, args.repeats)
    t_mm = time_call(group, lambda: a @ a, 5, 1, args.repeats)
    reps = args.compute_iters or max(1, round(t_comm / t_mm))

    def compute():
        if args.compute == "sleep":
            return time.sleep(t_comm)
        for _ in range(reps):
            a @ a

    def thread_both():
        work = group.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    def iallreduce_both():
        req = mpi_algo.start_all_reduce(group.comm, buf)
        compute()
        req.Wait()
    cases = {"compute": compute, "all_reduce": lambda: group.all_reduce(buf),
             "thread_async": thread_both, "mpi_iallreduce": iallreduce_both}
    row = {k: time_call(group, f, 3, 1, args.repeats) for k, f in cases.items()}
    serial = row["compute"] + row["all_reduce"]
    row.update(ranks=group.size, bytes=args.max_bytes, compute_kind=args.compute,
               hidden_thread=(serial - row["thread_async"]) / min(row["compute"],
                                                                  row["all_reduce"]),
               hidden_iallreduce=(serial - row["mpi_iallreduce"]) / min(row["compute"],
                                                                        row["all_reduce"]))
    if group.rank == 0:
        print(json.dumps(row), flush=True)


def interleave(args):
    """Seconds per iteration of: compute alone (every rank at once), the all-reduce alone, and
    compute then a blocking all-reduce, as tensor parallelism runs them (the matmuls sized to
    take 4x the all-reduce). "sync_s" = interleaved - compute - all-reduce: what a blocking
    collective costs beyond its alpha-beta time when the ranks come to it from compute (their
    arrival spread, and with more ranks than cores a neighbour that is not running). The three
    take turns inside each repeat; each keeps its best repeat, and "sync_median_s" is the
    median over the repeats of each repeat's own difference (a burst of other work that
    lands on one repeat moves the median less than it moves a difference of best times)."""
    group = comm.init("ring")
    buf = np.zeros(args.max_bytes // 4, np.float32)
    a = np.random.default_rng(0).standard_normal((256, 256))
    t_comm = time_call(group, lambda: group.all_reduce(buf), 5, 1, args.repeats)
    t_mm = time_call(group, lambda: a @ a, 5, 1, args.repeats)
    reps = args.compute_iters or max(1, round(4 * t_comm / t_mm))

    def compute():
        for _ in range(reps):
            a @ a

    def both():
        compute()
        group.all_reduce(buf)
    calls = {"compute": compute, "all_reduce": lambda: group.all_reduce(buf),
             "interleaved": both}
    for call in calls.values():
        call()                                               # warm-up
    times = {k: [] for k in calls}
    for _ in range(args.repeats):
        for k, call in calls.items():
            times[k].append(time_once(group, call, 10))
    row = {k: min(v) for k, v in times.items()}
    diffs = [i - c - r for c, r, i in zip(*times.values())]
    row.update(ranks=group.size, bytes=args.max_bytes, compute_iters=reps,
               sync_s=row["interleaved"] - row["compute"] - row["all_reduce"],
               sync_median_s=float(np.median(diffs)))
    if group.rank == 0:
        print(json.dumps(row), flush=True)


FUNCTIONS = {"all_to_all": "all_to_all_v"}      # an op timed -> the module's function


def own_algorithm(p, args, path):
    """The module of an algorithm of your own, `--algos FILE` (examples/recursive_doubling.py
    shows one: functions over a Channel, as minidist/comm/ring.py's), registered under the
    file's name; each --ops it lacks is one error line."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if not os.path.isfile(path) or spec is None:
        p.error(f"--algos {path}: no such file (an algorithm of your own: a .py file)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    has = [op for op in OPS if callable(getattr(module, FUNCTIONS.get(op, op), None))]
    for op in args.ops:
        if op not in has:
            p.error(f"--algos {path}: it has no {FUNCTIONS.get(op, op)}(ch, ...), which --ops "
                    f"{op} times; give --ops {','.join(has) or '(none: it has no collective)'}")
    try:
        comm.register_algo(name, module)
    except (ValueError, TypeError) as e:       # (a file named like minidist's own: walk 40)
        p.error(f"--algos {path}: {e}")
    return name


def check_flags(p, args):
    """Every flag, before MPI starts, alike on every rank (p.error: one line from rank 0,
    exit status 2): a sweep that would never end (--factor 1, --min-bytes 0), print
    nothing (--min-bytes above --max-bytes) or time nothing (--repeats 0, a buffer smaller
    than one element), an op, algorithm or dtype that does not exist, and one rank."""
    check_at_least(p, args, AT_LEAST)
    args.algos = [own_algorithm(p, args, name) if name.endswith(".py") else name
                  for name in args.algos]
    for flag, names, known in (("--ops", args.ops, OPS), ("--algos", args.algos, comm.algos())):
        for name in names:
            if name not in known:
                p.error(f"{flag} {','.join(names)}: {name!r} is not one of {', '.join(known)} "
                        "(or a .py file: an algorithm of your own)")
    itemsize = np.dtype(args.dtype).itemsize
    sweep = not (args.overlap or args.interleave)   # (those two time --max-bytes of float32)
    if sweep and args.min_bytes < itemsize:
        p.error(f"--min-bytes {args.min_bytes}: smaller than one {args.dtype} element; give "
                f"at least {itemsize}")
    if not sweep and args.max_bytes < 4:
        p.error(f"--max-bytes {args.max_bytes}: smaller than one float32 element (what "
                "--overlap and --interleave move); give at least 4")
    if sweep and args.min_bytes > args.max_bytes:
        p.error(f"--min-bytes {args.min_bytes}: above --max-bytes {args.max_bytes}, so no size "
                "would be timed; give --max-bytes at least --min-bytes")
    n = world_size_from_env()
    if n < 2:
        p.error("one process: a collective needs 2 ranks or more; run it under mpiexec -n N "
                "(N >= 2), e.g. mpiexec -n 2 python examples/bench_collectives.py")
    problems = comm.env_problems("hier" if "hier" in args.algos else "ring")
    if problems:
        p.error("; ".join(problems))
    try:                # a folder, or one that cannot be made: it was a traceback at the end
        if args.trace:
            check_out_file("--trace", args.trace)
    except UsageError as e:
        p.error(str(e))


def main():
    p = example_parser(__doc__)
    p.add_argument("--ops", default=",".join(OPS), type=lambda s: s.split(","),
                   help="the collectives to time, comma-separated")
    p.add_argument("--algos", default="ring,naive,mpi", type=lambda s: s.split(","),
                   help="comma list of ring, naive, mpi, hier, nccl (nccl: --device cuda) "
                   "and .py files of your own (examples/recursive_doubling.py)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="hier: simulated node size (0: MINIDIST_RANKS_PER_NODE or the launcher's)")
    p.add_argument("--min-bytes", default="4K", type=parse_bytes,
                   help="smallest buffer, in bytes (K, M, G suffixes)")
    p.add_argument("--max-bytes", default="64M", type=parse_bytes,
                   help="largest buffer (--overlap, --interleave: the only size)")
    p.add_argument("--factor", default=2, type=int, help="size step (nccl-tests' -f)")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the buffers' element type")
    p.add_argument("--iters", type=int, default=0, help="calls timed per repeat (0: by size)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per size, first")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per size, best kept")
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when CuPy sees a GPU, else cpu")
    p.add_argument("--overlap", action="store_true", help="measure async overlap instead")
    p.add_argument("--interleave", action="store_true",
                   help="measure a blocking all-reduce between compute instead (sync_s)")
    p.add_argument("--trace", type=a_path,
                   help="write a Chrome trace (all ranks, one row each) to FILE")
    p.add_argument("--compute", default="matmul", choices=("matmul", "sleep"),
                   help="what the main thread does meanwhile (--overlap)")
    p.add_argument("--compute-iters", type=int, default=0,
                   help="256^2 matmuls per step for --overlap (0: as long as the all-reduce) "
                   "and --interleave (0: 4x as long)")
    args = p.parse_args()
    if args.ranks_per_node:   # read by minidist.comm.hier when the hier groups are made
        os.environ["MINIDIST_RANKS_PER_NODE"] = str(args.ranks_per_node)
    check_flags(p, args)
    backend.setup(threads=1, device=args.device)   # the collectives' own reductions: 1 thread
    comm.init()              # MPI_Init (MPICH settings first), abort hooks, watchdog
    if args.trace:
        trace.enable()
    if args.overlap:
        overlap(args)
    elif args.interleave:
        interleave(args)
    else:
        results = bench(args)
        if MPI.COMM_WORLD.Get_rank() == 0 and {"ring", "mpi"} <= set(args.algos):
            ratio_table(results)
    if args.trace:
        trace.write_chrome_trace(args.trace, comm.init())
        if MPI.COMM_WORLD.Get_rank() == 0:   # stderr: stdout is the JSON lines
            print(f"trace of every collective written to {args.trace} (open it in "
                  "https://ui.perfetto.dev or chrome://tracing)", file=sys.stderr)


if __name__ == "__main__":
    main()
