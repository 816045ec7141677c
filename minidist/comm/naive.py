"""The naive collectives, beside the ring for comparison: everything goes through one root.

All-reduce = reduce to the root (it receives every rank's whole buffer, one after another, and
folds each in), then broadcast (it sends the result to every rank, one after another). Simple
and obviously correct, but the root sends and receives (N-1) x bytes while the others idle:
the time grows linearly with the number of ranks, where the ring's stays flat
(see examples/bench_collectives.py). Reduce-scatter and all-gather are built the same way:
reduce or gather at the root, then scatter or broadcast from it.

Tests: tests/test_comm.py (every op checked for the naive algorithm too).
"""
from minidist.comm.alltoall import naive_all_to_all_v
from minidist.comm.ring import chunk_bounds, reduce_into, same_buffer

ROOT = 0


def naive_reduce(ch, buf, op="sum", root=ROOT):
    """buf on `root` = buf reduced over the group (other ranks' buf is left as is)."""
    if ch.rank != root:
        ch.send(buf, root, note=f"my whole buffer -> root {root}")
        return
    tmp = ch.scratch(0, buf.size, buf)
    for peer in range(ch.size):
        if peer != root:
            ch.recv(tmp, peer, note=f"rank {peer}'s buffer")
            reduce_into(op, buf, tmp, out=buf)


def naive_broadcast(ch, buf, root=ROOT):
    """buf = root's buf on every rank: the root sends it to each rank in turn."""
    if ch.rank != root:
        ch.recv(buf, root, note=f"from root {root}")
        return
    for peer in range(ch.size):
        if peer != root:
            ch.send(buf, peer, note=f"whole buffer -> rank {peer}")


def naive_all_reduce(ch, buf, op="sum"):
    """Reduce to the root, then broadcast from it."""
    naive_reduce(ch, buf, op)
    if op == "avg" and ch.rank == ROOT:
        buf /= ch.size
    naive_broadcast(ch, buf)


def naive_reduce_scatter(ch, out, inp, op="sum"):
    """Reduce a copy of inp to the root, which sends each rank its chunk."""
    bounds = chunk_bounds(inp.size, ch.size)
    work = ch.scratch(1, inp.size, inp)
    work[...] = inp
    naive_reduce(ch, work, op)
    if ch.rank == ROOT:
        for peer, (lo, hi) in enumerate(bounds):
            if peer != ROOT:
                ch.send(work[lo:hi], peer, note=f"chunk {peer} -> rank {peer}")
        lo, hi = bounds[ROOT]
        out[...] = work[lo:hi]
    else:
        ch.recv(out, ROOT, note=f"chunk {ch.rank}")
    if op == "avg":
        out /= ch.size


def naive_all_gather(ch, out, inp):
    """Every rank sends its chunk to the root, which broadcasts the assembled buffer."""
    bounds = chunk_bounds(out.size, ch.size)
    lo, hi = bounds[ch.rank]
    if not same_buffer(out[lo:hi], inp):
        out[lo:hi] = inp
    if ch.rank == ROOT:
        for peer, (plo, phi) in enumerate(bounds):
            if peer != ROOT:
                ch.recv(out[plo:phi], peer, note=f"chunk {peer}")
    else:
        ch.send(inp, ROOT, note=f"chunk {ch.rank} -> root")
    naive_broadcast(ch, out)


# the names ProcessGroup dispatches on, one per algorithm module
all_reduce = naive_all_reduce
reduce_scatter = naive_reduce_scatter
all_gather = naive_all_gather
broadcast = naive_broadcast
all_to_all_v = naive_all_to_all_v           # every chunk relayed by rank 0 (alltoall.py)
