"""The hand-written all-to-all(-v) for one world size, in one mpiexec run.

    mpiexec -n 3 python tests/scripts/alltoall_check.py

Closed forms (rank i sends rank j the value 100 i + j, so rank j must receive 100 i + j from
each i), uneven counts (rank i sends rank j (i + 2 j) % 3 elements: some zero), float32,
float64 and int64, algorithms ring (pairwise), naive and mpi, blocking and async, results
against MPI_Alltoallv on the world communicator, and the byte ledger against the formulas
(alltoall.pairwise_bytes, naive_bytes); and expert parallelism's AllToAll Function
(minidist/ep/exchange.py): its backward against central differences across the ranks
(tests/scripts/dist_gradcheck.py), float64, uneven counts. Any failure raises and aborts the
job. Run by tests/test_alltoall.py.
"""
import argparse

import numpy as np

from minidist import comm
from minidist.comm import alltoall, trace
from minidist.ep.exchange import AllToAll
from mpi4py import MPI   # after minidist.comm: MPI starts in comm.init()

from dist_gradcheck import dist_gradcheck   # (tests/scripts/dist_gradcheck.py)

ALGOS = ("ring", "naive", "mpi")


def counts_matrix(N, uneven):
    """counts[i, j]: elements rank i sends rank j."""
    i, j = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")
    return (i + 2 * j) % 3 if uneven else np.full((N, N), 5)


def check(g, dtype, uneven, async_op):
    r, N = g.rank, g.size
    counts = counts_matrix(N, uneven)
    send, recv = counts[r], counts[:, r]
    inp = np.concatenate([np.full(send[j], 100 * r + j) for j in range(N)]).astype(dtype)
    fill = np.nan if np.dtype(dtype).kind == "f" else -1    # out is never read (staging
    out = np.full(int(recv.sum()), fill, dtype=dtype)         # skips copying it to the host)
    before = trace.bytes_sent(g.name, "all_to_all")
    if uneven:
        work = g.all_to_all_v(out, inp, send.tolist(), recv.tolist(), async_op=async_op)
    else:
        work = g.all_to_all(out, inp, async_op=async_op)
    if async_op:
        work.wait()
    expect = np.concatenate([np.full(recv[i], 100 * i + r) for i in range(N)])
    assert (out == expect).all(), (g.algo, dtype, uneven, out, expect)
    ref = np.empty_like(out)
    off = lambda c: alltoall.offsets(c)[:-1].tolist()        # noqa: E731
    MPI.COMM_WORLD.Alltoallv([inp, (send.tolist(), off(send))], [ref, (recv.tolist(), off(recv))])
    assert (out == ref).all(), "differs from MPI_Alltoallv"
    sent = trace.bytes_sent(g.name, "all_to_all") - before
    itemsize = np.dtype(dtype).itemsize
    if g.algo == "naive":
        formula = alltoall.naive_bytes(send, lambda d: counts[:, d], r, itemsize, N)
    else:
        formula = alltoall.pairwise_bytes(send, r, itemsize)
    assert sent == formula, (g.algo, sent, formula)


def check_random_payload(g):
    """Random float64 rows (what expert parallelism sends), checked against MPI's."""
    r, N = g.rank, g.size
    rng = np.random.default_rng([r, N])
    send = rng.integers(0, 4, N)
    recv = np.empty(N, dtype=np.int64)
    MPI.COMM_WORLD.Alltoall(send.astype(np.int64), recv)
    inp = rng.standard_normal(int(send.sum()) * 3)
    out, ref = np.empty(int(recv.sum()) * 3), np.empty(int(recv.sum()) * 3)
    g.all_to_all_v(out, inp, (send * 3).tolist(), (recv * 3).tolist())
    o = lambda c: alltoall.offsets(c * 3)[:-1].tolist()       # noqa: E731
    MPI.COMM_WORLD.Alltoallv([inp, ((send * 3).tolist(), o(send))],
                             [ref, ((recv * 3).tolist(), o(recv))])
    assert (out == ref).all()


def gradcheck_all_to_all(g):
    """AllToAll's backward, the exchange the other way with the counts swapped, against
    central differences of a loss every rank's output counts in: rank i sends rank j
    (2 i + j + 1) % 3 rows of 2 values (rows kept at home, empty chunks, and on 2 or 4 ranks
    shards of different sizes: a backward that kept the forward's counts fails)."""
    N, r = g.size, g.rank
    i, j = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")
    counts = (2 * i + j + 1) % 3
    send, recv = counts[r], counts[:, r]
    x = np.random.default_rng([5, r]).standard_normal((int(send.sum()), 2))
    return dist_gradcheck(f"AllToAll ({g.algo})", lambda t: AllToAll.apply(t, g, send, recv),
                          x, MPI.COMM_WORLD, "sharded", "sharded")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu",), default="cpu",
                   help="numpy buffers only (the suite passes its --device)")
    p.parse_args()
    world = comm.init()
    for algo in ALGOS:
        g = world.split(0, algo=algo, name=f"a2a-{algo}")
        for dtype in (np.float32, np.float64, np.int64):
            for uneven in (False, True):
                for async_op in (False, True):
                    check(g, dtype, uneven, async_op)
        check_random_payload(g)
        rows = MPI.COMM_WORLD.gather(gradcheck_all_to_all(g))
        if world.rank == 0:
            print(f"AllToAll gradcheck OK ({algo}): elements per rank "
                  f"{[row['elements'] for row in rows]}, max |diff| "
                  f"{max(row['max_abs_diff'] for row in rows):.2g}", flush=True)
    if world.rank == 0:
        print(f"alltoall_check OK: {world.size} ranks", flush=True)


if __name__ == "__main__":
    main()
