"""Watch ring attention (context parallelism) happen, step by step, for N ranks in one process.

    python examples/ring_attention_walkthrough.py                  # 4 ranks, T = 16, zig-zag
    python examples/ring_attention_walkthrough.py --split naive --row 15
    python examples/ring_attention_walkthrough.py --pdb   # stop at each ring step's block:
    (Pdb) p held, src, kp                      # who holds which block; the row's; positions
    (Pdb) b attend_block                       # then c: into minidist/cp/ring.py's own

Three tables: who holds which positions (zig-zag: chunks r and 2N-1-r of 2N; naive:
contiguous), the causal tiles each rank computes (the naive split's imbalance), then the ring
itself: at each step, which rank's key/value block every rank holds, and for one query row
how its running max m and running sum l (of exp(score - m)) change as blocks arrive. The
attention is minidist/cp/ring.py's own `attend_block`, the code each real rank runs between
its send and its receive (`mpiexec -n 4 python examples/train_gpt.py --cp 4`); the messages
are slices here. Tested by tests/test_context_parallel.py (the same simulation, exact).
"""
import math
import pdb

import numpy as np

from minidist.autograd.flash import partial_attention
from minidist.cp.ring import attend_block, causal_tiles, layout, positions
from minidist.train.args import example_parser


def show_layouts(T, n):
    print(f"who holds which positions (T = {T}, {n} ranks)")
    for split in ("naive", "zigzag"):
        for r in range(n):
            held = " ".join(f"{p:2d}" for p in positions(T, n, r, split))
            print(f"  {split:6s} rank {r}: {held}")


def show_balance(T, n, block):
    print(f"\ncausal tiles ({block} x {block}) computed per rank over one ring pass")
    for split in ("naive", "zigzag"):
        counts = causal_tiles(T, n, split, block)
        print(f"  {split:6s} {counts}   slowest / mean = {max(counts) / np.mean(counts):.2f}")


def row_stats(q_row, k, q_pos, k_pos):
    """(max, sum of exp(s - max)) of one query row over the keys it may see; None if none."""
    s = (k @ q_row / math.sqrt(q_row.shape[-1]))[k_pos <= q_pos]
    return (s.max(), np.exp(s - s.max()).sum()) if s.size else None


def walk(T, n, split, row, hs=4, seed=0, stop=False):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((T, hs)) for _ in range(3))   # one head, one sequence
    owner = next(r for r in range(n) if row in positions(T, n, r, split))
    mine = positions(T, n, owner, split)
    i = int(np.flatnonzero(mine == row)[0])
    y, lse = np.zeros((len(mine), hs)), np.full(len(mine), -math.inf)
    m, l = -math.inf, 0.0
    print(f"\nthe ring ({split}): rank r sends its block to r+1, receives from r-1; "
          f"query row {row} lives on rank {owner}")
    for step in range(n):
        held = [(r - step) % n for r in range(n)]
        print(f"  step {step}: " + "  ".join(f"rank {r} holds kv{s}" for r, s in enumerate(held)))
        src = held[owner]
        kp = positions(T, n, src, split)
        if stop:                       # --pdb: held, src, kp in scope; `s` steps into it
            pdb.set_trace()
        attend_block(q[mine], layout(T, n, owner, split), np.stack([k[kp], v[kp]]),
                     layout(T, n, src, split), y, lse, block=2)
        stats = row_stats(q[row], k[kp], row, kp)
        if stats is None:
            print(f"      row {row}: kv{src} (positions {kp.min()}..{kp.max()}) is all in its "
                  f"future: skipped, m = {m:.3f}, l = {l:.3f}")
            continue
        m_new = max(m, stats[0])
        l = l * math.exp(m - m_new) + stats[1] * math.exp(stats[0] - m_new)  # rescale old sum
        m = m_new
        print(f"      row {row}: kv{src} seen -> m = {m:.3f}, l = {l:.3f}, m + log l = "
              f"{m + math.log(l):.6f}, merged lse = {lse[i]:.6f}")
    y_ref, _ = partial_attention(q, k, v, 0, 0, 4)
    print(f"  after {n} steps row {row}'s output equals one process's: "
          f"max |diff| = {np.abs(y[i] - y_ref[row]).max():.1e}")


def main():
    p = example_parser(__doc__)
    p.add_argument("--ranks", type=int, default=4, help="simulated context-parallel ranks N")
    p.add_argument("--T", type=int, default=16,
                   help="sequence length, a multiple of 2N (N: --ranks)")
    p.add_argument("--split", choices=("zigzag", "naive"), default="zigzag",
                   help="the ring to follow: zigzag (chunks r, 2N-1-r) or naive (contiguous)")
    p.add_argument("--row", type=int, default=None,
                   help="the query position to follow, 0 to T-1 (default: 13, or T-1 if T <= 13)")
    p.add_argument("--pdb", action="store_true",
                   help="stop in pdb at each ring step, before the owner's attend_block")
    args = p.parse_args()
    # both tables show both splits, so T must split into 2N chunks even for --split naive
    if args.ranks < 1:
        p.error(f"--ranks {args.ranks}: simulate at least 1 rank")
    if args.T < 1 or args.T % (2 * args.ranks):
        p.error(f"--T {args.T}: choose a positive multiple of 2N = {2 * args.ranks}")
    if args.row is None:
        args.row = min(13, args.T - 1)
    if not 0 <= args.row < args.T:
        p.error(f"--row {args.row}: choose a query position from 0 to {args.T - 1}")
    show_layouts(args.T, args.ranks)
    show_balance(args.T, args.ranks, 2)
    walk(args.T, args.ranks, args.split, args.row, stop=args.pdb)


if __name__ == "__main__":
    main()
