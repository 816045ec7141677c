"""bfloat16 collectives and point-to-point on numpy (ml_dtypes) or cupy arrays: MPI sees the
uint16 views, the sums are right (ring: bfloat16 adds, one rounding per hop; mpi: float32).

    mpiexec -n 3 python tests/scripts/comm_bf16_check.py ring,naive,mpi
    MINIDIST_DEVICE=cuda mpiexec -n 2 python tests/scripts/comm_bf16_check.py ring,mpi

Run by tests/test_bfloat16.py.
"""
import os
import sys

import ml_dtypes
import numpy as np

from minidist.backend import get_xp, set_device, to_host
from minidist import comm

BF16 = ml_dtypes.bfloat16


def check(g, xp):
    r, N = g.rank, g.size
    for n in (1, N + 1, 1001):
        buf = xp.full(n, r + 1, dtype=BF16)                  # small integers: exact
        g.all_reduce(buf)
        assert (to_host(buf) == N * (N + 1) / 2).all(), ("sum", n)
        buf = xp.full(n, 2 * (r + 1), dtype=BF16)
        g.all_reduce(buf, op="avg")
        assert (to_host(buf) == N + 1).all(), ("avg", n)
        buf = xp.full(n, r, dtype=BF16)
        g.all_reduce(buf, op="max")
        assert (to_host(buf) == N - 1).all(), ("max", n)
        lo, hi = g.chunk(n)
        out = xp.empty(hi - lo, dtype=BF16)
        g.reduce_scatter(out, (xp.arange(n) % 7 * (r + 1)).astype(BF16))
        want = np.arange(lo, hi) % 7 * N * (N + 1) / 2
        assert (to_host(out).astype(np.float64) == want).all(), ("reduce_scatter", n)
        bits = np.random.default_rng(n).standard_normal(n).astype(BF16)   # every bit counts
        full = xp.zeros(n, dtype=BF16)
        g.all_gather(full, xp.asarray(bits[lo:hi]))
        assert (to_host(full).view(np.uint16) == bits.view(np.uint16)).all(), ("gather", n)
        bc = xp.asarray(bits) if r == N - 1 else xp.zeros(n, dtype=BF16)
        g.broadcast(bc, root=N - 1)
        assert (to_host(bc).view(np.uint16) == bits.view(np.uint16)).all(), ("bcast", n)
    # a sum that rounds: 1 + r/256 does not fit 8 bits of mantissa once added up
    buf = xp.full(257, 1 + r / 256, dtype=BF16)
    g.all_reduce(buf)
    exact = sum(float(np.asarray(1 + q / 256, dtype=BF16)) for q in range(N))
    assert np.allclose(to_host(buf).astype(np.float64), exact, rtol=2 ** -8 * N), "rounding"
    got = xp.zeros(5, dtype=BF16)
    g.send(xp.full(5, r + 0.5, dtype=BF16), (r + 1) % N, async_op=True)
    g.recv(got, (r - 1) % N)
    assert (to_host(got) == (r - 1) % N + 0.5).all(), "p2p"


def main():
    # the device the test asks for (MINIDIST_DEVICE: this script's own input, not minidist's)
    xp = get_xp() if set_device(os.environ.get("MINIDIST_DEVICE", "auto")) == "cuda" else np
    for algo in sys.argv[1].split(","):
        g = comm.init(algo)
        g.name = f"bf16-{algo}"
        check(g, xp)
        g.synchronize()
        if g.rank == 0:
            print(f"comm_bf16_check OK: {algo} on {g.size} ranks, {xp.__name__} arrays")


if __name__ == "__main__":
    main()
