"""Ring collectives, written by hand over point-to-point messages: the textbook picture.

All-reduce = reduce-scatter, then all-gather (Patarasuk & Yuan, 2009; what Horovod and NCCL
made famous). A length-n buffer is cut into `world` chunks (`chunk_bounds`). In every step each
rank sends one chunk to its right neighbour and receives one from its left, so every link of
the ring is busy at once and each rank sends (world-1)/world of the buffer per phase, however
many ranks there are: 2(N-1)/N x bytes for an all-reduce, the bandwidth-optimal amount.

Reduce-scatter: a partial sum travels around the ring picking up one rank's contribution per
hop. Chunk index each rank *sends* at each step, 4 ranks (rank r sends chunk r-step-1; the
receiver adds the arriving chunk into its own copy and sends that on at the next step):

                rank 0   rank 1   rank 2   rank 3
      step 0      3        0        1        2       (own data)
      step 1      2        3        0        1       (partial sums of 2 ranks)
      step 2      1        2        3        0       (partial sums of 3 ranks)
      after: rank r holds chunk r, reduced over all 4 ranks

All-gather: each finished chunk travels around the ring once more (rank r sends chunk r-step
and stores what arrives from the left):

                rank 0   rank 1   rank 2   rank 3
      step 0      0        1        2        3
      step 1      3        0        1        2
      step 2      2        3        0        1
      after: every rank holds every chunk

Broadcast is a pipelined chain: root -> root+1 -> ... -> root-1, the buffer cut into segments
so that all links carry a segment at once after the first world-2 steps (`chain_step`).

The step functions (`reduce_scatter_step`, `all_gather_step`, `chain_step`) are pure, so the
same schedule drives the single-process simulation in minidist/comm/simulate.py
(`python examples/ring_walkthrough.py`).

Tests: tests/test_comm.py (closed forms, uneven lengths, 2-4 ranks, bytes = theory).
"""
from mpi4py import MPI

from minidist.backend import is_cupy, xp_of
from minidist.comm.alltoall import pairwise_all_to_all_v

SEGMENT_BYTES = 1 << 20  # broadcast pipeline segment: small enough to pipeline, big to amortise

# op name -> the elementwise function that folds one contribution in ("avg" divides at the end)
REDUCE_UFUNC = {"sum": "add", "avg": "add", "max": "maximum", "min": "minimum"}


def chunk_bounds(n, size):
    """[(start, stop)] of the `size` chunks a length-`n` buffer is cut into; chunk r is rank r's.

    numpy.array_split's rule: the first n % size chunks have one element more, so lengths differ
    by at most one and no padding is needed (empty chunks when n < size). ZeRO pads its flat
    buffers to a multiple of the group size instead, which makes every chunk equal; both work.
    """
    base, extra = divmod(n, size)
    bounds, start = [], 0
    for r in range(size):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reduce_scatter_step(rank, world, step):
    """(chunk sent to the right, chunk received from the left) at `step` of reduce-scatter."""
    return (rank - step - 1) % world, (rank - step - 2) % world


def all_gather_step(rank, world, step):
    """(chunk sent to the right, chunk received from the left) at `step` of all-gather."""
    return (rank - step) % world, (rank - step - 1) % world


def chain_step(pos, world, step, nseg):
    """(segment sent right, segment received from the left) at `step` of a chain broadcast,
    for the rank at position `pos` after the root (None: nothing that way). Position p sends
    at step t the segment it received at step t-1; the root sends segment t."""
    send = step - pos if pos < world - 1 and 0 <= step - pos < nseg else None
    recv = step - pos + 1 if pos > 0 and 0 <= step - pos + 1 < nseg else None
    return send, recv


def ring_bytes(op, n, itemsize, rank, size, root=0):
    """Bytes rank `rank` sends in the ring algorithm for `op` on a length-`n` buffer.

    Reduce-scatter sends every chunk but its own, all-gather every chunk but its right
    neighbour's: with equal chunks that is (N-1)/N x bytes each, 2(N-1)/N x for all-reduce.
    """
    if size == 1:
        return 0
    lengths = [stop - start for start, stop in chunk_bounds(n, size)]
    rs, ag = n - lengths[rank], n - lengths[(rank + 1) % size]
    last = (rank - root) % size == size - 1  # the chain's last rank sends nothing
    elems = {"reduce_scatter": rs, "all_gather": ag, "all_reduce": rs + ag,
             "broadcast": 0 if last else n}[op]
    return elems * itemsize


def reduce_into(op, a, b, out):
    """out = a (op) b, elementwise, in a's array module (numpy or cupy)."""
    getattr(xp_of(a), REDUCE_UFUNC[op])(a, b, out=out)


def same_buffer(a, b):
    """True when a and b are the same memory (an in-place call), compared by address."""
    ptr = (lambda x: x.data.ptr) if is_cupy(a) else (lambda x: x.__array_interface__["data"][0])
    return type(a) is type(b) and a.size == b.size and ptr(a) == ptr(b)


# -------------------------------------------------------------------------------------------
# the collectives: `ch` is a Channel (minidist/comm/channel.py) for one call
# -------------------------------------------------------------------------------------------

def ring_reduce_scatter_in_place(ch, buf, op="sum"):
    """The textbook reduce-scatter, in place: afterwards chunk `rank` of buf is reduced over
    the group; the other chunks hold partial sums (all-reduce's all-gather overwrites them)."""
    rank, world = ch.rank, ch.size
    bounds = chunk_bounds(buf.size, world)
    right, left = (rank + 1) % world, (rank - 1) % world
    tmp = ch.scratch(1, bounds[0][1] - bounds[0][0], buf)   # the first chunk is the longest
    for step in range(world - 1):
        send_idx, recv_idx = reduce_scatter_step(rank, world, step)
        (s0, s1), (r0, r1) = bounds[send_idx], bounds[recv_idx]
        incoming = tmp[:r1 - r0]
        ch.sendrecv(buf[s0:s1], right, incoming, left, note=f"reduce-scatter step {step}: "
                    f"chunk {send_idx} -> rank {right}, chunk {recv_idx} <- rank {left}")
        reduce_into(op, buf[r0:r1], incoming, out=buf[r0:r1])   # fold in, pass on next step
    if op == "avg":
        lo, hi = bounds[rank]
        buf[lo:hi] /= world


def ring_reduce_scatter(ch, out, inp, op="sum"):
    """out = chunk `rank` of inp, reduced over the group; inp is left as it was.

    The same steps as `ring_reduce_scatter_in_place`, but the partial sums travel in two
    scratch buffers instead of inp: what arrives at step s, plus our own copy of that chunk,
    is what we send at step s+1. `out` may be inp's own chunk (ZeRO's in-place call)."""
    rank, world = ch.rank, ch.size
    bounds = chunk_bounds(inp.size, world)
    right, left = (rank + 1) % world, (rank - 1) % world
    width = bounds[0][1] - bounds[0][0]
    partial = [ch.scratch(0, width, inp), ch.scratch(1, width, inp)]   # ping, pong
    if world == 1:
        out[...] = inp
    for step in range(world - 1):
        send_idx, recv_idx = reduce_scatter_step(rank, world, step)
        (s0, s1), (r0, r1) = bounds[send_idx], bounds[recv_idx]
        send = inp[s0:s1] if step == 0 else partial[(step - 1) % 2][:s1 - s0]
        incoming = partial[step % 2][:r1 - r0]
        ch.sendrecv(send, right, incoming, left, note=f"reduce-scatter step {step}: "
                    f"chunk {send_idx} -> rank {right}, chunk {recv_idx} <- rank {left}")
        if step == world - 2:   # the last step brings chunk `rank`: finish it into out
            reduce_into(op, incoming, inp[r0:r1], out=out)
        else:
            reduce_into(op, incoming, inp[r0:r1], out=incoming)
    if op == "avg":
        out /= world


def ring_all_gather(ch, out, inp):
    """Every rank's `inp` (chunk r of out, by `chunk_bounds(out.size, world)`) into `out`."""
    rank, world = ch.rank, ch.size
    bounds = chunk_bounds(out.size, world)
    right, left = (rank + 1) % world, (rank - 1) % world
    lo, hi = bounds[rank]
    if not same_buffer(out[lo:hi], inp):
        out[lo:hi] = inp
    for step in range(world - 1):
        send_idx, recv_idx = all_gather_step(rank, world, step)
        (s0, s1), (r0, r1) = bounds[send_idx], bounds[recv_idx]
        ch.sendrecv(out[s0:s1], right, out[r0:r1], left, note=f"all-gather step {step}: "
                    f"chunk {send_idx} -> rank {right}, chunk {recv_idx} <- rank {left}")


def ring_all_reduce(ch, buf, op="sum"):
    """buf = buf reduced over the group, in place: reduce-scatter, then all-gather."""
    lo, hi = chunk_bounds(buf.size, ch.size)[ch.rank]
    ring_reduce_scatter_in_place(ch, buf, op)   # rank r ends up owning finished chunk r
    ring_all_gather(ch, buf, buf[lo:hi])        # ... and passes it around the ring


def chain_broadcast(ch, buf, root=0, segment_bytes=SEGMENT_BYTES):
    """buf = root's buf on every rank, passed down the chain root -> root+1 -> ... in segments."""
    rank, world = ch.rank, ch.size
    if world == 1:
        return
    pos = (rank - root) % world                              # place in the chain
    right = (rank + 1) % world if pos < world - 1 else MPI.PROC_NULL
    left = (rank - 1) % world if pos > 0 else MPI.PROC_NULL
    nseg = max(1, -(-buf.nbytes // segment_bytes))
    segs = chunk_bounds(buf.size, nseg)
    empty = buf[:0]
    for step in range(nseg + world - 2):
        send_idx, recv_idx = chain_step(pos, world, step, nseg)
        send = empty if send_idx is None else buf[segs[send_idx][0]:segs[send_idx][1]]
        recv = empty if recv_idx is None else buf[segs[recv_idx][0]:segs[recv_idx][1]]
        ch.sendrecv(send, MPI.PROC_NULL if send_idx is None else right,
                    recv, MPI.PROC_NULL if recv_idx is None else left,
                    note=f"chain step {step}: segment {send_idx} -> {right}, {recv_idx} <- {left}")


# the names ProcessGroup dispatches on, one per algorithm module
all_reduce = ring_all_reduce
reduce_scatter = ring_reduce_scatter
all_gather = ring_all_gather
broadcast = chain_broadcast
all_to_all_v = pairwise_all_to_all_v        # the pairwise exchange (alltoall.py)
