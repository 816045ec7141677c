"""The communication layer's decisions about device buffers, judged from plain values where
there is no GPU: device buffers must be ready before MPI touches them (every MPI call in
mpi.py; a send's and an unstaged recv's buffer, an unstaged collective's out: the plans of
staging.buffer_plan), staging copies to the host only the buffers MPI reads, and a host
buffer on an NCCL group (the loop's stop flag) goes to the MPI library (algos.algo_for_buffer).
The code that carries the plans out (mpi.call_mpi, staging.post, write_back and
staged_collective) takes the device wait and the MPI call as arguments: here they are
loggers and numpy arrays stand for device ones, so the order of waits, copies and calls is
seen on the CPU. The same decisions on real cupy arrays: tests/test_comm_gpu.py (marked gpu).
"""

import numpy as np
import pytest

from minidist.comm import trace


# ---- mpi.py: every MPI call waits for the device before MPI touches its buffers -----------

def _logger(log, what, returns=None):
    """A function that appends (what, *its arguments) to log and returns `returns`: the
    tests' device wait (`ready`) and MPI call."""
    def logged(*args, **kwargs):
        log.append((what,) + args + ((kwargs,) if kwargs else ()))
        return returns
    return logged


def test_an_mpi_call_is_made_once_the_device_has_written_every_array_it_is_handed():
    """A CUDA-aware MPI is handed cupy arrays themselves and reads them at once, while the
    kernels that write them (the caller's, or mpi.py's own float32 copies of bfloat16) may
    still be queued: mpi4py's CuPy demo synchronizes before every MPI call. mpi.py called
    MPI with no device_ready. Now every call is made by mpi.call_mpi: `ready` (device_ready;
    here a logger) on each array it hands MPI, found in nested lists (Allgatherv's
    [buffer, (counts, displs)]) and a bfloat16 array's uint16 view among them, then the
    call with those very arrays; MPI.IN_PLACE and the counts are not arrays."""
    from mpi4py import MPI
    from minidist.comm.mpi import call_mpi
    from minidist.comm.staging import wire
    out, inp = np.zeros(6, pytest.importorskip("ml_dtypes").bfloat16), np.arange(3.0)
    log = []
    got = call_mpi(_logger(log, "Allgatherv", "request"), MPI.IN_PLACE, inp,
                   [wire(out), ([3, 3], [0, 3])], op=MPI.SUM, ready=_logger(log, "ready"))
    assert got == "request" and [entry[0] for entry in log] == ["ready", "Allgatherv"]
    (_, r_inp, r_out), (_, in_place, c_inp, [c_out, counts], kwargs) = log
    assert r_inp is inp and r_out.dtype == np.uint16 and np.shares_memory(r_out, out)
    assert in_place is MPI.IN_PLACE and c_inp is inp and c_out is r_out
    assert counts == ([3, 3], [0, 3]) and kwargs == {"op": MPI.SUM}


def test_no_mpi_call_in_mpi_py_bypasses_call_mpi():
    """What makes call_mpi's order every call's: mpi.py calls no communicator method
    (capitalized, Get_size aside) itself, but hands each to call_mpi. That the calls give
    the ring's results: tests/test_comm.py, tests/test_bfloat16.py."""
    import ast
    import inspect
    from minidist.comm import mpi
    calls = [node for node in ast.walk(ast.parse(inspect.getsource(mpi)))
             if isinstance(node, ast.Call)]
    direct = [c.func.attr for c in calls if isinstance(c.func, ast.Attribute)
              and c.func.attr[:1].isupper() and c.func.attr != "Get_size"]
    assert direct == [], direct
    handed = {c.args[0].attr for c in calls if getattr(c.func, "id", None) == "call_mpi"}
    assert handed == {"Allreduce", "Reduce_scatter_block", "Reduce_scatter", "Allgather",
                      "Allgatherv", "Bcast", "Alltoallv", "Iallreduce", "Ireduce_scatter",
                      "Iallgatherv", "Ibcast"}, handed


# ---- staging.post and write_back: send and recv follow their plans ------------------------

def test_a_device_buffer_handed_to_mpi_itself_is_waited_for_before_the_post():
    """group.send and group.recv post through staging.post. Under a CUDA-aware MPI (the
    plan of a device buffer: handed itself, wait before) the device is waited for before
    MPI_Isend/MPI_Irecv is handed buf: ring attention posts the recv of the next block into
    the buffer the previous step's kernels read as `cur` (recv did not wait). A numpy buf
    stands for the device one; `ready` and the post are loggers. Nothing waits after."""
    from minidist.comm.staging import buffer_plan, post, write_back
    for op in ("send", "recv"):
        buf, log = np.arange(4.0), []
        plan = buffer_plan(op, True, True)
        request, host = post(plan, buf, _logger(log, "post", "request"), _logger(log, "ready"))
        assert request == "request" and host is buf, op
        assert [(what, a is buf) for what, a in log] == [("ready", True), ("post", True)], op
        write_back(buf, host, plan, _logger(log, "ready after"))
        assert len(log) == 2, op


def test_a_staged_recv_hands_mpi_an_empty_host_buffer_and_waits_after_the_copy_back():
    """Without a CUDA-aware MPI a recv's device buffer is staged: MPI_Irecv gets an empty
    host array of its shape and dtype (no copy of bytes about to be overwritten, and no
    wait before: cupy's get() would block the CPU that meant to post and go on), its
    bfloat16 as the uint16 view; once done write_back copies it into buf and then waits for
    the device. A send's buffer is read: it is copied and waited for before the post."""
    from minidist.comm.staging import buffer_plan, post, write_back
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    for dtype in (np.float32, bf16):
        buf, log = np.arange(4.0).astype(dtype), []
        plan = buffer_plan("recv", True, False)
        _, host = post(plan, buf, _logger(log, "post"), _logger(log, "ready"))
        assert [what for what, _ in log] == ["post"] and log[0][1] is host
        assert host.shape == buf.shape and not np.shares_memory(host, buf)
        assert host.dtype == (np.uint16 if dtype is bf16 else dtype)
        host[...] = np.array([5, 6, 7, 8], dtype).view(host.dtype)    # what MPI writes
        write_back(buf, host, plan, lambda a: log.append(("ready", a.tolist())))
        assert buf.tolist() == [5, 6, 7, 8] and log[1] == ("ready", [5, 6, 7, 8]), log
    buf, log = np.arange(4.0), []
    _, host = post(buffer_plan("send", True, False), buf, _logger(log, "post"),
                   _logger(log, "ready"))
    assert [what for what, _ in log] == ["ready", "post"] and host.tolist() == buf.tolist()


def test_a_host_buffer_is_posted_itself_with_no_device_wait():
    from minidist.comm.staging import buffer_plan, post, write_back
    for op in ("send", "recv"):
        for aware in (False, True):
            buf, log = np.arange(4.0), []
            plan = buffer_plan(op, False, aware)
            _, host = post(plan, buf, _logger(log, "post"), _logger(log, "ready"))
            write_back(buf, host, plan, _logger(log, "ready"))
            assert host is buf and [what for what, _ in log] == ["post"], (op, aware)


def test_group_send_and_recv_hand_their_buffers_through_post_and_write_back():
    """The code under test above (post, write_back) is what a GPU's send and recv rely on;
    here group.send and group.recv themselves, on the CPU: a real one-rank group sends to
    itself, and staging's own counts (handed_counts: each helper's calls, by placement)
    show one post per call, and the recv's completion one write_back; numpy buffers are
    handed "itself" (buffer_plan), bfloat16 ones as their uint16 view (wire, inside post:
    MPI would refuse the dtype), and arrive bit for bit. A send or recv that called MPI
    itself, skipping the staging a device buffer needs, shows here as missing counts."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup, staging
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank p2p")
    try:
        for dtype in (np.float64, bf16):
            staging.reset_handed_counts()
            x, y = np.arange(6.0).astype(dtype), np.zeros(6, dtype)
            work = group.recv(y, 0, async_op=True)
            group.send(x, 0)
            work.wait()
            assert y.tobytes() == x.tobytes(), dtype
            assert staging.handed_counts() == {("post", "itself"): 2,
                                               ("write_back", "itself"): 1}, dtype
    finally:
        group.destroy()
        trace.reset_counters()


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


def test_a_staged_broadcast_copies_each_way_only_what_moves():
    """A broadcast reads its buffer on the root and writes it on the others, and staging
    copied it both ways on every rank (DDP's start-up broadcast of a whole model: twice its
    bytes through the host on each rank). Told the root (group.py passes whether this rank
    is it): the root's is copied to the host and not back, another rank's handed empty and
    copied back. Not told (root None): as before. write_back of the root's plan leaves the
    buffer as it was (a numpy out stands for the device one, another array for its host
    copy); of another rank's, the host array's bytes land in it."""
    from minidist.comm.staging import Plan, buffer_plan, staged_collective, write_back
    assert buffer_plan("broadcast", True, False, root=True) == \
        Plan("host copy", False, True, copy_back=False)
    assert buffer_plan("broadcast", True, False, root=False) == Plan("host empty", False, True)
    assert buffer_plan("broadcast", True, False) == Plan("host copy", False, True)
    assert buffer_plan("broadcast", True, True, root=True) == \
        Plan("itself", False, True, copy_back=False)
    assert buffer_plan("all_reduce", True, False, root=False) == Plan("host copy", False, True)
    out, log = np.arange(4.0), []
    write_back(out, np.full(4, -1.0), buffer_plan("broadcast", True, False, root=True),
               lambda a: log.append("ready"))
    assert out.tolist() == [0, 1, 2, 3] and log == ["ready"]
    with staged_collective(buffer_plan("broadcast", True, False, root=False), False,
                           out) as (h_out,):
        assert not np.shares_memory(h_out, out)       # empty: nothing copied in
        h_out[...] = 7                                 # what the root sent
    assert out.tolist() == [7, 7, 7, 7]


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


def test_a_collective_stages_its_out_as_the_plan_says_and_waits_after_the_copy_back():
    """host_staging runs the collective inside staging.staged_collective with out's plan.
    A device out MPI only writes (an all-gather's, without CUDA-aware MPI) is handed as an
    empty host array, not a copy (which host_staging used to make: ZeRO-3 moved each
    gathered unit device -> host for nothing), and is copied back and then waited for; a
    host input is handed itself. Under a CUDA-aware MPI out is handed itself and waited
    for after the collective (its last kernels). A numpy out stands for the device one."""
    from minidist.comm.staging import buffer_plan, staged_collective
    out, inp, log = np.zeros(4), np.arange(4.0), []
    ready = _logger(log, "ready")
    with staged_collective(buffer_plan("all_gather", True, False), False, out, inp,
                           ready=lambda a: log.append(("ready", a.tolist()))) as (h_out, h_inp):
        assert not np.shares_memory(h_out, out) and h_out.shape == out.shape and h_inp is inp
        h_out[...] = inp + 1                                        # the collective
        log.append(("collective", None))
    assert out.tolist() == [1, 2, 3, 4]
    assert log == [("collective", None), ("ready", [1, 2, 3, 4])], log
    log.clear()
    with staged_collective(buffer_plan("reduce_scatter", True, True), True, out, inp,
                           ready=ready) as (h_out, h_inp):
        assert h_out is out and h_inp is inp and log == []
        log.append(("collective", None))
    assert [what for what, _ in log] == ["collective", "ready"] and log[1][1] is out


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
