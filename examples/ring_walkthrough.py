"""Watch a ring all-reduce happen, step by step, for N ranks inside one process.

    python examples/ring_walkthrough.py                 # 4 ranks, 10 elements (uneven chunks)
    python examples/ring_walkthrough.py --ranks 3 --n 7 --op max
    python examples/ring_walkthrough.py --pdb           # stop in pdb; `s` steps into the ring

The schedule is ring.py's own (`reduce_scatter_step`, `all_gather_step`), so what this prints
is what `mpiexec -n 4 python ...` does with ProcessGroup(algo="ring"); the README section
"Collectives and process groups" shows how to stop one real rank in a debugger too.
"""
import argparse

import numpy as np

from minidist.comm.simulate import simulate_all_reduce, simulate_broadcast


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--n", type=int, default=10, help="elements per buffer")
    p.add_argument("--op", default="sum", choices=("sum", "avg", "max", "min"))
    p.add_argument("--broadcast", action="store_true", help="also show a chain broadcast")
    p.add_argument("--pdb", action="store_true", help="stop in pdb just before the all-reduce")
    args = p.parse_args()

    # rank r starts with r+1 everywhere, so the sum is N(N+1)/2 and easy to check by eye
    inputs = [np.full(args.n, r + 1.0) for r in range(args.ranks)]
    if args.pdb:
        breakpoint()  # `s` steps into simulate_all_reduce; `n` runs a line; `p bufs` prints
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
