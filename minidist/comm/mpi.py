"""The MPI library's own collectives: the reference the hand-written ring is measured against.

Allreduce, Reduce_scatter(_block), Allgather(v) and Bcast, on the group's private
communicator. MPICH and Open MPI pick an algorithm per message size (recursive doubling for
small messages, reduce-scatter + all-gather for large ones), so this is both a cross-check for
the ring's numbers and the bar for its speed. Uneven chunks use the "v" variants with the
counts from `chunk_bounds`, so every algorithm cuts buffers the same way.

`start_all_reduce` & co. are MPI's non-blocking collectives (MPI_Iallreduce, ...). They are not
what `async_op=True` uses: MPICH moves their data only while some thread is inside an MPI call
(unless MPIR_CVAR_ASYNC_PROGRESS=1 starts a progress thread), so a request started before a
long numpy computation mostly waits until `Wait()`. ProcessGroup instead runs the blocking
collective on its communication thread (minidist/comm/stream.py), which keeps calling MPI.
examples/bench_collectives.py --overlap measures both. Each returns a `HeldRequest`: an
MPI.Request that also holds the arrays MPI reads and writes until `Wait()`, so a temporary
passed in (`start_reduce_scatter(comm, out, x * 2)`) lives that long (below, HeldRequest).

MPI's traffic cannot be observed from Python: the counters get the ring's byte count for the
same call, marked nominal.

bfloat16: MPI has no such type, so data moves as the uint16 view (`wire`), and the library's
reductions run on float32 copies, rounded to bfloat16 once at the end.

A CUDA-aware MPI is handed cupy arrays themselves (staging.py), and reads them at once: every
call here goes through `call_mpi`, which waits for the queued kernels that write the arrays
it hands MPI first (`device_ready`; the float32 copies are such kernels), as mpi4py's CuPy
demo does before each MPI call. A no-op on numpy.

Tests: tests/test_comm.py (ring and naive cross-checked against these), tests/test_bfloat16.py,
tests/test_comm_cuda_aware.py (call_mpi's order, and no MPI call here outside it).
"""
from mpi4py import MPI

from minidist.comm.ring import chunk_bounds, ring_bytes, same_buffer
from minidist.comm.staging import device_ready, is_bfloat16, wire

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def call_mpi(method, *args, ready=device_ready, **kwargs):
    """method(*args, **kwargs), an MPI call, once the device has written every array it is
    handed: `ready` on each array in args (arrays_in), then the call."""
    ready(*arrays_in(args))
    return method(*args, **kwargs)


def arrays_in(args):
    """The arrays among args, lists and tuples looked into (MPI's [buffer, (counts, displs)]);
    MPI.IN_PLACE and counts are not arrays."""
    found = []
    for a in args:
        if isinstance(a, (list, tuple)):
            found += arrays_in(a)
        elif hasattr(a, "__array_interface__") or hasattr(a, "__cuda_array_interface__"):
            found.append(a)
    return found


def _counts(n, size):
    """Chunk lengths and offsets, for the "v" collectives and Reduce_scatter."""
    bounds = chunk_bounds(n, size)
    return [hi - lo for lo, hi in bounds], [lo for lo, _ in bounds]


def mpi_all_reduce(ch, buf, op="sum"):
    if is_bfloat16(buf):                  # no MPI bfloat16 sum: reduce in float32
        tmp = buf.astype("float32")
        mpi_all_reduce(ch, tmp, op)
        buf[...] = tmp
        return
    call_mpi(ch.comm.Allreduce, MPI.IN_PLACE, buf, op=MPI_OPS[op])
    if op == "avg":
        buf /= ch.size
    ch.count_nominal(ring_bytes("all_reduce", buf.size, buf.itemsize, ch.rank, ch.size))


def mpi_reduce_scatter(ch, out, inp, op="sum"):
    if is_bfloat16(inp):                  # no MPI bfloat16 sum: reduce in float32
        tmp = out.astype("float32")
        mpi_reduce_scatter(ch, tmp, inp.astype("float32"), op)
        out[...] = tmp
        return
    counts, _ = _counts(inp.size, ch.size)
    lo = sum(counts[:ch.rank])
    if same_buffer(out, inp[lo:lo + out.size]):   # MPI forbids aliased send/receive buffers
        copy = ch.scratch(1, inp.size, inp)
        copy[...] = inp
        inp = copy
    if len(set(counts)) == 1:
        call_mpi(ch.comm.Reduce_scatter_block, inp, out, op=MPI_OPS[op])
    else:
        call_mpi(ch.comm.Reduce_scatter, inp, out, counts, op=MPI_OPS[op])
    if op == "avg":
        out /= ch.size
    ch.count_nominal(ring_bytes("reduce_scatter", inp.size, inp.itemsize, ch.rank, ch.size))


def mpi_all_gather(ch, out, inp):
    counts, displs = _counts(out.size, ch.size)
    lo = displs[ch.rank]
    send = MPI.IN_PLACE if same_buffer(out[lo:lo + inp.size], inp) else inp
    if len(set(counts)) == 1:
        call_mpi(ch.comm.Allgather, wire(send), wire(out))
    else:
        call_mpi(ch.comm.Allgatherv, wire(send), [wire(out), (counts, displs)])
    ch.count_nominal(ring_bytes("all_gather", out.size, out.itemsize, ch.rank, ch.size))


def mpi_broadcast(ch, buf, root=0):
    call_mpi(ch.comm.Bcast, wire(buf), root=root)
    ch.count_nominal(ring_bytes("broadcast", buf.size, buf.itemsize, ch.rank, ch.size, root))


def mpi_all_to_all_v(ch, out, inp, send_counts, recv_counts):
    """MPI_Alltoallv: the reference for the hand-written all-to-all (alltoall.py)."""
    from minidist.comm.alltoall import offsets, pairwise_bytes
    sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    so, ro = offsets(sc)[:-1].tolist(), offsets(rc)[:-1].tolist()
    call_mpi(ch.comm.Alltoallv, [wire(inp), (sc, so)], [wire(out), (rc, ro)])
    ch.count_nominal(pairwise_bytes(sc, ch.rank, inp.itemsize))


class HeldRequest(MPI.Request):
    """A non-blocking collective's request that keeps its arrays (`arrays`) alive until it is
    dropped. MPI reads and writes them until the request completes, and mpi4py 4.1's request
    holds no reference to Ireduce_scatter's send buffer or Iallreduce's in-place one: a
    temporary passed in was freed before Wait, and under Open MPI, which does the work in
    Wait, the result was whatever reused that memory (the mpich wheel finished these small
    ones at the start, so it never showed). Wait, Test and Request.Waitall take it as the
    request it copies."""


def held(request, *arrays):
    """`request` as a HeldRequest holding `arrays`."""
    request = HeldRequest(request)
    request.arrays = arrays
    return request


def start_all_reduce(comm, buf, op="sum"):
    """MPI_Iallreduce in place; returns the request (avg: divide after Wait yourself)."""
    _no_bfloat16_sum(buf)
    return held(call_mpi(comm.Iallreduce, MPI.IN_PLACE, buf, op=MPI_OPS[op]), buf)


def start_reduce_scatter(comm, out, inp, op="sum"):
    _no_bfloat16_sum(inp)
    return held(call_mpi(comm.Ireduce_scatter, inp, out,
                         _counts(inp.size, comm.Get_size())[0], op=MPI_OPS[op]), out, inp)


def start_all_gather(comm, out, inp):
    counts, displs = _counts(out.size, comm.Get_size())
    return held(call_mpi(comm.Iallgatherv, wire(inp), [wire(out), (counts, displs)]), out, inp)


def start_broadcast(comm, buf, root=0):
    return held(call_mpi(comm.Ibcast, wire(buf), root=root), buf)


def _no_bfloat16_sum(buf):
    if is_bfloat16(buf):
        raise TypeError("MPI has no bfloat16 reduction: use the blocking collective (it "
                        "reduces a float32 copy) or pass float32")


# the names ProcessGroup dispatches on, one per algorithm module
all_reduce = mpi_all_reduce
reduce_scatter = mpi_reduce_scatter
all_gather = mpi_all_gather
broadcast = mpi_broadcast
all_to_all_v = mpi_all_to_all_v
