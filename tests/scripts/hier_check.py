"""The hierarchical all-reduce (minidist/comm/hier.py) with ranks grouped into simulated nodes.

    MINIDIST_RANKS_PER_NODE=2 mpiexec -n 4 python tests/scripts/hier_check.py

Closed forms (rank r contributes r+1) for sum, avg, max and min; random float64 data against
the MPI library's own Allreduce, odd lengths (chunks uneven in the node and across), every
rank bitwise equal afterwards, the bytes each rank sent equal to hier_bytes, async, and
sub-groups: one whose nodes hold 1 rank each and one with uneven nodes (the flat ring).
Run by tests/test_hier.py.
"""
import argparse

import numpy as np

from minidist import comm
from minidist.comm import trace
from minidist.comm.hier import hier_bytes, ranks_per_node
from mpi4py import MPI   # after minidist.comm: MPI starts in comm.init(), not on this import

LENGTHS = (1, 3, 5, 7, 1001, 65537)


def check(g, per_node):
    r, N = g.rank, g.size
    for n in LENGTHS:
        for op, expect in (("sum", N * (N + 1) / 2), ("avg", (N + 1) / 2), ("max", N),
                           ("min", 1)):
            buf = np.full(n, r + 1, dtype=np.float64)
            g.all_reduce(buf, op=op)
            assert np.array_equal(buf, np.full(n, expect)), (g.name, op, n, buf[:4], expect)
        x = np.random.default_rng(r).standard_normal(n)
        ref = np.empty_like(x)
        g.comm.Allreduce(x, ref)
        trace.reset_counters()
        g.all_reduce(x, async_op=True).wait()
        assert np.allclose(x, ref, rtol=1e-12, atol=1e-12 * N), (g.name, n)
        sent = trace.counters()["all_reduce"]["bytes_sent"]
        assert sent == hier_bytes(n, 8, r, g.ranks, per_node), (g.name, n, sent)
        everyone = g.comm.allgather(x.tobytes())
        assert all(b == everyone[0] for b in everyone), f"{g.name}: ranks differ"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu",), default="cpu",
                   help="numpy buffers only (the mpi fixture passes the session's device)")
    p.parse_args()
    world = comm.init("hier")
    per_node = ranks_per_node()
    assert world._hier.k == per_node and not world._hier.flat, "expected 2 nodes x 2 ranks"
    assert world.algo_text() == "hier: 2 nodes x 2 ranks", world.algo_text()   # the logs'
    assert world.algo_text("ZeRO's reduce-scatters") == ("hier, run as the flat ring: hier "
                                                         "splits all-reduces alone, not ZeRO's "
                                                         "reduce-scatters; 2 nodes x 2 ranks")
    check(world, per_node)
    odd = world.new_group([0, 2])          # one rank on each node: the flat ring
    if odd is not None:
        assert odd._hier.flat
        assert odd.algo_text() == "hier, run as the flat ring: one rank per node"
        check(odd, per_node)
    uneven = world.new_group([0, 1, 2])    # 2 + 1: nodes differ, the flat ring
    if uneven is not None:
        assert uneven._hier.flat and uneven.algo_text() == (
            "hier, run as the flat ring: nodes holding different numbers of its ranks")
        check(uneven, per_node)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"hier_check OK: {world.size} ranks, {per_node} per node", flush=True)


if __name__ == "__main__":
    main()
