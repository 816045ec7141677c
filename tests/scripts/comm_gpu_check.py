"""Collectives on cupy arrays: host staging for ring/naive/mpi, NCCL where there are GPUs;
the uneven all-to-all-v (NCCL: grouped sends and receives) and host buffers on each group.

    mpiexec -n 2 python tests/scripts/comm_gpu_check.py ring,mpi,nccl

The device is always cuda (set_device("cuda") below; no environment variable).

Run by tests/test_comm_gpu.py (marked gpu). Not run on the development machine (no GPU).
"""
import sys

import cupy as cp
import numpy as np

from minidist import comm
from minidist.backend import set_device
from minidist.comm import trace

set_device("cuda")
for algo in sys.argv[1].split(","):
    g = comm.init(algo)
    g.name = f"gpu-{algo}"
    r, N = g.rank, g.size
    for n in (1, N + 1, 1001, 65537):
        buf = cp.full(n, r + 1, dtype=cp.float32)
        g.all_reduce(buf)
        assert cp.allclose(buf, N * (N + 1) / 2), (algo, n)
        buf = cp.full(n, r + 1, dtype=cp.float64)
        g.all_reduce(buf, op="avg", async_op=True).wait()
        assert cp.allclose(buf, (N + 1) / 2), (algo, n, "async avg")
        lo, hi = g.chunk(n)
        out = cp.empty(hi - lo, dtype=cp.float32)
        g.reduce_scatter(out, cp.arange(n, dtype=cp.float32) * (r + 1))
        assert cp.allclose(out, cp.arange(lo, hi) * N * (N + 1) / 2), (algo, n, "rs")
        full = cp.zeros(n, dtype=cp.float32)
        g.all_gather(full, cp.arange(lo, hi, dtype=cp.float32))
        assert cp.array_equal(full, cp.arange(n, dtype=cp.float32)), (algo, n, "ag")
        bc = cp.full(n, r, dtype=cp.float32)
        g.broadcast(bc, root=N - 1)
        assert (bc == N - 1).all(), (algo, n, "bcast")
    # all-to-all-v, uneven: rank r sends r + j + 1 values 100 r + j to rank j (nccl: one
    # group of sends and receives), one count zero when N > 2
    send = [0 if (r, j) == (0, N - 1) and N > 2 else r + j + 1 for j in range(N)]
    recv = [0 if (i, r) == (0, N - 1) and N > 2 else i + r + 1 for i in range(N)]
    inp = cp.concatenate([cp.full(c, 100 * r + j, dtype=cp.float32) for j, c in enumerate(send)])
    out = cp.empty(sum(recv), dtype=cp.float32)
    g.all_to_all_v(out, inp, send, recv)
    want = [cp.full(c, 100 * i + r, dtype=cp.float32) for i, c in enumerate(recv)]
    assert cp.array_equal(out, cp.concatenate(want)), (algo, "all_to_all_v")
    # host buffers on the same group (nccl: the MPI library's, as MoE's expert ids go)
    h = np.full(3, r + 1.0)
    g.all_reduce(h)
    assert np.allclose(h, N * (N + 1) / 2), (algo, "host all_reduce")
    ids = np.empty((N, 2), np.uint8)
    g.all_gather(ids, np.full(2, r, np.uint8))
    assert (ids == np.arange(N, dtype=np.uint8)[:, None]).all(), (algo, "host all_gather")
    got = cp.empty(5)
    g.send(cp.full(5, float(r)), (r + 1) % N, async_op=True)
    g.recv(got, (r - 1) % N)
    assert (got == (r - 1) % N).all(), (algo, "p2p")
    assert trace.counters(g.name)["all_reduce"]["calls"] > 0
    if r == 0:
        print(f"comm_gpu_check OK: {algo} on {N} ranks, host buffers {np.__name__}")
