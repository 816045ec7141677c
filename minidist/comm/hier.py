"""Hierarchical all-reduce: reduce-scatter inside each node, all-reduce across nodes, all-gather
inside each node (what NCCL's tree/"NVLS + IB" paths and Horovod's hierarchical mode do).

A flat ring that spans nodes waits, at every one of its 2(N-1) steps, for its slowest hop, the
inter-node link, and sends 2(N-1)/N x bytes over it. Split by node (k ranks on each of m
nodes), each rank instead sends only a 1/k chunk across nodes, and the k ranks of a node use
their k links (NICs) at once:

    4 ranks as 2 nodes x 2, buffer [A|B] (two chunks, one per local rank):
      1. ring reduce-scatter in the node       rank 0 and 2 own A (their node's sum),
                                               rank 1 and 3 own B
      2. ring all-reduce across nodes, of the  ranks 0, 2 (local rank 0): A summed over all;
         chunk each rank owns, among the ranks  ranks 1, 3 (local rank 1): B summed over all
         with the same local rank
      3. ring all-gather in the node           every rank holds [A|B], reduced over all 4

Bytes each rank sends: (k-1)/k n in the node twice, 2(m-1)/m n/k across (`hier_bytes`); the
step-time model is minidist/train/comm_cost.py's hier_all_reduce_time.

A rank's node is its host (each rank's host name, gathered when the group is made), so on a
cluster the grouping is the machines', whatever the launcher's placement (block or cyclic).
MINIDIST_RANKS_PER_NODE=k simulates nodes on one machine instead: world rank r is on node
r // k; the ranks must agree on it (a LaunchMismatch otherwise: each rank grouped the job
its own way, and the ranks met in different collectives until the timeout). A group whose
nodes hold different numbers of its ranks (or lies in one node, or one rank per node) runs
the flat ring. reduce-scatter, all-gather, broadcast and all-to-all are the ring's.

Every rank ends bitwise identical: each chunk is reduced once by the inter-node ring of its
owners, then copied. Tests: tests/test_hier.py (test_hierarchical_all_reduce:
tests/scripts/hier_check.py, 2 nodes x 2 ranks, odd lengths, against MPI's Allreduce; DDP).
"""
import os
import socket

from minidist.comm import alltoall, ring
from minidist.comm.channel import Channel
from minidist.comm.debug import LaunchMismatch
from minidist.comm.ring import chunk_bounds, ring_bytes
from minidist.launcher import local_rank_and_size

RANKS_PER_NODE_ENV = "MINIDIST_RANKS_PER_NODE"


def ranks_per_node(environ=os.environ):
    """MINIDIST_RANKS_PER_NODE, else the launcher's ranks on this node (1 without one):
    hier_bytes's and the simulation's."""
    value = environ.get(RANKS_PER_NODE_ENV, "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{RANKS_PER_NODE_ENV}={value!r}: give a positive integer")
        return int(value)
    return local_rank_and_size(environ)[1]


def node_grouping(world_ranks, per_node, nodes=None):
    """[(node, index in node)] for each member of a group given by its world ranks, and
    whether every node holds the same number of them. `nodes`: each member's node (its
    host) instead of world rank // per_node."""
    nodes = [r // per_node for r in world_ranks] if nodes is None else list(nodes)
    places = [(n, nodes[:i].count(n)) for i, n in enumerate(nodes)]
    counts = [nodes.count(n) for n in set(nodes)]
    return places, len(set(counts)) == 1


def hier_bytes(n, itemsize, member, world_ranks, per_node):
    """Bytes group member `member` sends in the hierarchical all-reduce of n elements."""
    places, uniform = node_grouping(world_ranks, per_node)
    node, local = places[member]
    k = sum(1 for p in places if p[0] == node)
    m = len({p[0] for p in places})
    if not uniform or k == 1 or m == 1:
        return ring_bytes("all_reduce", n, itemsize, member, len(world_ranks))
    lo, hi = chunk_bounds(n, k)[local]
    across = sorted({p[0] for p in places}).index(node)
    return (ring_bytes("reduce_scatter", n, itemsize, local, k)
            + ring_bytes("all_reduce", hi - lo, itemsize, across, m)
            + ring_bytes("all_gather", n, itemsize, local, k))


def members_nodes(comm, environ=os.environ):
    """Each member's node (collective over `comm`): None under MINIDIST_RANKS_PER_NODE (world
    rank // its value, the same on every rank, else LaunchMismatch), else its host's number
    (hosts numbered in the order of the members)."""
    simulated = environ.get(RANKS_PER_NODE_ENV, "")
    everyone = comm.allgather((simulated, socket.gethostname()))
    settings = sorted({s for s, _ in everyone})
    if len(settings) > 1:
        raise LaunchMismatch(
            f"--comm hier: the ranks disagree on {RANKS_PER_NODE_ENV} ("
            + ", ".join(repr(s) for s in settings) + "): give it the same value on every "
            "rank, or leave it out (each rank's node is then its host)")
    if simulated:
        return None
    numbers = {}
    return [numbers.setdefault(host, len(numbers)) for _, host in everyone]


class Hierarchy:
    """One group's node split: `intra` (this rank's node) and `inter` (the ranks with this
    local index on every node) communicators, made from the group's communicator `comm`
    (collective: every member constructs it, as it constructs the group)."""

    def __init__(self, comm, world_ranks, per_node, scratch):
        places, self.uniform = node_grouping(world_ranks, per_node,
                                             members_nodes(comm))
        me = comm.Get_rank()
        node, self.local = places[me]
        self.k = sum(1 for p in places if p[0] == node)
        self.m = len({p[0] for p in places})
        self.flat = not self.uniform or self.k == 1 or self.m == 1
        self.intra = comm.Split(node, me)
        self.inter = comm.Split(self.local, me)
        self._scratch = scratch

    def describe(self, ring_ops=None):
        """'hier: 2 nodes x 2 ranks', or why the group runs the flat ring (the logs say it:
        a run that set --comm hier and got the ring was told nothing). `ring_ops`: what a
        strategy that runs no all-reduce on the group runs instead (ZeRO's reduce-scatters
        and all-gathers, EP's all-to-alls): hier splits all-reduces alone, so those are the
        ring's on any nodes (a ZeRO-3 run said 'hier: 2 nodes x 2 ranks', every byte sent on
        the flat ring: first-use walk of 2026-11-30)."""
        if not self.flat and ring_ops:
            return (f"hier, run as the flat ring: hier splits all-reduces alone, not "
                    f"{ring_ops}; {self.m} nodes x {self.k} ranks")
        if not self.flat:
            return f"hier: {self.m} nodes x {self.k} ranks"
        why = ("all its ranks on one node" if self.m == 1 else "one rank per node"
               if self.uniform else "nodes holding different numbers of its ranks")
        return f"hier, run as the flat ring: {why}"

    def all_reduce(self, ch, buf, op="sum"):
        """buf = buf reduced over the group: in the node, across nodes, in the node."""
        if self.flat:
            return ring.ring_all_reduce(ch, buf, op)
        inner = "sum" if op == "avg" else op
        in_node = Channel(self.intra, ch.group, ch.op, self._scratch)
        across = Channel(self.inter, ch.group, ch.op, self._scratch)
        lo, hi = chunk_bounds(buf.size, self.k)[self.local]
        ring.ring_reduce_scatter_in_place(in_node, buf, inner)   # 1. chunk `local`: node sum
        ring.ring_all_reduce(across, buf[lo:hi], inner)           # 2. ... summed over nodes
        if op == "avg":
            buf[lo:hi] /= self.k * self.m
        ring.ring_all_gather(in_node, buf, buf[lo:hi])            # 3. every chunk everywhere

    def reduce_scatter(self, ch, out, inp, op="sum"):
        ring.ring_reduce_scatter(ch, out, inp, op)

    def all_gather(self, ch, out, inp):
        ring.ring_all_gather(ch, out, inp)

    def broadcast(self, ch, buf, root=0):
        ring.chain_broadcast(ch, buf, root)

    def all_to_all_v(self, ch, out, inp, send_counts, recv_counts):
        alltoall.pairwise_all_to_all_v(ch, out, inp, send_counts, recv_counts)

    def free(self):
        """Release the two communicators (ProcessGroup.destroy calls this)."""
        for c in (self.intra, self.inter):
            c.Free()
