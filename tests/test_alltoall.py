"""The hand-written all-to-all (minidist/comm/alltoall.py): the pairwise schedule's table, and
under mpiexec on 2, 3 and 4 ranks closed forms, uneven counts, MPI_Alltoallv and the bytes,
and expert parallelism's AllToAll Function's distributed gradient check."""
import re

import pytest

import numpy as np

from minidist.comm.alltoall import own_chunk, pairwise_bytes, pairwise_chunks, pairwise_step
from minidist.comm.simulate import simulate_all_to_all


def test_pairwise_schedule_meets_every_pair_once():
    for world in (2, 3, 4, 5):
        for rank in range(world):
            partners = [pairwise_step(rank, world, s)[0] for s in range(1, world)]
            assert sorted(partners) == sorted(set(range(world)) - {rank})
        for s in range(1, world):        # what r sends at step s is what its partner receives
            for rank in range(world):
                dst, _ = pairwise_step(rank, world, s)
                assert pairwise_step(dst, world, s)[1] == rank


def test_simulated_pairwise_all_to_all_delivers_every_chunk():
    # rank i sends rank j (i + 2j) % 3 elements of value 10 i + j (some chunks empty)
    world = 4
    counts = [[(i + 2 * j) % 3 for j in range(world)] for i in range(world)]
    inputs = [np.concatenate([np.full(counts[i][j], 10 * i + j) for j in range(world)])
              for i in range(world)]
    lines = []
    out = simulate_all_to_all(inputs, counts, show=lines.append)
    for j in range(world):
        want = np.concatenate([np.full(counts[i][j], 10 * i + j) for i in range(world)])
        assert (out[j] == want).all()
    assert len(lines) == world - 1 and lines[0].startswith("  step 1: 0->1")


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_pairwise_chunks_posted_as_one_group_deliver_every_chunk(world):
    """NCCL's all-to-all (nccl.py, not runnable here) posts every rank's pairwise_chunks as one
    group: all sends, then all receives, matched by (sender, receiver). Played out on numpy
    ranks with uneven counts, zeros among them: every send meets a receive of its length and
    each rank's out is what it was addressed, in rank order."""
    counts = [[(3 * i + j) % 4 for j in range(world)] for i in range(world)]   # i -> j
    inputs = [np.concatenate([np.full(counts[i][j], 10 * i + j) for j in range(world)])
              for i in range(world)]
    posted = {}                                    # (sender, receiver) -> the chunk
    for r in range(world):
        send = counts[r]
        recv = [counts[i][r] for i in range(world)]
        for _, dst, (lo, hi), _, _ in pairwise_chunks(send, recv, r, world):
            posted[(r, dst)] = inputs[r][lo:hi]
    for r in range(world):
        send, recv = counts[r], [counts[i][r] for i in range(world)]
        out = np.full(sum(recv), -1)
        own_chunk(out, inputs[r], send, recv, r)
        for _, _, _, src, (lo, hi) in pairwise_chunks(send, recv, r, world):
            chunk = posted.pop((src, r))
            assert hi - lo == chunk.size
            out[lo:hi] = chunk
        want = np.concatenate([np.full(counts[i][r], 10 * i + r) for i in range(world)])
        np.testing.assert_array_equal(out, want)
    assert not posted                              # every send was received


def test_pairwise_bytes_is_all_but_own_chunk():
    assert pairwise_bytes([3, 0, 5], rank=2, itemsize=8) == 24
    assert pairwise_bytes([2, 2, 2, 2], rank=1, itemsize=4) == 3 * 2 * 4   # (N-1)/N of it


@pytest.mark.mpi
@pytest.mark.cpu_only("the check's buffers are numpy")
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_all_to_all(nprocs, mpi):
    """The exchange on every algorithm; and expert parallelism's AllToAll Function's backward
    against float64 central differences across the ranks, uneven counts (shards of different
    sizes on 2 and 4 ranks, rows kept home, empty chunks), on every algorithm.
    By hand: mpiexec -n 3 python tests/scripts/alltoall_check.py"""
    out = mpi(nprocs, "tests/scripts/alltoall_check.py", timeout=120)
    assert f"alltoall_check OK: {nprocs} ranks" in out.stdout
    checked = re.findall(r"AllToAll gradcheck OK \((\w+)\): elements per rank \[([\d, ]+)\]",
                         out.stdout)
    assert [algo for algo, _ in checked] == ["ring", "naive", "mpi"], out.stdout
    sizes = [int(n) for n in checked[0][1].split(",")]
    assert len(sizes) == nprocs and min(sizes) > 0 and (nprocs == 3 or len(set(sizes)) > 1)
