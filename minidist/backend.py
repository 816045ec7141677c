"""The array backend: numpy on the CPU, cupy on a GPU, chosen in one place.

Every op finds its array module with `xp_of(array)`; nothing else in minidist decides
between numpy and cupy. This module also owns the things that depend on the machine rather
than the model: which GPU a rank uses (its local rank, minidist/launcher.py), how many BLAS
threads a rank may run (cores on this node / ranks on this node), host <-> device moves, the
host random generator and memory stats. Batched GEMMs that CuPy's matmul runs slowly go to
cuBLAS through minidist/gemm.py (with MINIDIST_CUDA_NEW_KERNELS=1; see `matmul`).

Nothing happens on import: an entry point calls `setup(threads, device)` once. CuPy is
imported only when asked for, so the package and the whole CPU test suite work on a machine
with no CUDA at all. Tests: tests/test_backend.py.
"""
import ctypes
import os
import sys

import numpy as np

from minidist import gemm
from minidist.launcher import (available_cores, default_threads, local_rank_and_size,  # noqa
                               set_thread_env, world_size_from_env)

_state = {"xp": np, "device": "cpu", "device_id": None}


def setup(threads=None, device="auto"):
    """What an entry point calls once, before its first numpy work: limit BLAS to `threads`
    per rank (default: cores on this node // ranks on it) and choose the device ("auto",
    "cpu" or "cuda"). Returns (threads, device). Importing minidist sets neither."""
    return set_blas_threads(threads), set_device(device)


# -------------------------------------------------------------------------------------------
# BLAS threads
# -------------------------------------------------------------------------------------------

_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "MKL_Set_Num_Threads")
_GETTERS = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_",
            "scipy_openblas_get_num_threads", "openblas_get_num_threads64_",
            "MKL_Get_Max_Threads")


def _loaded_blas_libraries():
    """The BLAS libraries mapped into this process (Linux: /proc/self/maps), opened."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    libs = []
    for path in sorted(p for p in paths if "blas" in p.lower() or "mkl_rt" in p.lower()):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libs


def set_blas_threads(n=None):
    """Limit BLAS (OpenBLAS/MKL) to `n` threads in this process; default: an exported
    OPENBLAS_NUM_THREADS, else `default_threads()`. Returns the number set.

    The environment variables only count before numpy loads its BLAS (minidist.launcher's
    set_thread_env, called by entry points first thing), so the library's own setter is
    called too, through ctypes: it works at any time.
    """
    n = set_thread_env(n)
    for lib in _loaded_blas_libraries():
        for name in _SETTERS:
            if hasattr(lib, name):
                getattr(lib, name)(ctypes.c_int(n))
    return n


def blas_threads():
    """The thread count the loaded BLAS library reports (None if it cannot be asked)."""
    for lib in _loaded_blas_libraries():
        for name in _GETTERS:
            if hasattr(lib, name):
                return int(getattr(lib, name)())
    return None


# -------------------------------------------------------------------------------------------
# numpy or cupy
# -------------------------------------------------------------------------------------------

def cupy_module():
    """The cupy module if it imports and sees at least one GPU, else None. Never raises."""
    if "cupy" in _state:
        return _state["cupy"]
    # MINIDIST_TF32=1: float32 matmuls on TF32 tensor cores (10-bit mantissa products, float32
    # accumulate). CuPy reads CUPY_TF32 once, at its first float32 matmul, and keeps the
    # answer (get_compute_type, cupy/_core/_routines_linalg.pyx, v13 and v14), so it is set
    # here, before the import.
    if os.environ.get("MINIDIST_TF32") == "1":
        os.environ.setdefault("CUPY_TF32", "1")
    try:
        import cupy
        ok = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # not installed, no driver, no device: all mean "no cupy"
        cupy, ok = None, False
    _state["cupy"] = cupy if ok else None
    return _state["cupy"]


def set_device(device="auto"):
    """Choose where arrays live: "cpu", "cuda", or "auto" (cuda if a GPU is usable).

    On cuda, each rank takes GPU `local_rank % device_count`. Returns "cpu" or "cuda".
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    cp = cupy_module() if device in ("auto", "cuda") else None
    if device == "cuda" and cp is None:
        raise RuntimeError("--device cuda asked for, but cupy is not installed or sees no GPU "
                           "(pip install -e '.[cuda]')")
    if cp is None:
        _state.update(xp=np, device="cpu", device_id=None)
        return "cpu"
    device_id = local_rank_and_size()[0] % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(device_id).use()
    _state.update(xp=cp, device="cuda", device_id=device_id)
    return "cuda"


def get_xp():
    """The array module of the current device (numpy until `set_device` picks cuda)."""
    return _state["xp"]


def device():
    """"cpu" or "cuda": the current device."""
    return _state["device"]


def is_cupy(a):
    return type(a).__module__.split(".")[0] == "cupy"


def xp_of(*arrays):
    """The array module (numpy or cupy) that owns these arrays; numpy for plain scalars."""
    for a in arrays:
        if is_cupy(a):
            return sys.modules["cupy"]
    return np


def is_half(dtype):
    """float16, or bfloat16 (ml_dtypes' numpy extension type, which is not of kind "f")."""
    return dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16")


def is_float(dtype):
    """A floating dtype: kind "f", or bfloat16 (whose kind is "V"): use this, not kind."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


def matmul(a, b, out=None):
    """a @ b (numpy's rules), into `out` if given.

    NumPy has no float16 BLAS: its float16 matmul is a plain C loop, ~50x slower than float32
    on this repository's CPU. So on the CPU, float16 operands are multiplied in float32 and the
    product is rounded to float16 -- the numbers a GPU's float16 GEMM gives too (tensor cores
    multiply float16 and accumulate in float32), at float32 BLAS speed. CPU "float16" is thus
    float16 storage with float32 matmuls. CuPy runs the real float16 GEMM (batched: see
    below).
    """
    # CuPy's batched matmul misses the tensor cores in float16 and float32-TF32 and rejects
    # bfloat16 ("data type 'E' not understood", seen on an H100). With
    # MINIDIST_CUDA_NEW_KERNELS=1 those products go to cuBLAS's strided-batched Ex GEMM
    # (minidist/gemm.py: 16-bit in, float32 accumulate; proven on the CPU only).
    compute = gemm.chosen(a, b) if is_cupy(a) and is_cupy(b) else None
    if compute is not None:
        prod = gemm.matmul(a, b, compute)
        if out is None:
            return prod
        out[...] = prod
        return out
    # Otherwise batched bfloat16 on CuPy: float32 product, rounded once (correct, not fast).
    bf16_batched = is_cupy(a) and a.dtype.name == "bfloat16" and max(a.ndim, b.ndim) > 2
    if (is_half(a.dtype) and not is_cupy(a)) or bf16_batched:
        xp = xp_of(a)
        prod = xp.matmul(a.astype(np.float32), b.astype(np.float32))
        if out is None:
            return prod.astype(a.dtype)
        out[...] = prod
        return out
    return xp_of(a).matmul(a, b) if out is None else xp_of(a).matmul(a, b, out=out)


def to_host(a):
    """A numpy copy (cupy) or view (numpy) of `a`: for checkpoints, sampling and other work
    outside the training step (inside it: `host_read`, which counts)."""
    return a.get() if is_cupy(a) else np.asarray(a)


def host_read(a, why):
    """`a` (a device array, numpy value or Python number) as a numpy array on the host,
    counted under the reason `why`: THE one door for a deliberate device -> host read in a
    training step. On a GPU each such read stalls the CPU until the GPU has drained its
    queue (and cannot be captured in a CUDA graph), so the step makes as few as it can, and
    the count shows how many: `host_reads()` -> {why: count}. The count is kept on the CPU
    too (where a read costs nothing), so a CPU test proves what a GPU step would do
    (tests/test_no_sync.py; the reads of a step: minidist/train/README.md)."""
    reads = _state.setdefault("host_reads", {})
    reads[why] = reads.get(why, 0) + 1
    return a.get() if is_cupy(a) else np.asarray(a)


def host_reads():
    """{reason: count} of every `host_read` since the process began (a caller wanting a
    window subtracts an earlier copy: the loop's summary, bench_step, the tests)."""
    return dict(_state.get("host_reads", {}))


def to_device(a, xp=None):
    """`a` as an array of `xp` (default: the current device's module)."""
    xp = xp or get_xp()
    return xp.asarray(a)


def synchronize():
    """Wait for queued GPU work (a no-op on the CPU); call before reading a timer."""
    if _state["device"] == "cuda":
        sys.modules["cupy"].cuda.Device().synchronize()


# -------------------------------------------------------------------------------------------
# randomness and memory
# -------------------------------------------------------------------------------------------

def rng(seed):
    """A host numpy Generator. Parameters are initialised on the host and then moved, so the
    same seed gives the same numbers on CPU and GPU, and a sharded init can cut a full one."""
    return np.random.Generator(np.random.PCG64(seed))


def memory_stats():
    """Memory in use by this process, in bytes.

    cpu: {"rss"} resident set size. cuda: also {"pool_used", "pool_total"} from CuPy's
    default memory pool (what arrays hold vs what the pool has taken from the driver).
    """
    stats = {"rss": _rss_bytes()}
    if _state["device"] == "cuda":
        pool = sys.modules["cupy"].get_default_memory_pool()
        stats.update(pool_used=int(pool.used_bytes()), pool_total=int(pool.total_bytes()))
    return stats


def _rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource  # macOS: peak, not current, but the best available without psutil
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
