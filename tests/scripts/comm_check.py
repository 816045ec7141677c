"""Every collective check for one world size, in one mpiexec run (each start costs ~1 s).

    mpiexec -n 4 python tests/scripts/comm_check.py [--trace FILE]

Closed forms (rank r contributes r+1: sums are N(N+1)/2), odd lengths so chunks come out
uneven, float32 and float64, every op and algorithm, blocking and async, cross-checks against
the MPI library's own collective, byte counters against the ring's theory, point-to-point,
sub-groups and a 2x2 mesh (on 4 ranks), MPI's non-blocking collectives, a deliberate mismatch
caught by debug mode, and a Chrome trace. Any failure raises, the abort handler ends the job,
and pytest sees a non-zero exit.
Run by tests/test_comm.py.
"""
import argparse

import numpy as np

from minidist import comm
from minidist.comm import (CollectiveMismatch, DeviceMesh, chunk_bounds, debug, mpi, ring_bytes,
                           trace)
from mpi4py import MPI   # after minidist.comm: MPI starts in comm.init(), not on this import

ALGOS = ("ring", "naive", "mpi")
DTYPES = (np.float32, np.float64)


def lengths(size):
    return sorted({1, size - 1 or 1, size + 1, 7 * size + 3, 1001, 65537})


def check_all_reduce(g, n, dtype):
    r, N = g.rank, g.size
    for op, expect in (("sum", N * (N + 1) / 2), ("avg", (N + 1) / 2), ("max", N), ("min", 1)):
        buf = np.full(n, r + 1, dtype=dtype)
        g.all_reduce(buf, op=op)
        assert np.allclose(buf, expect, rtol=1e-6), (g.algo, op, n, dtype, buf[:4], expect)
    # random data against MPI's Allreduce; all ranks must end bitwise equal (DDP relies on it)
    x = np.random.default_rng(r).standard_normal(n).astype(dtype)
    ref = np.empty_like(x)
    MPI.COMM_WORLD.Allreduce(x, ref)
    g.all_reduce(x)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert np.allclose(x, ref, rtol=tol, atol=tol * N), (g.algo, n, dtype)
    everyone = g.comm.allgather(x.tobytes())
    assert all(b == everyone[0] for b in everyone), f"{g.algo}: ranks differ after all_reduce"


def check_reduce_scatter(g, n, dtype):
    r, N = g.rank, g.size
    lo, hi = g.chunk(n)
    inp = np.arange(n, dtype=dtype) * (r + 1)
    keep = inp.copy()
    for op, factor in (("sum", N * (N + 1) / 2), ("avg", (N + 1) / 2), ("max", N)):
        out = np.full(hi - lo, np.nan, dtype=dtype)   # never read: staging skips copying it
        g.reduce_scatter(out, inp, op=op)
        assert np.allclose(out, np.arange(lo, hi) * factor, rtol=1e-6), (g.algo, op, n, out[:4])
        assert np.array_equal(inp, keep), f"{g.algo}: reduce_scatter modified its input"
    buf = np.arange(n, dtype=dtype) * (r + 1)   # in place: out is this rank's chunk of inp
    g.reduce_scatter(buf[lo:hi], buf)
    assert np.allclose(buf[lo:hi], np.arange(lo, hi) * N * (N + 1) / 2), (g.algo, "in place")


def check_all_gather(g, n, dtype):
    lo, hi = g.chunk(n)
    out = np.full(n, np.nan, dtype=dtype)        # never read: staging skips copying it
    g.all_gather(out, np.arange(lo, hi, dtype=dtype))
    assert np.array_equal(out, np.arange(n, dtype=dtype)), (g.algo, n, out[:8])
    buf = np.full(n, -1, dtype=dtype)           # in place: inp is this rank's chunk of out
    buf[lo:hi] = np.arange(lo, hi)
    g.all_gather(buf, buf[lo:hi])
    assert np.array_equal(buf, np.arange(n, dtype=dtype)), (g.algo, "in place", n)


def check_broadcast(g, n, dtype):
    for root in range(g.size):
        buf = np.arange(n, dtype=dtype) + (root if g.rank == root else -100)
        g.broadcast(buf, root=root)
        assert np.array_equal(buf, np.arange(n, dtype=dtype) + root), (g.algo, root, n)


def check_async(g, n, dtype):
    """Several collectives in flight at once, then waited: same results as blocking ones."""
    r, N = g.rank, g.size
    bufs = [np.full(n, r + k, dtype=dtype) for k in range(3)]
    works = [g.all_reduce(b, async_op=True) for b in bufs]
    lo, hi = g.chunk(n)
    out = np.empty(hi - lo, dtype=dtype)
    works.append(g.reduce_scatter(out, np.full(n, r + 1, dtype=dtype), async_op=True))
    gathered = np.empty(n, dtype=dtype)
    works.append(g.all_gather(gathered, np.arange(lo, hi, dtype=dtype), async_op=True))
    bc = np.full(n, r, dtype=dtype)
    works.append(g.broadcast(bc, root=N - 1, async_op=True))
    works.append(g.barrier(async_op=True))
    for w in works:
        w.wait()
        assert w.is_completed()
    for k, b in enumerate(bufs):
        assert np.allclose(b, N * (N - 1) / 2 + N * k), (g.algo, "async", k)
    assert np.allclose(out, N * (N + 1) / 2) and np.array_equal(gathered, np.arange(n))
    assert (bc == N - 1).all()


def check_counters(g, n):
    """Bytes the ring sends per rank = theory: 2(N-1)/N x bytes for all_reduce."""
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        trace.reset_counters()
        buf, lo_hi = np.ones(n, np.float32), g.chunk(n)
        chunk = np.ones(lo_hi[1] - lo_hi[0], np.float32)
        {"all_reduce": lambda: g.all_reduce(buf), "broadcast": lambda: g.broadcast(buf),
         "reduce_scatter": lambda: g.reduce_scatter(chunk, buf),
         "all_gather": lambda: g.all_gather(buf, chunk)}[op]()
        c = trace.counters(g.name)[op]
        naive = {"all_reduce": 4 * n * (g.size - 1 if g.rank == 0 else 1) * (g.size > 1)}
        expect = naive.get(op) if g.algo == "naive" else ring_bytes(op, n, 4, g.rank, g.size)
        assert expect is None or c["bytes_sent"] == expect, (g.algo, op, n, c, expect)
        assert c["nominal"] == (g.algo == "mpi") and c["calls"] == 1 and c["bytes"] == 4 * n
    if n % g.size == 0 and g.algo != "naive":
        trace.reset_counters()
        g.all_reduce(np.ones(n, np.float32))
        assert trace.bytes_sent(g.name) == 2 * (g.size - 1) * n * 4 // g.size


def check_p2p(g):
    """A ring of sends, blocking and async; both neighbours send first without deadlock."""
    r, N = g.rank, g.size
    right, left = (r + 1) % N, (r - 1) % N
    for n in (3, 300001):   # small (eager) and large (rendezvous) messages
        got = np.empty(n)
        ws = g.send(np.full(n, float(r)), right, async_op=True)
        wr = g.recv(got, left, async_op=True)
        wr.wait()
        ws.wait()
        assert (got == left).all(), ("p2p async", n)
        got[...] = -1                    # synchronize() waits for the handles dropped here
        g.send(np.full(n, float(r)), right, async_op=True)
        g.recv(got, left, async_op=True)
        g.synchronize()
        assert (got == left).all(), ("p2p async, finished by synchronize()", n)
        if N > 1:
            if r % 2 == 0:
                g.send(np.full(n, float(r)), right)
                g.recv(got, left)
            else:
                g.recv(got, left)
                g.send(np.full(n, float(r)), right)
            assert (got == left).all(), ("p2p blocking", n)


def check_groups(world):
    N = world.size
    evens = world.new_group(list(range(0, N, 2)), name="evens")
    if world.rank % 2 == 1:
        assert evens is None
    else:
        buf = np.array([float(world.rank)])
        evens.all_reduce(buf)
        assert buf[0] == sum(range(0, N, 2)) and evens.size == len(range(0, N, 2))
        assert evens.ranks == list(range(0, N, 2))
    backwards = world.new_group(list(range(N))[::-1], name="backwards")   # the list's order
    assert backwards.ranks == list(range(N))[::-1] and backwards.rank == N - 1 - world.rank
    try:
        DeviceMesh(dp=N + 1, tp=1, pp=1)
        raise AssertionError("DeviceMesh accepted a size that does not factor")
    except ValueError as e:
        assert str(N + 1) in str(e) and str(N) in str(e), e
    if N != 4:
        return
    mesh = DeviceMesh(dp=2, tp=2, pp=1)
    d, t, p = mesh.coords
    assert world.rank == t + 2 * d and p == 0 and mesh.rank_of(d, t, p) == world.rank
    assert mesh.tp.ranks == [2 * d, 2 * d + 1] and mesh.dp.ranks == [t, t + 2]
    assert mesh.pp.ranks == [world.rank] and (mesh.tp.rank, mesh.dp.rank) == (t, d)
    for grp in (mesh.tp, mesh.dp):
        buf = np.array([float(world.rank)])
        grp.all_reduce(buf)
        assert buf[0] == sum(grp.ranks), (grp.name, buf)
    grp.all_reduce(np.ones(5), async_op=True).wait()
    mesh.pp.all_reduce(np.ones(3))
    mesh = DeviceMesh(dp=2, cp=2)    # each group in its axis' order; dpcp in world order
    d, c = mesh.dp_rank, mesh.cp_rank
    assert mesh.cp.ranks == [2 * d, 2 * d + 1] and mesh.dp.ranks == [c, c + 2]
    assert mesh.dpcp.ranks == [0, 1, 2, 3] and mesh.dpcp.rank == world.rank


def check_mpi_nonblocking(world):
    """mpi.py's non-blocking variants (MPI_Iallreduce & co.), uneven chunks."""
    r, N, n = world.rank, world.size, 1001
    lo, hi = world.chunk(n)
    buf = np.full(n, r + 1.0)
    mpi.start_all_reduce(world.comm, buf).Wait()
    out = np.empty(hi - lo)
    mpi.start_reduce_scatter(world.comm, out, np.arange(n) * (r + 1.0)).Wait()
    full = np.empty(n)
    mpi.start_all_gather(world.comm, full, np.arange(lo, hi, dtype=float)).Wait()
    bc = np.full(n, float(r))
    mpi.start_broadcast(world.comm, bc, root=N - 1).Wait()
    assert (buf == N * (N + 1) / 2).all() and np.allclose(out, np.arange(lo, hi) * N * (N + 1) / 2)
    assert np.array_equal(full, np.arange(n)) and (bc == N - 1).all()


def check_debug_mismatch(world):
    """Different sizes, then different ops, then an object collective on rank 0 against an
    array one elsewhere (first-use walk 43: the object one skipped the check and both waited
    for ever), then broadcasts from different roots: CollectiveMismatch on every rank,
    naming ranks."""
    if world.size == 1:
        return
    debug.enable()
    n = 10 if world.rank == 0 else 12
    for call in (lambda: world.all_reduce(np.ones(n)),
                 lambda: (world.all_reduce if world.rank == 0 else world.broadcast)(np.ones(10)),
                 lambda: world.all_gather_object(1) if world.rank == 0
                 else world.all_reduce(np.ones(1)),
                 lambda: world.broadcast(np.ones(10), root=0 if world.rank == 0 else 1)):
        try:
            call()
            raise AssertionError("debug mode let a mismatched collective through")
        except CollectiveMismatch as e:
            msg = str(e)
            assert "ranks [0] called" in msg and "ranks disagree" in msg, msg
    world.all_reduce(np.ones(4))   # matching calls still pass the check
    debug.disable()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--trace", help="write a Chrome trace of the run here")
    p.add_argument("--device", choices=("cpu",), default="cpu",
                   help="numpy buffers only (cupy collectives: tests/scripts/comm_gpu_check.py)")
    args = p.parse_args()
    if args.trace:
        trace.enable()
    checks = 0
    for algo in ALGOS:
        g = comm.init(algo)   # the first call: MPI_Init, abort hooks, watchdog
        g.name = f"world-{algo}"  # counters are kept per group name
        for n in lengths(g.size):
            for dtype in DTYPES:
                for check in (check_all_reduce, check_reduce_scatter, check_all_gather,
                              check_broadcast, check_async):
                    check(g, n, dtype)
                    checks += 1
            check_counters(g, n)
        check_p2p(g)
        checks += len(lengths(g.size)) + 1
    world = comm.init("ring")
    check_groups(world)
    check_mpi_nonblocking(world)
    check_debug_mismatch(world)
    assert chunk_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    if args.trace:
        trace.write_chrome_trace(args.trace, world)
    if world.rank == 0:
        print(f"comm_check OK: {world.size} ranks, {checks + 3} check groups")


if __name__ == "__main__":
    main()
