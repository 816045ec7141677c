"""A collective algorithm of your own (first-use walk 39: one could be written but not plugged
in): comm.register_algo puts a module of functions over a Channel beside ring, naive and mpi,
and groups, examples/own_collective.py and examples/bench_collectives.py --algos take it.

    mpiexec -n 3 python examples/own_collective.py
"""
import json
import sys
import types

import numpy as np
import pytest
from mpi4py import MPI

from minidist import comm
from minidist.comm import ProcessGroup


def test_register_algo_refuses_minidists_names_and_modules_without_a_collective():
    for name in ("ring", "naive", "mpi", "hier", "nccl"):   # a group builds hier and nccl
        with pytest.raises(ValueError, match=f"'{name}' is minidist's own; give another name"):
            comm.register_algo(name, types.SimpleNamespace(all_reduce=print))
    with pytest.raises(TypeError, match="has none of all_reduce, reduce_scatter"):
        comm.register_algo("empty", types.ModuleType("empty"))
    for name in ("", None, 3, "two words"):               # (walk 40: taken silently)
        with pytest.raises(ValueError, match="must be a word"):
            comm.register_algo(name, types.SimpleNamespace(all_reduce=print))
    with pytest.raises(ValueError, match=r"not 'mine' \(an algorithm of your own: "
                                         r"comm.register_algo\(name, module\) first\)"):
        ProcessGroup(MPI.COMM_SELF, "mine")


def test_a_registered_algorithm_runs_its_collective_and_refuses_the_ones_it_lacks():
    """One rank: the group calls the module's all_reduce with its Channel; a reduce_scatter,
    which the module lacks, is refused before any communication, naming the function."""
    sys.path.insert(0, "examples")
    try:
        import recursive_doubling
    finally:
        sys.path.remove("examples")
    comm.register_algo("recursive_doubling", recursive_doubling)
    comm.register_algo("recursive_doubling", recursive_doubling)     # the same again: fine
    assert comm.algos()[-1] == "recursive_doubling"
    with pytest.raises(ValueError, match="'recursive_doubling' is registered already"):
        comm.register_algo("recursive_doubling", types.SimpleNamespace(all_reduce=print))
    group = ProcessGroup(MPI.COMM_SELF, "recursive_doubling", name="own")
    buf = np.arange(5.0)
    group.all_reduce(buf, op="avg")
    group.broadcast(buf, root=0)
    np.testing.assert_array_equal(buf, np.arange(5.0))
    with pytest.raises(NotImplementedError, match="algo 'recursive_doubling' has no "
                                                  r"reduce_scatter\(ch, ...\)"):
        group.reduce_scatter(np.zeros(5), np.zeros(5))
    group.destroy()


@pytest.mark.mpi
def test_recursive_doubling_equals_the_ring_and_mpi_on_any_rank_count(mpi):
    """mpiexec -n 3 python examples/own_collective.py (3: the ranks past a power of two fold
    in and out): the registered algorithm's sums = the ring's and MPI's to 1e-12 relative,
    the same bits on every rank, its tree broadcast exact, each size timed."""
    out = mpi(3, "examples/own_collective.py", "--sizes", "1,7,1000", "--iters", "2",
              timeout=120)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["elements"] for r in rows] == [1, 7, 1000]
    for r in rows:
        assert r["ranks"] == 3 and r["same_on_every_rank"] and r["broadcast_exact"], r
        assert r["vs_ring"] <= 1e-12 and r["vs_mpi"] <= 1e-12, r
        assert min(r["recursive_doubling_us"], r["ring_us"], r["mpi_us"]) > 0, r
