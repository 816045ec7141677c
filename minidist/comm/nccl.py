"""NCCL collectives through cupy.cuda.nccl: one GPU per rank, one NCCL communicator per group.

NCCL needs every member to agree on a 128-byte unique id before its communicator exists: rank 0
of the group makes one (`get_unique_id`) and MPI broadcasts it, so MPI is only the bootstrap
and the data then moves GPU to GPU (NVLink, PCIe, InfiniBand) without touching the host.

NCCL calls are queued on a CUDA stream and return at once; each function here waits for its
stream before returning, so a ProcessGroup call (or its Work's wait()) means "done", as on the
other algorithms. NCCL wants equal chunks: uneven reduce_scatter / all_gather are padded to
ceil(n/size) elements per rank around the call (`_padded`), visibly.

send/recv on an "nccl" group go through MPI (staged through the host unless MPI is CUDA-aware):
NCCL point-to-point on one stream deadlocks unless every pair is grouped, which the simple
blocking-call API here cannot promise. All-to-all is such a grouped set (NCCL has no
all-to-all call): every chunk of the pairwise exchange (alltoall.py pairwise_chunks) posted as
ncclSend / ncclRecv between groupStart and groupEnd (NCCL >= 2.7), so NCCL runs them together
and no pair waits on another; this rank's own chunk is a copy. Host (numpy) buffers, which
NCCL cannot take (the MoE routing's expert ids, a few counts), are the MPI library's on an
"nccl" group: minidist/comm/group.py sends them to mpi.py.

Call `minidist.backend.set_device("cuda")` before creating an "nccl" group: each rank's NCCL
communicator binds to the GPU that is current then (local rank % GPUs on the node).
Imported only for algo="nccl" (importing minidist.comm never imports cupy). Written against
CuPy's documented API and checked against its source (cupy_backends/cuda/libs/nccl.pyx,
v13.6.0 and v14.2.0: the unique id is a tuple in 13, bytes in 14; MPI's pickling bcast hands
either over as it is); it has NOT been run on a GPU here (no GPU on the development machine).
Tests: tests/test_comm_gpu.py (marked gpu; run with `python -m pytest -m gpu --device cuda`).
"""
import socket

import cupy
from cupy.cuda import nccl

from minidist.comm.alltoall import own_chunk, pairwise_bytes, pairwise_chunks
from minidist.comm.ring import chunk_bounds, ring_bytes
from minidist.launcher import gpu_sharing_problem

if not nccl.available:     # CuPy's wheels carry no NCCL; without one, nccl has no names at all
    raise ImportError("algo='nccl' needs the NCCL library, which CuPy did not find (pip install "
                      "nvidia-nccl-cu12, -cu13 for cupy-cuda13x, or a system libnccl)")

# bfloat16: NCCL's own ncclBfloat16 (NCCL >= 2.10; NCCL_BFLOAT16 = 9 in cupy_backends/cuda/libs/
# nccl.pxd from v13.0.0 on), reduced by NCCL in bfloat16 arithmetic like its float16; only the
# device pointer is handed over, so no DLPack is involved
NCCL_DTYPES = {"bfloat16": nccl.NCCL_BFLOAT16,
               "float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32,
               "float64": nccl.NCCL_FLOAT64, "int32": nccl.NCCL_INT32,
               "int64": nccl.NCCL_INT64, "int8": nccl.NCCL_INT8, "uint8": nccl.NCCL_UINT8}
NCCL_OPS = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX,
            "min": nccl.NCCL_MIN}


class NcclComm:
    """The NCCL communicator of one group, bootstrapped over the group's MPI communicator."""

    def __init__(self, mpi_comm):
        here = (socket.gethostname(),
                cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.Device().id))
        shared = gpu_sharing_problem(mpi_comm.allgather(here), "algo='nccl'")
        if shared:                   # before NCCL's own error, a traceback on every rank
            raise ValueError(shared)
        uid = nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(mpi_comm.Get_size(), uid, mpi_comm.Get_rank())


def _args(buf):
    """(device pointer, NCCL dtype) of a cupy array."""
    if not isinstance(buf, cupy.ndarray):
        raise TypeError(f"algo='nccl' needs cupy arrays, got {type(buf).__name__}")
    return buf.data.ptr, NCCL_DTYPES[str(buf.dtype)]


def _stream():
    return cupy.cuda.get_current_stream()


def nccl_all_reduce(ch, buf, op="sum"):
    ptr, dtype = _args(buf)
    ch.nccl.comm.allReduce(ptr, ptr, buf.size, dtype, NCCL_OPS[op], _stream().ptr)
    if op == "avg":
        buf /= ch.size
    _stream().synchronize()
    ch.count_nominal(ring_bytes("all_reduce", buf.size, buf.itemsize, ch.rank, ch.size))


def _padded(n, size):
    """Equal chunk length c = ceil(n/size) and the uneven bounds it pads."""
    return -(-n // size), chunk_bounds(n, size)


def nccl_reduce_scatter(ch, out, inp, op="sum"):
    c, bounds = _padded(inp.size, ch.size)
    even = all(hi - lo == c for lo, hi in bounds)
    src, dst = inp, out
    if not even:  # pad: chunk r goes to [r*c, r*c + len_r) of a size*c buffer
        src = cupy.zeros(ch.size * c, dtype=inp.dtype)
        for r, (lo, hi) in enumerate(bounds):
            src[r * c:r * c + hi - lo] = inp[lo:hi]
        dst = cupy.empty(c, dtype=out.dtype)
    (sptr, dtype), (dptr, _) = _args(src), _args(dst)
    ch.nccl.comm.reduceScatter(sptr, dptr, c, dtype, NCCL_OPS[op], _stream().ptr)
    if not even:
        out[...] = dst[:out.size]
    if op == "avg":
        out /= ch.size
    _stream().synchronize()
    ch.count_nominal(ring_bytes("reduce_scatter", inp.size, inp.itemsize, ch.rank, ch.size))


def nccl_all_gather(ch, out, inp):
    c, bounds = _padded(out.size, ch.size)
    even = all(hi - lo == c for lo, hi in bounds)
    src, dst = inp, out
    if not even:  # pad our chunk to c, gather size*c, then cut the padding out again
        src = cupy.zeros(c, dtype=inp.dtype)
        src[:inp.size] = inp
        dst = cupy.empty(ch.size * c, dtype=out.dtype)
    (sptr, dtype), (dptr, _) = _args(src), _args(dst)
    ch.nccl.comm.allGather(sptr, dptr, c, dtype, _stream().ptr)
    if not even:
        for r, (lo, hi) in enumerate(bounds):
            out[lo:hi] = dst[r * c:r * c + hi - lo]
    _stream().synchronize()
    ch.count_nominal(ring_bytes("all_gather", out.size, out.itemsize, ch.rank, ch.size))


def nccl_broadcast(ch, buf, root=0):
    ptr, dtype = _args(buf)
    ch.nccl.comm.bcast(ptr, buf.size, dtype, root, _stream().ptr)
    _stream().synchronize()
    ch.count_nominal(ring_bytes("broadcast", buf.size, buf.itemsize, ch.rank, ch.size, root))


def nccl_all_to_all_v(ch, out, inp, send_counts, recv_counts):
    """The pairwise exchange's chunks as one group of NCCL sends and receives (module
    docstring); an empty chunk is not posted."""
    own_chunk(out, inp, send_counts, recv_counts, ch.rank)
    stream = _stream().ptr
    nccl.groupStart()
    try:
        for _, dst, (s_lo, s_hi), src, (r_lo, r_hi) in pairwise_chunks(
                send_counts, recv_counts, ch.rank, ch.size):
            if s_hi > s_lo:
                ptr, dtype = _args(inp[s_lo:s_hi])
                ch.nccl.comm.send(ptr, int(s_hi - s_lo), dtype, dst, stream)
            if r_hi > r_lo:
                ptr, dtype = _args(out[r_lo:r_hi])
                ch.nccl.comm.recv(ptr, int(r_hi - r_lo), dtype, src, stream)
    finally:
        nccl.groupEnd()
    _stream().synchronize()
    ch.count_nominal(pairwise_bytes(send_counts, ch.rank, inp.itemsize))


# the names ProcessGroup dispatches on, one per algorithm module
all_reduce = nccl_all_reduce
reduce_scatter = nccl_reduce_scatter
all_gather = nccl_all_gather
broadcast = nccl_broadcast
all_to_all_v = nccl_all_to_all_v
