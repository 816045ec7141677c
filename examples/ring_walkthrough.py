"""Watch a ring all-reduce happen, step by step, for N ranks inside one process.

    python examples/ring_walkthrough.py                 # 4 ranks, 10 elements (uneven chunks)
    python examples/ring_walkthrough.py --ranks 3 --n 7 --op max
    python examples/ring_walkthrough.py --pdb           # stop in pdb where `bufs` exists:
    (Pdb) p bufs                                        # every simulated rank's buffer
                                                        # (rank r starts with r + 1)
    (Pdb) s                                             # into the reduce-scatter phase
    (Pdb) p bufs

The schedule is ring.py's own (`reduce_scatter_step`, `all_gather_step`), so what this prints
is what `mpiexec -n 4 python ...` does with ProcessGroup(algo="ring"); `--pdb` steps this
simulator's loop, not ring.py's send/receive loop. To step the real one on a real rank:
`mpiexec -n 4 python -m minidist.comm.rankpdb SCRIPT`, `b
minidist.comm.ring.ring_reduce_scatter_in_place` (minidist/comm/README.md, "Debugging").
"""
import inspect
import pdb

import numpy as np

from minidist.comm import simulate
from minidist.comm.simulate import simulate_all_reduce, simulate_broadcast
from minidist.train.args import example_parser


def run_under_pdb(inputs, op):
    """simulate_all_reduce under pdb, stopped at its reduce-scatter phase: `bufs` (one array
    per simulated rank) exists there, and `s` steps into the phase's loop."""
    lines, first = inspect.getsourcelines(simulate_all_reduce)
    where = next(i for i, line in enumerate(lines) if '_ring_phase("reduce-scatter"' in line)
    debugger = pdb.Pdb()
    debugger.set_break(simulate.__file__, first + where)
    debugger.rcLines.append("continue")     # run on to that breakpoint before the first prompt
    return debugger.runcall(simulate_all_reduce, inputs, op=op)


def main():
    p = example_parser(__doc__)
    p.add_argument("--ranks", type=int, default=4, help="simulated ranks")
    p.add_argument("--n", type=int, default=10, help="elements per buffer")
    p.add_argument("--op", default="sum", choices=("sum", "avg", "max", "min"),
                   help="the all-reduce's reduction")
    p.add_argument("--broadcast", action="store_true", help="also show a chain broadcast")
    p.add_argument("--pdb", action="store_true",
                   help="stop in pdb inside the all-reduce, before its reduce-scatter phase")
    args = p.parse_args()
    if args.ranks < 1:
        p.error(f"--ranks {args.ranks}: simulate at least 1 rank")
    if args.n < 1:
        p.error(f"--n {args.n}: give each buffer at least 1 element")

    # rank r starts with r+1 everywhere, so the sum is N(N+1)/2 and easy to check by eye
    inputs = [np.full(args.n, r + 1.0) for r in range(args.ranks)]
    if args.pdb:
        outputs = run_under_pdb(inputs, args.op)
    else:
        outputs = simulate_all_reduce(inputs, op=args.op)
    expected = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}[args.op](
        np.stack(inputs), axis=0)
    print(f"\nevery rank now holds {outputs[0][:6]}...; expected {expected[:6]}...: "
          f"{'OK' if all(np.array_equal(o, expected) for o in outputs) else 'MISMATCH'}")
    if args.broadcast:
        print()
        simulate_broadcast(np.arange(args.n, dtype=float), args.ranks)


if __name__ == "__main__":
    main()
