"""The alpha-beta cost of the collectives minidist implements, on the links a group spans
(the step-time model, minidist/train/cost.py, prices its communication with these).

An alpha-beta model of the algorithms minidist implements (minidist/comm/ring.py),
a group of p ranks and a buffer of n bytes over a link of latency alpha and bandwidth B, and
gamma seconds per byte of local reduction:
    ring reduce-scatter, all-gather   (p-1) alpha + (p-1)/p n/B   (+ (p-1)/p n gamma: RS)
    ring all-reduce                   2(p-1) alpha + 2(p-1)/p n/B + (p-1)/p n gamma
    hierarchical all-reduce, k ranks per node, m nodes (minidist/comm/hier.py):
        ring reduce-scatter in the node, ring all-reduce of n/k bytes across the m nodes
        (the k local ranks each on its own NIC, at once), ring all-gather in the node
    send/recv                         alpha + n/B
    pairwise all-to-all (minidist/comm/alltoall.py), n bytes per rank cut into p equal chunks:
                                      (p-1) (alpha + n/(p B))   p-1 sendrecvs of one chunk each
A group's link comes from the mesh order (minidist/comm/mesh.py: tp fastest, then cp, dp,
pp): a group whose ranks all sit on one node uses the intra-node link, one that spans nodes
runs at the inter-node link's speed (every ring step waits for its slowest hop).
Tests: tests/test_plan_time.py.
"""
import collections
import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One hop: latency alpha (seconds per message) and bandwidth (bytes/s, one direction)."""
    alpha: float
    bw: float


def ring_time(op, nbytes, p, link, gamma=0.0):
    """Seconds of minidist's ring `op` ("all_reduce", "reduce_scatter", "all_gather") on an
    n-byte buffer over p ranks (the formulas in the docstring)."""
    if p == 1 or nbytes == 0:
        return 0.0
    phases = 2 if op == "all_reduce" else 1
    reduced = 0 if op == "all_gather" else (p - 1) / p * nbytes * gamma
    return phases * ((p - 1) * link.alpha + (p - 1) / p * nbytes / link.bw) + reduced


def hier_all_reduce_time(nbytes, k, m, intra, inter, gamma=0.0):
    """Reduce-scatter in the node (k ranks), all-reduce of a 1/k chunk across m nodes,
    all-gather in the node."""
    return (ring_time("reduce_scatter", nbytes, k, intra, gamma)
            + ring_time("all_reduce", nbytes / k, m, inter, gamma)
            + ring_time("all_gather", nbytes, k, intra))


def p2p_time(nbytes, link):
    """One send/recv of n bytes."""
    return link.alpha + nbytes / link.bw if nbytes else 0.0


def all_to_all_time(nbytes, p, link):
    """Seconds of the pairwise all-to-all of an n-byte buffer per rank over p ranks (equal
    chunks): p-1 steps, each one sendrecv of n/p bytes."""
    if p == 1 or nbytes == 0:
        return 0.0
    return (p - 1) * (link.alpha + nbytes / p / link.bw)


# where each axis sits in the mesh: global rank = tp + tp (cp + cp (dp + dp pp)).
# Expert parallelism (minidist/ep/) is carved out of dp: an "ep" group is ep neighbouring dp
# ranks (stride tp cp), an "edp" group the dp / ep replicas of one rank's experts (stride
# tp cp ep), times the cp ranks under cp (each runs the experts on its part of the sequence):
# dp rank = ep rank + ep x edp rank (minidist/ep/strategy.py).
AXES = ("tp", "cp", "dp", "pp")


def axis_stride(layout, axis):
    """Distance in global ranks between neighbours of `axis`'s group (mesh order; "ep" and
    "edp" inside dp; hybrid sharding's "shard" (K neighbouring ranks of ZeRO's dp x cp
    group, whose cp ranks are neighbours) and "replicas" (every K-th of them))."""
    if axis in ("ep", "edp"):
        return layout.tp * layout.cp * (layout.ep if axis == "edp" else 1)
    if axis in ("shard", "replicas"):      # within ZeRO's dp x cp group, cp fastest
        return layout.tp * (layout.zero_shard if axis == "replicas" else 1)
    stride = 1
    for a in AXES[:AXES.index(axis)]:
        stride *= getattr(layout, a)
    return stride


def axis_size(layout, axis):
    """Ranks in one `axis` group (edp: dp / ep x cp; shard: K; replicas: dp x cp / K)."""
    if axis == "shard":
        return layout.zero_shard
    if axis == "replicas":
        return layout.dp * layout.cp // layout.zero_shard
    return layout.dp // layout.ep * layout.cp if axis == "edp" else getattr(layout, axis)


def members(layout, axis, size):
    """Global ranks of the first `size` members of the `axis` group holding rank 0: every
    stride-th, or, for edp under cp, the cp ranks (stride tp) of each dp / ep replica."""
    if axis == "edp" and layout.cp > 1:
        cp, step = layout.cp, layout.tp * layout.cp * layout.ep
        return [layout.tp * (i % cp) + step * (i // cp) for i in range(size)]
    return [i * axis_stride(layout, axis) for i in range(size)]


@functools.lru_cache(maxsize=65536)
def span(layout, axis, gpus_per_node, size=None):
    """(ranks per node k, nodes m) of the `axis` group holding rank 0 (all are alike); k is 0
    when the nodes hold different numbers of its ranks. `size`: the group size (default: the
    axis's; "dpcp" groups are dp x cp ranks at cp's stride). Kept per argument: the search
    asks the same few millions of times (a 7e9 MoE of 32 experts on 64 GPUs: 2.6M calls, 28 s
    of its 115 under cProfile, counting with list.count)."""
    size = size or axis_size(layout, axis)
    counts = collections.Counter(r // gpus_per_node for r in members(layout, axis, size))
    k = next(iter(counts.values()))
    return (k if all(c == k for c in counts.values()) else 0), len(counts)


def collective_time(cluster, op, nbytes, layout, axis, algo="ring", size=None):
    """Seconds of `op` on the `axis` group of `layout`, on the links that group spans (a
    group across nodes at the inter-node link's speed: every step waits for its slowest hop)."""
    p = size or axis_size(layout, axis)
    k, m = span(layout, axis, cluster.gpus_per_node, p)
    if op == "all_to_all":
        return all_to_all_time(nbytes, p, cluster.intra if m == 1 else cluster.inter)
    if m == 1:
        return ring_time(op, nbytes, p, cluster.intra, cluster.gamma)
    if algo == "hier" and op == "all_reduce" and k > 1:
        return hier_all_reduce_time(nbytes, k, m, cluster.intra, cluster.inter, cluster.gamma)
    return ring_time(op, nbytes, p, cluster.inter, cluster.gamma)


def p2p_link(cluster, layout):
    """The link between neighbouring pipeline stages: the inter-node one as soon as the
    stages span nodes. The stages advance in step (every micro-batch crosses every
    boundary), so the slowest hop sets the pace: with tp 4, pp 4 on nodes of 8, stages 0-1
    sit on node 0 and 2-3 on node 1, and the 1 -> 2 hop crosses the network (first-use walk
    32: it was priced as intra-node)."""
    inside = axis_stride(layout, "pp") * layout.pp <= cluster.gpus_per_node
    return cluster.intra if inside else cluster.inter
