"""The communication layer under CUDA-aware MPI, in one process with recording stand-ins for
MPI and CuPy: device buffers must be ready before MPI touches them (every MPI call, a recv
into a device buffer, an unstaged collective wait for the device), staging copies to the
host only the buffers MPI reads, and the stop flag on an NCCL group is a host all-reduce.
"""
import contextlib
import sys

import numpy as np
import pytest

from minidist import comm
from minidist.comm import trace


# ---- CUDA-aware MPI: device buffers must be ready before MPI touches them -----------------

class _RecordingComm:
    """Stands in for the communicator mpi.py calls: each call is logged with the arrays it
    was handed (nested lists of buffers and counts flattened), nothing is sent."""

    def __init__(self, log, size):
        self.log, self.size = log, size

    def Get_size(self):
        return self.size

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.log.append((name, _arrays_in(args)))


def _arrays_in(args):
    found = []
    for a in args:
        if isinstance(a, np.ndarray):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += _arrays_in(a)
    return found


def _mpi_calls(dtype):
    """(name, world size, fn(ch, comm, a)) for each of mpi.py's calls; a(n) makes a buffer."""
    from minidist.comm import mpi
    calls = [
        ("all_reduce", 2, lambda ch, comm, a: mpi.mpi_all_reduce(ch, a(6), "avg")),
        ("reduce_scatter", 2, lambda ch, comm, a: mpi.mpi_reduce_scatter(ch, a(3), a(6))),
        ("reduce_scatter uneven", 2,
         lambda ch, comm, a: mpi.mpi_reduce_scatter(ch, a(4), a(7))),
        ("reduce_scatter aliased", 2,
         lambda ch, comm, a: (lambda buf: mpi.mpi_reduce_scatter(ch, buf[:3], buf))(a(6))),
        ("all_gather", 2, lambda ch, comm, a: mpi.mpi_all_gather(ch, a(6), a(3))),
        ("all_gather uneven", 3, lambda ch, comm, a: mpi.mpi_all_gather(ch, a(7), a(3))),
        ("all_gather in place", 2,
         lambda ch, comm, a: (lambda out: mpi.mpi_all_gather(ch, out, out[:3]))(a(6))),
        ("broadcast", 2, lambda ch, comm, a: mpi.mpi_broadcast(ch, a(5), 1)),
        ("all_to_all_v", 2,
         lambda ch, comm, a: mpi.mpi_all_to_all_v(ch, a(5), a(4), [1, 3], [2, 3])),
        ("start_all_gather", 2, lambda ch, comm, a: mpi.start_all_gather(comm, a(6), a(3))),
        ("start_broadcast", 2, lambda ch, comm, a: mpi.start_broadcast(comm, a(5))),
    ]
    if dtype != "bfloat16":                  # MPI's non-blocking reductions refuse bfloat16
        calls += [
            ("start_all_reduce", 2, lambda ch, comm, a: mpi.start_all_reduce(comm, a(6))),
            ("start_reduce_scatter", 2,
             lambda ch, comm, a: mpi.start_reduce_scatter(comm, a(3), a(6))),
        ]
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_mpi_call_waits_for_the_device_before_mpi_touches_its_buffers(monkeypatch,
                                                                           dtype):
    """A CUDA-aware MPI is handed cupy arrays themselves and reads them at once, while the
    kernels that write them (the caller's, or mpi.py's own float32 copies of bfloat16) may
    still be queued: mpi4py's CuPy demo synchronizes before every MPI call. mpi.py called
    MPI with no device_ready. Here (numpy buffers, device_ready recorded in place of the
    stream sync) every array an MPI call is handed must share memory with one readied
    before that call, after the array was made: the bfloat16 reductions' float32 copies
    and the aliased reduce-scatter's copy are new arrays, readied only if after their
    making."""
    from types import SimpleNamespace
    from minidist.comm import mpi
    calls = _mpi_calls(dtype)
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    log = []
    monkeypatch.setattr(mpi, "device_ready", lambda *arrays: log.append(("ready", arrays)),
                        raising=False)    # an mpi.py without it fails the asserts
    for name, size, call in calls:
        log.clear()
        comm = _RecordingComm(log, size)
        ch = SimpleNamespace(comm=comm, rank=0, size=size, count_nominal=lambda n: None,
                             scratch=lambda slot, n, like: np.empty(n, like.dtype))
        call(ch, comm, lambda n: np.arange(n).astype(dtype))
        ready, mpi_calls = [], 0
        for what, arrays in log:
            if what == "ready":
                ready += [a for a in arrays if isinstance(a, np.ndarray)]
                continue
            mpi_calls += 1
            for a in arrays:
                assert any(np.shares_memory(a, r) for r in ready), \
                    f"{name} ({np.dtype(dtype)}): {what} got a buffer not readied before it"
        assert mpi_calls == 1, (name, log)


class _FakeCupyArray(np.ndarray):
    """A numpy array that the patched is_cupy takes for a cupy one (_fake_is_cupy)."""

    def set(self, host):
        """cupy.ndarray.set: copy a host array in (staging's write_back)."""
        self[...] = host


def _fake_is_cupy(a):
    return isinstance(a, _FakeCupyArray)


class _LoggedComm:
    """An mpi4py communicator whose calls are logged (name, first argument) and then made."""

    def __init__(self, comm, log):
        self.comm, self.log = comm, log

    def __getattr__(self, name):
        real = getattr(self.comm, name)

        def call(*args, **kwargs):
            self.log.append((name, args[0] if args else None))
            return real(*args, **kwargs)
        return call


@pytest.mark.cpu_only("stands a numpy subclass in for a cupy array")
def test_recv_into_a_device_buffer_waits_for_the_device_before_posting_irecv(monkeypatch):
    """With a CUDA-aware MPI, recv hands the device buffer to MPI_Irecv itself, and MPI may
    write it while queued kernels still read it: ring attention posts the recv of the next
    block into the buffer the previous step's kernels read as `cur`. send waited
    (device_ready) and recv did not. Here (one rank, a message to itself) device_ready on
    the buffer must come before the Irecv that is handed that buffer itself."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup, group as group_module, staging
    log = []
    monkeypatch.setattr(staging, "cuda_aware_mpi", lambda: True)
    monkeypatch.setattr(staging, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(group_module, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(group_module, "device_ready",
                        lambda *arrays: log.append(("ready", arrays)))
    g = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank recv")
    p2p = g._p2p
    buf = np.zeros(5, np.float32).view(_FakeCupyArray)
    try:
        g._p2p = _LoggedComm(p2p, log)
        work = g.send(np.arange(5, dtype=np.float32), 0, async_op=True)
        g.recv(buf, 0)
        work.wait()
    finally:
        g._p2p = p2p
        g.destroy()
        trace.reset_counters()  # its 20 bytes showed in a later run's comm_bytes (test_train)
    assert np.array_equal(buf, np.arange(5)), buf
    irecv = [name for name, _ in log].index("Irecv")
    handed = log[irecv][1]
    assert _fake_is_cupy(handed) and np.shares_memory(handed, buf)     # not staged: buf itself
    assert any(name == "ready" and any(np.shares_memory(a, buf) for a in arrays)
               for name, arrays in log[:irecv]), log


@pytest.mark.cpu_only("stands a numpy subclass in for a cupy array")
def test_staging_copies_to_the_host_only_the_buffers_mpi_reads(monkeypatch):
    """MPI without CUDA support (the PyPI wheels) gets host copies of device buffers, made
    with cupy's get(), which also waits for every kernel queued on the stream. Buffers that
    MPI only writes were copied too: a recv's (ring attention and the pipeline post theirs
    before the compute they mean to overlap: the CPU stalled until the GPU was idle) and the
    out of reduce-scatter, all-gather and all-to-all (ZeRO-3 moved each gathered unit
    device -> host for nothing). Here (one rank, to_host logged) only what MPI reads is copied,
    every result is right, and every out is copied back to its device array."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup, group as group_module, staging
    copied, ready = [], []
    monkeypatch.setattr(staging, "cuda_aware_mpi", lambda: False)
    monkeypatch.setattr(staging, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(group_module, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(staging, "to_host", lambda a: copied.append(a) or np.array(a))
    monkeypatch.setattr(staging, "device_ready", lambda *arrays: ready.extend(arrays))
    monkeypatch.setattr(group_module, "device_of", lambda *arrays: contextlib.nullcontext())
    monkeypatch.setattr(group_module, "device_ready", lambda *arrays: None)   # send's

    def device(values):
        return np.asarray(values, np.float32).view(_FakeCupyArray)

    def was_copied(a):
        return any(np.shares_memory(a, c) for c in copied)
    g = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank staging")
    try:
        for op in ("reduce_scatter", "all_gather", "all_to_all"):
            out, inp = device(np.full(6, np.nan)), device(np.arange(6))
            getattr(g, op)(out, inp)
            assert np.array_equal(out, np.arange(6)), (op, out)
            assert was_copied(inp) and not was_copied(out), op       # out only written
            assert any(np.shares_memory(a, out) for a in ready), op  # set, then waited for
            copied.clear()
        for op in ("all_reduce", "broadcast"):                         # these read their buf
            buf = device(np.arange(6))
            getattr(g, op)(buf)
            assert np.array_equal(buf, np.arange(6)) and was_copied(buf), op
            copied.clear()
        work, buf = g.send(device(np.arange(5)), 0, async_op=True), device(np.full(5, np.nan))
        g.recv(buf, 0)
        work.wait()
        assert np.array_equal(buf, np.arange(5)) and len(copied) == 1, copied   # the send's
        assert not was_copied(buf)
    finally:
        g.destroy()
        trace.reset_counters()


@pytest.mark.cpu_only("stands a numpy subclass in for a cupy array")
def test_an_unstaged_device_collective_waits_for_its_last_kernels(monkeypatch):
    """With a CUDA-aware MPI the ring works on the device arrays themselves, and its last
    step (the final adds of a reduce-scatter, an average's division) runs as kernels on the
    stream of the thread running the collective: an async one's worker thread. Its Work
    completed with those kernels queued; the caller's next kernels were ordered after them
    only because CuPy's default stream is shared by every thread, which per-thread default
    streams or bench_step's graph stream undo. Here every op waits for its out (device_ready
    on it) before it returns, blocking or async."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup, group as group_module, staging
    ready = []
    monkeypatch.setattr(staging, "cuda_aware_mpi", lambda: True)
    monkeypatch.setattr(staging, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(group_module, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(staging, "device_ready", lambda *arrays: ready.extend(arrays))
    monkeypatch.setattr(group_module, "device_of", lambda *arrays: contextlib.nullcontext())
    monkeypatch.setattr(group_module, "ready_event", lambda *arrays: None)
    g = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank unstaged")
    try:
        for async_op in (False, True):
            for op in ("reduce_scatter", "all_gather", "all_to_all", "all_reduce"):
                out = np.zeros(4, np.float32).view(_FakeCupyArray)
                args = (out,) if op == "all_reduce" else \
                    (out, np.arange(4, dtype=np.float32).view(_FakeCupyArray))
                work = getattr(g, op)(*args, async_op=async_op)
                if async_op:
                    work.wait()
                assert any(np.shares_memory(a, out) for a in ready), (op, async_op)
                ready.clear()
    finally:
        g.destroy()
        trace.reset_counters()


def test_the_stop_flag_on_an_nccl_group_is_a_host_all_reduce_and_no_device_read(monkeypatch):
    """strategy.base.any_rank_of, the loop's stop/diverged agreement every step, put the flag
    on the device on an NCCL group and read it back (a host_read: the CPU waited for the
    whole step) though a group hands a host buffer to the MPI library on NCCL groups too.
    Here a one-rank "nccl" group (its NCCL module a fake that refuses every call: there is no
    GPU) agrees on the flag through MPI with no host_read."""
    import types
    from mpi4py import MPI
    import minidist.comm
    from minidist import backend
    from minidist.comm import ProcessGroup
    from minidist.strategy.base import any_rank_of

    def no_nccl(*args, **kwargs):
        raise AssertionError("a host buffer reached NCCL")
    fake = types.ModuleType("minidist.comm.nccl")
    fake.NcclComm = lambda comm: None
    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all_v"):
        setattr(fake, name, no_nccl)
    monkeypatch.setitem(sys.modules, "minidist.comm.nccl", fake)
    monkeypatch.delattr(minidist.comm, "nccl", raising=False)
    g = ProcessGroup(MPI.COMM_SELF, "nccl", name="one-rank nccl")
    try:
        before = backend.host_reads()
        assert (any_rank_of(g, True), any_rank_of(g, False)) == (True, False)
        assert backend.host_reads() == before
    finally:
        g.destroy()
        trace.reset_counters()
