"""A collective algorithm of your own, as a module minidist can use: the recursive-doubling
all-reduce (Thakur, Rabenseifner & Gropp 2005, MPICH's choice for short messages).

log2(N) steps: at step k each rank swaps its whole buffer with the rank whose number differs
in bit k and adds what it got, so after the last step every rank holds the sum. It sends
log2(N) x n elements per rank where the ring sends 2(N-1)/N x n, but in log2(N) messages
instead of 2(N-1): it wins while a message's latency costs more than its bytes.
N not a power of two: the ranks past the largest power of two P first hand their buffers to
rank r - P, which adds them in, and get the result back at the end.

Like ring.py's functions it works over the group's Channel `ch` (minidist/comm/channel.py:
counted, traced sendrecv / send / recv, scratch buffers). Register it, then build groups:

    from minidist import comm
    import recursive_doubling
    comm.register_algo("recursive_doubling", recursive_doubling)
    world = comm.init("recursive_doubling")     # world.all_reduce(buf) runs all_reduce below

`broadcast` below is its companion, a binomial tree (log2 N rounds, each rank that has the
buffer sending it on), so that a strategy can run on the group: DDP broadcasts rank 0's
parameters at the start, then all-reduces its buckets.
examples/own_collective.py checks both against the ring and MPI's and times them;
examples/bench_collectives.py sweeps them: `--ops all_reduce,broadcast --algos
ring,mpi,examples/recursive_doubling.py`.
"""
from minidist.comm.ring import reduce_into


def all_reduce(ch, buf, op="sum"):
    """buf = buf reduced over the group (sum, avg, max, min), in place."""
    rank, size = ch.rank, ch.size
    p2 = 1 << (size.bit_length() - 1)                  # the largest power of two <= size
    extra = rank >= p2
    if extra:                                          # fold in: hand the buffer over, wait
        ch.send(buf, rank - p2, note="fold in")
        ch.recv(buf, rank - p2, note="fold out")
    else:
        got = ch.scratch(1, buf.size, buf)
        if rank + p2 < size:
            ch.recv(got, rank + p2, note="fold in")
            reduce_into(op, buf, got, out=buf)
        bit = 1
        while bit < p2:
            peer = rank ^ bit
            ch.sendrecv(buf, peer, got, peer, note=f"step {bit.bit_length()}: with {peer}")
            reduce_into(op, buf, got, out=buf)         # a + b = b + a: every rank alike
            bit <<= 1
        if op == "avg":
            buf /= size
        if rank + p2 < size:
            ch.send(buf, rank + p2, note="fold out")


def broadcast(ch, buf, root=0):
    """buf = root's buf on every rank: a binomial tree over the ranks counted from root."""
    me = (ch.rank - root) % ch.size                    # the rank's number, root at 0
    bit = 1
    while bit < ch.size:                               # the round in which `me` receives
        if me < 2 * bit:
            if me >= bit:
                ch.recv(buf, (me - bit + root) % ch.size, note=f"tree round {bit}")
            elif me + bit < ch.size:
                ch.send(buf, (me + bit + root) % ch.size, note=f"tree round {bit}")
        bit <<= 1
