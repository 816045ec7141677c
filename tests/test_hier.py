"""The hierarchical all-reduce (minidist/comm/hier.py): exact with ranks grouped into simulated
nodes; the grouping rule; --comm hier in training equals one process."""
import json

import pytest

from minidist.comm.hier import hier_bytes, members_nodes, node_grouping, ranks_per_node
from minidist.comm.debug import LaunchMismatch
from tests.mpirun import mpi_env, within


def test_node_grouping_and_ranks_per_node():
    assert node_grouping([0, 1, 2, 3], 2) == ([(0, 0), (0, 1), (1, 0), (1, 1)], True)
    assert node_grouping([0, 1, 2], 2)[1] is False
    assert ranks_per_node({"MINIDIST_RANKS_PER_NODE": "2"}) == 2
    assert ranks_per_node({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"}) == 4
    assert ranks_per_node({}) == 1
    with pytest.raises(ValueError, match="MINIDIST_RANKS_PER_NODE"):
        ranks_per_node({"MINIDIST_RANKS_PER_NODE": "two"})


class _Gathered:
    """A communicator whose allgather answers with the members' (setting, host) pairs."""

    def __init__(self, members):
        self.members = members

    def allgather(self, mine):
        return self.members


def test_a_members_node_is_its_host_whatever_the_placement():
    """First-use walk 31: the node was world rank // the launcher's ranks per node, on each
    rank from its own environment. Under cyclic placement (srun -m cyclic) a tp group across
    two hosts was called "all its ranks on one node", and nodes of 4 and 2 ranks had the
    ranks disagree on the algorithm (they met in different collectives: a 600 s hang). The
    node is now the host each member reports; MINIDIST_RANKS_PER_NODE (the simulation) must be
    the same on every rank."""
    cyclic = _Gathered([("", "a"), ("", "b"), ("", "a"), ("", "b")])
    nodes = members_nodes(cyclic, environ={})
    assert nodes == [0, 1, 0, 1]
    assert node_grouping([0, 1, 2, 3], 4, nodes) == ([(0, 0), (1, 0), (0, 1), (1, 1)], True)
    uneven = members_nodes(_Gathered([("", "a")] * 4 + [("", "b")] * 2), environ={})
    assert node_grouping(range(6), 4, uneven)[1] is False       # the flat ring, everywhere
    simulated = _Gathered([("2", "a")] * 4)
    assert members_nodes(simulated, environ={"MINIDIST_RANKS_PER_NODE": "2"}) is None
    with pytest.raises(LaunchMismatch, match=r"the ranks disagree on MINIDIST_RANKS_PER_NODE "
                                             r"\('2', '4'\): give it the same value"):
        members_nodes(_Gathered([("2", "a"), ("4", "a")]), {"MINIDIST_RANKS_PER_NODE": "2"})


@pytest.mark.mpi
def test_ranks_told_different_node_sizes_stop_with_one_line(mpi, tmp_path):
    """    mpiexec -n 4 python tests/scripts/nodes_differ.py --comm hier
    (rank 0: MINIDIST_RANKS_PER_NODE=2, the others 4) split the job two ways and hung until
    the timeout; now one error line, exit 2, in seconds."""
    out = mpi(4, "tests/scripts/nodes_differ.py", "--comm", "hier", "--n-layer", "1",
              "--n-embd", "16", "--steps", "1", "--sample", "0", "--cache-dir",
              tmp_path / "c", timeout=120, check=False, env=mpi_env(MINIDIST_COMM_TIMEOUT=100))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.count("error: ") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "error: --comm hier: the ranks disagree on MINIDIST_RANKS_PER_NODE ('2', '4')" \
        in out.stderr


def test_hier_bytes_by_hand():
    """8 float32 on 2 nodes x 2: in the node 4 of the 8 elements go out in the reduce-scatter
    and 4 in the all-gather; across the nodes the 4-element chunk is all-reduced by 2 ranks,
    2 x 1/2 x 4 = 4 elements: 12 x 4 B = 48 B, as many as the flat ring over 4 (2 x 3/4 x 8
    elements: both are bandwidth-optimal), but only 16 B of it crosses nodes, where every
    step of the flat ring waits on an inter-node hop. 9 elements: chunks of 5 and 4."""
    assert hier_bytes(8, 4, 0, [0, 1, 2, 3], 2) == 48
    assert hier_bytes(8, 4, 0, [0, 1, 2, 3], 4) == 48       # one node: the flat ring
    # rank 0 (local 0, owns 5): RS sends chunk 1 (4), AR of 5 over 2 nodes sends 2 + 3
    # (chunk_bounds(5, 2) = 3, 2: sends the other's 2, then forwards 3), AG sends chunk 0 (5)
    assert hier_bytes(9, 1, 0, [0, 1, 2, 3], 2) == 4 + (2 + 3) + 5
    # 3 nodes x 2, 7 elements: the across-node ring's member is the node's place, not the
    # local index (its 4-element chunk over 3 nodes sends 5, 6 and 5 by place)
    assert [hier_bytes(7, 1, m, list(range(6)), 2) for m in range(6)] == [
        3 + 5 + 4, 4 + 4 + 3, 3 + 6 + 4, 4 + 4 + 3, 3 + 5 + 4, 4 + 4 + 3]


@pytest.mark.mpi
@pytest.mark.cpu_only("numpy buffers")
def test_hierarchical_all_reduce(mpi):
    """MINIDIST_RANKS_PER_NODE=2 mpiexec -n 4 python tests/scripts/hier_check.py"""
    out = mpi(4, "tests/scripts/hier_check.py", timeout=180,
              env=mpi_env(MINIDIST_RANKS_PER_NODE=2))
    assert "hier_check OK: 4 ranks, 2 per node" in out.stdout


@pytest.mark.mpi
def test_ddp_over_hier_equals_one_process(mpi):
    """DDP's bucket all-reduces through the hierarchical algorithm, 2 nodes x 2 ranks, float64:
    losses, norms and parameters equal to one process to 1e-10, bytes = 2(N-1)/N x grads.

        MINIDIST_RANKS_PER_NODE=2 mpiexec -n 4 python tests/scripts/ddp_check.py --algos hier
    """
    out = mpi(4, "tests/scripts/ddp_check.py", "--algos", "hier", "--modes", "overlapped",
              timeout=240, env=mpi_env(MINIDIST_RANKS_PER_NODE=2))
    rows = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert [r["algo"] for r in rows] == ["hier"]
    assert within(rows[0], 1e-10)


@pytest.mark.mpi
def test_train_gpt_says_how_hier_splits_before_step_one(mpi, tmp_path):
    """    MINIDIST_RANKS_PER_NODE=3 mpiexec -n 4 python examples/train_gpt.py --comm hier
    ran the flat ring (nodes of 3 and 1 ranks) and said so only in the end's summary; the
    set-up lines now say it before step 1."""
    out = mpi(4, "examples/train_gpt.py", "--comm", "hier", "--n-layer", "1", "--n-embd", "16",
              "--block-size", "8", "--batch-size", "4", "--steps", "1", "--eval-iters", "1",
              "--sample", "0", timeout=240, env=mpi_env(MINIDIST_RANKS_PER_NODE=3))
    said = out.stdout.split("step     1/1")[0]
    assert ("DDP over 4 ranks: hier, run as the flat ring: nodes holding different numbers of "
            "its ranks\n") in said, out.stdout


@pytest.mark.mpi
def test_zero_under_hier_says_its_collectives_run_the_flat_ring(mpi):
    """    MINIDIST_RANKS_PER_NODE=2 mpiexec -n 4 python examples/train_gpt.py --comm hier --zero 1
    said 'ZeRO stage 1 over 4 ranks (hier: 2 nodes x 2 ranks)', but hier splits all-reduces
    alone and ZeRO runs reduce-scatters and all-gathers: every byte went on the flat ring
    (first-use walk of 2026-11-30). Its lines now say so; DDP's still say the split."""
    out = mpi(4, "examples/train_gpt.py", "--comm", "hier", "--zero", "1", "--n-layer", "1",
              "--n-embd", "16", "--block-size", "8", "--batch-size", "4", "--steps", "1",
              "--eval-iters", "1", "--sample", "0", timeout=240,
              env=mpi_env(MINIDIST_RANKS_PER_NODE=2))
    said = ("(hier, run as the flat ring: hier splits all-reduces alone, not ZeRO's "
            "reduce-scatters and all-gathers; 2 nodes x 2 ranks)")
    assert f"ZeRO stage 1 over 4 ranks {said}" in out.stdout, out.stdout
    assert f"ZeRO-1 over 4 ranks {said}" in out.stdout, out.stdout
