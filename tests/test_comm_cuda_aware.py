"""The communication layer's decisions about device buffers, judged from plain values where
there is no GPU: device buffers must be ready before MPI touches them (every MPI call in
mpi.py; a send's and an unstaged recv's buffer, an unstaged collective's out: the plans of
staging.buffer_plan), staging copies to the host only the buffers MPI reads, and a host
buffer on an NCCL group (the loop's stop flag) goes to the MPI library (algos.algo_for_buffer).
The same decisions on real cupy arrays: tests/test_comm_gpu.py (marked gpu).
"""

import numpy as np
import pytest

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


# ---- staging.buffer_plan: which buffers are staged, where the device is waited for --------

COLLECTIVES = ("all_reduce", "broadcast", "reduce_scatter", "all_gather", "all_to_all")


def test_a_host_buffer_is_handed_to_mpi_itself_and_never_waits_for_a_device():
    """numpy buffers, CUDA-aware MPI or not: no copy, no device wait."""
    from minidist.comm.staging import Plan, buffer_plan
    for op in COLLECTIVES + ("send", "recv"):
        for aware in (False, True):
            for in_place in (False, True):
                assert buffer_plan(op, False, aware, in_place) == \
                    Plan("itself", False, False), (op, aware, in_place)


def test_under_cuda_aware_mpi_a_recv_waits_for_the_device_before_mpi_writes_its_buffer():
    """With a CUDA-aware MPI, recv hands the device buffer to MPI_Irecv itself, and MPI may
    write it while queued kernels still read it: ring attention posts the recv of the next
    block into the buffer the previous step's kernels read as `cur`. send waited
    (device_ready) and recv did not. Both now wait before MPI is handed the buffer itself."""
    from minidist.comm.staging import Plan, buffer_plan
    for op in ("send", "recv"):
        assert buffer_plan(op, True, True) == Plan("itself", True, False), op


def test_staging_copies_to_the_host_only_the_buffers_mpi_reads():
    """MPI without CUDA support (the PyPI wheels) gets host copies of device buffers, made
    with cupy's get(), which also waits for every kernel queued on the stream. Buffers that
    MPI only writes were copied too: a recv's (ring attention and the pipeline post theirs
    before the compute they mean to overlap: the CPU stalled until the GPU was idle) and the
    out of reduce-scatter, all-gather and all-to-all (ZeRO-3 moved each gathered unit
    device -> host for nothing). Now only what MPI reads is copied (an out that is also the
    input is read); every staged out is copied back and waited for; a send waits before."""
    from minidist.comm.staging import Plan, WRITE_ONLY, buffer_plan, placement
    assert set(WRITE_ONLY) == {"reduce_scatter", "all_gather", "all_to_all"}
    for op in WRITE_ONLY:
        assert buffer_plan(op, True, False) == Plan("host empty", False, True), op
        assert buffer_plan(op, True, False, in_place=True) == Plan("host copy", False, True)
    for op in ("all_reduce", "broadcast"):                      # these read their buf
        for in_place in (False, True):
            assert buffer_plan(op, True, False, in_place) == Plan("host copy", False, True)
    assert buffer_plan("recv", True, False) == Plan("host empty", False, True)
    assert buffer_plan("send", True, False) == Plan("host copy", True, False)
    assert placement(True, False, read=True) == "host copy"    # a collective's inputs


def test_an_unstaged_device_collective_waits_for_its_last_kernels():
    """With a CUDA-aware MPI the ring works on the device arrays themselves, and its last
    step (the final adds of a reduce-scatter, an average's division) runs as kernels on the
    stream of the thread running the collective: an async one's worker thread. Its Work
    completed with those kernels queued; the caller's next kernels were ordered after them
    only because CuPy's default stream is shared by every thread, which per-thread default
    streams or bench_step's graph stream undo. Now every collective's device out is waited
    for (device_ready on it) before it returns, blocking or async, staged or not."""
    from minidist.comm.staging import Plan, buffer_plan
    for op in COLLECTIVES:
        for in_place in (False, True):
            assert buffer_plan(op, True, True, in_place) == Plan("itself", False, True), op


def test_host_staging_of_host_buffers_hands_the_arrays_themselves_and_keeps_results():
    """The real host_staging on numpy buffers (what runs on the CPU): the arrays themselves,
    an array passed twice handed once, and what the collective writes is kept."""
    from minidist.comm.staging import host_staging
    out, inp = np.zeros(4), np.arange(4.0)
    with host_staging("all_gather", out, inp) as (h_out, h_inp):
        assert h_out is out and h_inp is inp
        h_out[...] = h_inp
    assert np.array_equal(out, inp)
    with host_staging("all_reduce", out, out) as (h_out, h_inp):
        assert h_out is out and h_inp is out


# ---- algos.algo_for_buffer: host buffers on an NCCL group go through MPI ------------------

def test_the_stop_flag_on_an_nccl_group_is_a_host_all_reduce_and_no_device_read():
    """strategy.base.any_rank_of, the loop's stop/diverged agreement every step, put the flag
    on the device on an NCCL group and read it back (a host_read: the CPU waited for the
    whole step) though a group hands a host buffer to the MPI library on NCCL groups too.
    Now the flag is a host buffer, agreed with no host_read (a real one-rank group: a ring
    one, since an nccl group needs GPUs), and algo_for_buffer, which a group's dispatch
    consults, gives a host buffer on an "nccl" group the MPI library's algorithm, device
    buffers NCCL's own. That an nccl group follows it is shown on GPUs only
    (tests/scripts/comm_gpu_check.py's host buffers on an nccl group)."""
    from mpi4py import MPI
    from minidist import backend
    from minidist.comm import ProcessGroup
    from minidist.comm.algos import algo_for_buffer
    from minidist.strategy.base import any_rank_of
    assert algo_for_buffer("nccl", on_device=False) == "mpi"
    assert algo_for_buffer("nccl", on_device=True) == "nccl"
    for algo in ("ring", "naive", "mpi", "hier"):
        assert algo_for_buffer(algo, False) == algo_for_buffer(algo, True) == algo
    g = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank flag")
    try:
        before = backend.host_reads()
        assert (any_rank_of(g, True), any_rank_of(g, False)) == (True, False)
        assert backend.host_reads() == before
    finally:
        g.destroy()
        trace.reset_counters()
