"""All-to-all, written by hand: every rank sends a different chunk to every rank. Expert
parallelism's dispatch (tokens to their experts' ranks) and combine (outputs back) are one each
(minidist/ep/exchange.py).

    inp on rank r:  [ for rank 0 | for rank 1 | ... | for rank N-1 ]    send_counts[j] elements
    out on rank r:  [ from rank 0 | from rank 1 | ... | from rank N-1 ] recv_counts[i] elements

recv_counts on rank r must equal the send_counts[r] of every sender (all_to_all_v: the counts
may differ per pair, e.g. how many tokens chose the experts of each rank; all_to_all: equal).

Pairwise exchange (the shifted schedule, any N): step 0 copies rank r's chunk for itself; at
step s = 1 .. N-1 rank r sends its chunk for r+s and receives the chunk from r-s, one
sendrecv, so every rank sends and receives exactly one chunk per step and no link waits on
another. Partners, 4 ranks (send to / receive from):

                rank 0   rank 1   rank 2   rank 3
      step 1    1 / 3    2 / 0    3 / 1    0 / 2
      step 2    2 / 2    3 / 3    0 / 0    1 / 1
      step 3    3 / 1    0 / 2    1 / 3    2 / 0

Each rank sends sum_{j != r} send_counts[j] elements: everything but its own chunk, (N-1)/N of
its buffer when the chunks are equal, the least any algorithm can send.

Naive, beside it: everything through rank 0 (as naive.py's collectives). Each other rank
sends its send_counts (N int64s) and its whole buffer to the root; the root cuts every
buffer into chunks and sends each rank the concatenation of the chunks addressed to it. The
root moves every byte of the job twice, the others wait: time grows with N.
The MPI library's own is MPI_Alltoallv (mpi.py's `mpi_all_to_all_v`), the reference in the
tests and in examples/bench_collectives.py. NCCL has no all-to-all call: nccl.py posts the same
pairwise chunks (`pairwise_chunks`) as grouped sends and receives, which NCCL runs together.

Tests: tests/test_alltoall.py, tests/scripts/alltoall_check.py (closed forms, uneven counts,
2-4 ranks, bytes = formula, against MPI_Alltoallv).
"""
import numpy as np

from minidist.backend import xp_of

ROOT = 0


def offsets(counts):
    """Start of each chunk in a buffer cut into chunks of `counts` elements."""
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def pairwise_step(rank, world, step):
    """(rank sent to, rank received from) at `step` (1 .. world-1) of the pairwise exchange."""
    return (rank + step) % world, (rank - step) % world


def pairwise_bytes(send_counts, rank, itemsize):
    """Bytes rank `rank` sends in the pairwise exchange: all of its chunks but its own."""
    return (int(np.sum(send_counts)) - int(send_counts[rank])) * itemsize


def pairwise_chunks(send_counts, recv_counts, rank, world):
    """[(step, dst, (lo, hi) of inp sent to dst, src, (lo, hi) of out received from src)] for
    steps 1 .. world-1 of the pairwise exchange (step 0, this rank's own chunk, is a copy):
    the ring's sendrecv per step, or NCCL's grouped sends and receives (nccl.py)."""
    so, ro = offsets(send_counts), offsets(recv_counts)
    return [(step, dst, (so[dst], so[dst + 1]), src, (ro[src], ro[src + 1]))
            for step, (dst, src) in ((s, pairwise_step(rank, world, s))
                                     for s in range(1, world))]


def own_chunk(out, inp, send_counts, recv_counts, rank):
    """Step 0: this rank's chunk for itself, copied."""
    so, ro = offsets(send_counts), offsets(recv_counts)
    out[ro[rank]:ro[rank + 1]] = inp[so[rank]:so[rank + 1]]


def pairwise_all_to_all_v(ch, out, inp, send_counts, recv_counts):
    """out = the chunks every rank addressed to this one, in rank order (module docstring)."""
    own_chunk(out, inp, send_counts, recv_counts, ch.rank)
    for step, dst, (s_lo, s_hi), src, (r_lo, r_hi) in pairwise_chunks(
            send_counts, recv_counts, ch.rank, ch.size):
        ch.sendrecv(inp[s_lo:s_hi], dst, out[r_lo:r_hi], src,
                    note=f"all-to-all step {step}: chunk for rank {dst} -> it, "
                         f"chunk from rank {src} <- it")


def naive_all_to_all_v(ch, out, inp, send_counts, recv_counts):
    """The same result, every chunk relayed by rank 0."""
    rank, world = ch.rank, ch.size
    xp = xp_of(inp)
    if rank != ROOT:
        ch.send(np.asarray(send_counts, dtype=np.int64), ROOT, note="my send counts -> root")
        ch.send(inp, ROOT, note="my whole buffer -> root")
        ch.recv(out, ROOT, note="my chunks, from every rank, <- root")
        return
    counts, bufs = [np.asarray(send_counts, dtype=np.int64)], [inp]
    for peer in range(1, world):
        c = np.empty(world, dtype=np.int64)
        ch.recv(c, peer, note=f"rank {peer}'s send counts")
        b = xp.empty(int(c.sum()), dtype=inp.dtype)
        ch.recv(b, peer, note=f"rank {peer}'s buffer")
        counts.append(c)
        bufs.append(b)
    starts = [offsets(c) for c in counts]
    for dst in range(world):      # what dst receives: chunk dst of every rank, in rank order
        parts = [bufs[s][starts[s][dst]:starts[s][dst + 1]] for s in range(world)]
        if dst == ROOT:
            out[...] = xp.concatenate(parts)
        else:
            ch.send(xp.concatenate(parts), dst, note=f"chunks for rank {dst} -> it")


def naive_bytes(send_counts, recv_counts_of, rank, itemsize, world):
    """Bytes rank `rank` sends in the naive all-to-all-v: a non-root rank its counts (int64)
    and its buffer; the root what every other rank receives (`recv_counts_of(d)`: rank d's
    recv_counts)."""
    if rank != ROOT:
        return 8 * world + int(np.sum(send_counts)) * itemsize
    return sum(int(np.sum(recv_counts_of(d))) for d in range(1, world)) * itemsize
