"""Count the CUDA kernels a piece of code launches, through NVIDIA's CUPTI activity API.

CuPy has no launch counter of its own (cupyx.profiler times, it does not count), and the
project never imports torch, so this talks to libcupti directly with ctypes, as a CUPTI
client written in C would:

    cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed)
    cuptiActivityEnable(CONCURRENT_KERNEL)       every kernel launch becomes one record
    ... the code being measured ...
    cuptiActivityFlushAll(1)                     after a device sync: buffers come back, and
                                                 their kernel records are counted
    cuptiActivityDisable(CONCURRENT_KERNEL)      (cuptiActivityGetNextRecord walks a buffer;
                                                  each record starts with its uint32 kind)

libcupti is looked for in MINIDIST_CUPTI (a path), then the `nvidia-cuda-cupti` wheel's
folder (CUDA 12's or 13's layout), then extras/CUPTI/lib64, lib64 and lib of $CUDA_HOME and
/usr/local/cuda*, then the loader's path.
`cupti_candidates` (the search order) is a pure function, tested on the CPU
(tests/test_kernel_count.py); counting itself needs a GPU and is checked there by
examples/bench_step.py --device cuda ("kernels_per_step").
"""
import ctypes
import ctypes.util
import glob
import importlib.util
import os

CUPTI_SUCCESS = 0
FLUSH_FORCED = 1                                   # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
KIND_KERNEL, KIND_CONCURRENT_KERNEL = 3, 10       # CUpti_ActivityKind
BUFFER_BYTES = 8 * 2**20
ALIGN = 8                                          # CUPTI wants 8-byte aligned buffers

_REQUESTED = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint8)),
                              ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_COMPLETED = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32,
                              ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t, ctypes.c_size_t)


def cupti_candidates(env=None):
    """Paths (or bare names for the loader) to try for libcupti, most specific first."""
    env = os.environ if env is None else env
    out = [env["MINIDIST_CUPTI"]] if env.get("MINIDIST_CUPTI") else []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        # CUDA 12's wheels: nvidia/cuda_cupti/lib; CUDA 13's: nvidia/cu13/lib, one folder for
        # every library (as CuPy 14 finds them: cupy/_environment.py, v14.0.1)
        for sub in ("cuda_cupti", "cu[0-9]*"):
            out += sorted(glob.glob(os.path.join(root, sub, "lib", "libcupti.so*")))
    homes = [env["CUDA_HOME"]] if env.get("CUDA_HOME") else []
    homes += sorted(glob.glob("/usr/local/cuda*"))
    for home in homes:
        for lib in (os.path.join("extras", "CUPTI", "lib64"), "lib64", "lib"):
            out += sorted(glob.glob(os.path.join(home, lib, "libcupti.so*")))
    found = ctypes.util.find_library("cupti")
    return out + ([found] if found else []) + ["libcupti.so"]


def load_cupti():
    """The first libcupti that loads, or a RuntimeError saying where it looked."""
    tried = cupti_candidates()
    for path in tried:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError(f"no libcupti found (tried {tried}); set MINIDIST_CUPTI=/path/to/"
                       f"libcupti.so to count kernel launches")


class KernelCounter:
    """`with counter: ...` counts the kernels launched inside (read `counter.count`).
    Synchronises the device on exit so every launched kernel has its record."""

    def __init__(self):
        self.lib = load_cupti()
        self.lib.cuptiActivityGetNextRecord.argtypes = [
            ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t,
            ctypes.POINTER(ctypes.POINTER(ctypes.c_uint32))]
        self.count = 0
        self._buffers = {}            # address -> ctypes buffer, alive until CUPTI hands it back
        self._requested = _REQUESTED(self._buffer_requested)    # kept: CUPTI holds pointers
        self._completed = _COMPLETED(self._buffer_completed)
        self._check(self.lib.cuptiActivityRegisterCallbacks(self._requested, self._completed),
                    "cuptiActivityRegisterCallbacks")

    def _check(self, result, what):
        if result != CUPTI_SUCCESS:
            raise RuntimeError(f"{what} failed with CUPTI error {result}")

    def _buffer_requested(self, buffer, size, max_records):
        raw = ctypes.create_string_buffer(BUFFER_BYTES + ALIGN)
        address = ctypes.addressof(raw)
        address += -address % ALIGN
        self._buffers[address] = raw
        buffer[0] = ctypes.cast(address, ctypes.POINTER(ctypes.c_uint8))
        size[0], max_records[0] = BUFFER_BYTES, 0

    def _buffer_completed(self, context, stream, buffer, size, valid):
        record = ctypes.POINTER(ctypes.c_uint32)()
        while self.lib.cuptiActivityGetNextRecord(buffer, valid,
                                                  ctypes.byref(record)) == CUPTI_SUCCESS:
            if record[0] in (KIND_KERNEL, KIND_CONCURRENT_KERNEL):
                self.count += 1
        self._buffers.pop(ctypes.cast(buffer, ctypes.c_void_p).value, None)

    def start(self):
        """Count from here (a RuntimeError where CUPTI refuses: another subscriber, no
        privileges, a CUPTI of another CUDA than CuPy's); returns self."""
        import cupy                   # only on the GPU path: the caller has cupy arrays
        cupy.cuda.Device().synchronize()
        self.count = 0
        self._check(self.lib.cuptiActivityEnable(KIND_CONCURRENT_KERNEL), "cuptiActivityEnable")
        return self

    def stop(self):
        """Stop counting; `count` then holds every kernel since start()."""
        import cupy
        cupy.cuda.Device().synchronize()           # every record complete: flush them all
        self.lib.cuptiActivityFlushAll(FLUSH_FORCED)
        self.lib.cuptiActivityDisable(KIND_CONCURRENT_KERNEL)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False
