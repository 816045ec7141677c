"""CUDA kernels run on the CPU: the same source text NVRTC compiles for the GPU, compiled by
the system C++ compiler with tests/cuda_host/cuda_host.h (threadIdx, __shared__,
__syncthreads, warp shuffles, atomics, __half and __nv_bfloat16 with their CUDA meaning;
its top comment explains the fiber scheduler) and launched through ctypes on numpy arrays.

    lib = cuda_cpu.build(source)            # g++ once per source text, cached on disk
    cuda_cpu.run(plan)                      # a cuda_kernels.Launch, in place on its arrays

A launch is refused, before any block runs, where a GPU would refuse it: a grid or block
outside cuLaunchKernel's limits (_dims_problem), a scalar or array of another width than its
parameter's C type, the source's typedefs T and A included (typedefs, _width_problem).
An array handed as two arguments is one buffer, as on a GPU (_alias).
Each array argument is copied into a buffer with 256 guard bytes on both sides, signalling NaNs
of its dtype, so a kernel that reads past an argument computes NaN and one that writes past it
fails the launch (KernelError); the results are copied back. A multi-tensor kernel's
pointer table (uint64 addresses, minidist/optim/multi_tensor.py) is checked to hold the
addresses of the arrays the plan names, then replaced by a table of guarded copies of
them, each checked and copied back the same way. The threads of a
block run as fibers, "low" order (the lowest-numbered runnable thread first) or "high".
Libraries are cached under .minidist-cache/cuda-cpu/ (git-ignored; the system's temporary
folder where that is not writable), keyed by the hash of the source, the header, compiler and
flags; `reason_unavailable()` says why not, where no compiler is.
Tests: tests/test_cuda_cpu.py (the harness itself); the kernels: tests/test_cuda_kernels_cpu.py,
tests/test_cuda_flash_cpu.py, tests/test_cuda_fusions_cpu.py, tests/test_multi_tensor_cpu.py.
Every kernel must have one: a run of the suite that holds every file importing this harness
fails, naming them, if a kernel of cuda_source's PARTS was never launched (LAUNCHED,
tests/conftest.py's pytest_sessionfinish).
"""
import ctypes
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from minidist.autograd import cuda_source as cs

HERE = pathlib.Path(__file__).resolve().parent
HOST = HERE / "cuda_host"
CACHE = HERE.parent / ".minidist-cache" / "cuda-cpu"
FLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-w", "-ffp-contract=off",
         "-fno-strict-aliasing")
GUARD = 256
LAUNCHED = set()              # the kernels this process ran (tests/conftest.py checks them)
_LIBS = {}
_LOCK = threading.Lock()      # the scheduler's state is global in each library


class KernelError(RuntimeError):
    """A launch the CPU runtime refused or caught misbehaving (deadlock, divergent barrier,
    a write outside an argument)."""


def compiler():
    """The C++ compiler: $CXX, else g++, c++ or clang++ on PATH; None if there is none."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((p for p in map(shutil.which, names) if p), None)


def reason_unavailable():
    """None when kernels can run here, else why not (for pytest.skip)."""
    if compiler() is None:
        return "no C++ compiler (g++, c++, clang++ or $CXX) to build CUDA kernels for the CPU"
    return None


def kernel_names(source):
    return re.findall(r'extern "C" __global__ void (\w+)\(', source)


def _wrappers(source):
    """Per kernel: a body taking void** (array pointers, and pointers to scalars) and an
    extern "C" entry cpu_launch_<name>(grid, block, high, args) for ctypes."""
    out = []
    for name in kernel_names(source):
        params = cs.signature(name, source)
        call = ", ".join(f"({c}*)a[{i}]" if ptr else f"*({c}*)a[{i}]"
                         for i, (c, ptr) in enumerate(params))
        out.append(f"static void cpu_body_{name}(void** a) {{ {name}({call}); }}\n"
                   f'extern "C" int cpu_launch_{name}(const unsigned* g, const unsigned* b, '
                   f"int high, void** a) {{ return cpu::launch(g, b, high, cpu_body_{name}, "
                   f"a); }}\n")
    return "".join(out)


def build(source):
    """The ctypes library of `source` (compiled once; cached in memory and on disk)."""
    text = source + "\n" + _wrappers(source)
    cxx = compiler()
    key = hashlib.sha256("\0".join([text, (HOST / "cuda_host.h").read_text(), cxx, *FLAGS])
                         .encode()).hexdigest()[:24]
    if key in _LIBS:
        return _LIBS[key]
    cache = _cache_dir()
    so = cache / f"{key}.so"
    if not so.exists():
        src, tmp = cache / f"{key}.{os.getpid()}.cpp", cache / f"{key}.{os.getpid()}.so"
        src.write_text(text)
        cmd = [cxx, *FLAGS, "-I", str(HOST), "-include", "cuda_host.h", str(src), "-o",
               str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        src.unlink()
        if res.returncode:
            raise KernelError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, so)                # atomic: a concurrent build writes the same bytes
    lib = ctypes.CDLL(str(so))
    lib.cuda_cpu_error.restype = ctypes.c_char_p
    _LIBS[key] = lib
    return lib


# Guard elements: signalling NaNs (a computation on one gives a quiet NaN, another bit
# pattern, so a value computed from a guard and written into one is still seen)
SNAN = {"float16": np.uint16(0xFD55), "bfloat16": np.uint16(0xFF95),
        "float32": np.uint32(0xFFA55555), "float64": np.uint64(0xFFF5555555555555)}


def _guard(dtype):
    """GUARD bytes of `dtype`'s guard element (0x55 bytes for a non-float dtype)."""
    one = SNAN.get(dtype.name, np.uint8(0x55))
    return np.full(GUARD // one.itemsize, one).view(np.uint8)


def _cache_dir():
    """CACHE, or a folder in the system's temporary directory where CACHE cannot be made."""
    for folder in (CACHE, pathlib.Path(tempfile.gettempdir()) / "minidist-cuda-cpu"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            pass
    raise KernelError(f"no writable folder for compiled kernels ({CACHE})")


def _guarded(a):
    """a's bytes between two guards."""
    if not a.flags.c_contiguous:
        raise KernelError("array arguments must be C-contiguous")
    guard = _guard(a.dtype)
    return np.concatenate([guard, a.reshape(-1).view(np.uint8), guard])


# the numpy dtype of each C type a kernel parameter names outright (T and A, the part's
# template types, vary with the dtype; bfloat16 is stored as its bits)
C_TYPES = {"int": np.int32, "unsigned int": np.uint32, "long long": np.int64,
           "unsigned long long": np.uint64, "float": np.float32, "double": np.float64,
           "unsigned short": np.uint16, "unsigned char": np.uint8, "bool": np.bool_}


# the numpy dtype name of each C type a part's typedefs of T and A name (cuda_source.CTYPES)
TYPEDEF_DTYPES = {"__half": "float16", "__nv_bfloat16": "bfloat16", "float": "float32",
                  "double": "float64"}


def typedefs(source):
    """{"T": dtype name, "A": dtype name} for the source's `typedef <C type> T;` and `A;`
    (cuda_source.source puts them on top of every part), {} for a source without them."""
    return {name: TYPEDEF_DTYPES[ctype] for ctype, name in
            re.findall(r"^typedef ([\w ]+?) (T|A);", source, re.M) if ctype in TYPEDEF_DTYPES}


def _width_problem(ctype, a, types=None):
    """Why argument `a` (an array for a pointer, else a numpy scalar) is not of C type
    `ctype`'s width, or None: an np.int32 handed to a `long long` would read 4 bytes past
    it, on the GPU and here alike, and often pass as zeros (review 40). T and A are the
    dtypes `types` (typedefs(source)) gives them: a float64 `A eps` handed to a float32
    kernel (the first GPU run's NaNs) is refused as a float64 `float` is."""
    if ctype in (types or {}):
        return None if a.dtype.name == types[ctype] else f"{a.dtype} for {ctype} = " \
            f"{types[ctype]}"
    want = C_TYPES.get(ctype)
    if want is None or a.dtype == np.dtype(want):
        return None
    return f"{a.dtype} for a {ctype}"


# cuLaunchKernel's limits on every CUDA GPU since compute capability 3.0 (Hopper's too)
GRID_MAX = (2 ** 31 - 1, 65535, 65535)
BLOCK_MAX = (1024, 1024, 64)


def _dims_problem(grid, block):
    """Why (grid, block) is not a launch a GPU takes, or None: 1 to 3 dimensions each, every
    one at least 1 (a grid planned for an empty input is an error there, not a no-op),
    gridDim.x <= 2^31 - 1, .y and .z <= 65535, blockDim.x, .y <= 1024, .z <= 64 (and at
    most 1024 threads in all: the runtime's own check, cuda_host.h)."""
    for what, dims, most in (("grid", grid, GRID_MAX), ("block", block, BLOCK_MAX)):
        if not 1 <= len(dims) <= 3:
            return f"{what} {dims}: CUDA allows 1 to 3 dimensions"
        if any(not 1 <= int(d) <= m for d, m in zip(dims, most)):
            return f"{what} {dims}: CUDA allows " + " x ".join(f"1..{m}" for m in most)
    return None


def launch(source, name, grid, block, args, order="low", tables=None):
    """Run kernel `name` of `source` over grid x block on numpy arrays (in place) and numpy
    scalars (their exact C width: np.int64 for long long, np.float32 for float, ...).
    `tables` {argument index: arrays}: that argument is a uint64 table of those arrays'
    addresses (checked), and the kernel gets a table of their guarded copies instead."""
    # CuPy's launch takes `tuple grid, tuple block` (cupy/cuda/function.pyx, v13.0.0 to
    # v14.2.0): a list is a TypeError there, so it is one here too
    if type(grid) is not tuple or type(block) is not tuple:
        raise KernelError(f"{name}: grid and block must be tuples, not "
                          f"{type(grid).__name__} and {type(block).__name__}")
    wrong = _dims_problem(grid, block)
    if wrong:
        raise KernelError(f"{name}: {wrong}")
    lib = build(source)
    params, types = cs.signature(name, source), typedefs(source)
    if len(params) != len(args):
        raise KernelError(f"{name}: {len(args)} arguments for {len(params)} parameters")
    keep, ptrs, copies, aliases = [], [], [], {}
    for i, ((ctype, pointer), a) in enumerate(zip(params, args)):
        if pointer != isinstance(a, np.ndarray) or not isinstance(a, (np.ndarray, np.generic)):
            raise KernelError(f"{name} argument #{i} ({ctype}{'*' * pointer}): got "
                              f"{type(a).__name__}")
        wrong = _width_problem(ctype, a, types)
        if wrong:
            raise KernelError(f"{name} argument #{i} ({ctype}{'*' * pointer}): {wrong}")
        if tables and i in tables:
            a, made = _table_of_copies(name, i, a, tables[i])
            copies += made
        elif pointer:
            aliases[i] = _alias(name, i, a, args, tables)
            if aliases[i] is not None:         # one buffer, as the GPU sees one array
                keep.append(keep[aliases[i]])
                ptrs.append(ptrs[aliases[i]])
                continue
        keep.append(_guarded(a) if pointer else np.array(a))
        ptrs.append(keep[-1].ctypes.data + (GUARD if pointer else 0))
    dims = [(ctypes.c_uint * 3)(*(tuple(d) + (1, 1))[:3]) for d in (grid, block)]
    argv = (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs)
    with _LOCK:
        rc = getattr(lib, f"cpu_launch_{name}")(dims[0], dims[1], int(order == "high"), argv)
        if rc:
            raise KernelError(f"{name}: {lib.cuda_cpu_error().decode()}")
    LAUNCHED.add(name)
    for i, (a, buf) in enumerate(zip(args, keep)):
        if isinstance(a, np.ndarray) and not (tables and i in tables) and aliases.get(i) is None:
            _copy_back(name, f"argument #{i} {params[i]}", a, buf)
    for what, a, buf in copies:
        _copy_back(name, what, a, buf)


def _alias(name, i, a, args, tables):
    """The index of an earlier array argument that is the same memory as argument #i, `a`
    (rope's y = x in place; ln_fwd's b = w), or None; an argument that overlaps an earlier
    one without being it is refused (separate copies would hide what a GPU does there)."""
    for j, b in enumerate(args[:i]):
        if not isinstance(b, np.ndarray) or (tables and j in tables):
            continue
        if np.may_share_memory(a, b):
            if a.ctypes.data == b.ctypes.data and a.nbytes == b.nbytes:
                return j
            raise KernelError(f"{name} argument #{i} overlaps argument #{j} without being it")
    return None


def harness_files():
    """The test files that run kernels on this harness: those that import it."""
    return sorted(p for p in HERE.glob("test_*.py") if "import cuda_cpu" in p.read_text())


def never_launched(launched):
    """The kernels of minidist/autograd/cuda_source.py's PARTS that are not in `launched`
    (LAUNCHED after a run of the whole suite: a kernel without a CPU test)."""
    return sorted({name for _, names in cs.PARTS.values() for name in names} - launched)


def _table_of_copies(name, i, table, arrays):
    """The pointer table argument #i rebuilt over guarded copies of `arrays`, after checking
    that it holds their addresses; and (what, array, copy) for each, to copy back."""
    want = np.array([a.ctypes.data for a in arrays], dtype=np.uint64)
    if table.dtype != np.uint64 or not np.array_equal(table.reshape(-1), want):
        raise KernelError(f"{name} argument #{i}: not the table of its {len(arrays)} arrays' "
                          f"addresses")
    copies = [(f"tensor {k} of table #{i}", a, _guarded(a)) for k, a in enumerate(arrays)]
    return np.array([buf.ctypes.data + GUARD for _, _, buf in copies], np.uint64), copies


def _copy_back(name, what, a, buf):
    """buf's middle back into a, after checking both guards are intact."""
    guard = _guard(a.dtype)
    if (buf[:GUARD] != guard).any() or (buf[GUARD + a.nbytes:] != guard).any():
        raise KernelError(f"{name} wrote outside {what}")
    a.reshape(-1).view(np.uint8)[...] = buf[GUARD:GUARD + a.nbytes]


def run(plan, source=None, order="low", tables=None):
    """Run a planned launch (cuda_kernels.Launch) on the CPU; `source` defaults to the
    source of the kernel's part for plan.dtype (a test passes a broken variant); `tables`
    as launch's (a multi-tensor plan's, minidist/optim/multi_tensor.py)."""
    source = cs.source(plan.dtype, cs.part_of(plan.name)) if source is None else source
    launch(source, plan.name, plan.grid, plan.block, plan.args, order, tables)


# ---- nvcc: a source's PTX, where a CUDA toolkit is installed (no GPU needed) ---------------

PTX_TYPES = {"float32": ".f32", "float64": ".f64", "int64": ".u64", "int32": ".u32"}


def nvcc_ptx(source, folder):
    """The PTX nvcc makes of `source` for sm_90 (written in `folder`); the calling test is
    skipped where no nvcc is on PATH."""
    import pytest
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    src, ptx = pathlib.Path(folder) / "k.cu", pathlib.Path(folder) / "k.ptx"
    src.write_text(source)
    subprocess.run([nvcc, "-arch=sm_90", "--std=c++14", "-ptx", str(src), "-o", str(ptx)],
                   check=True, capture_output=True, timeout=300)
    return ptx.read_text()


def ptx_params(ptx, name):
    """The .param types of kernel `name` in `ptx`, in order (.u64 for a pointer)."""
    body = re.search(r"\.entry " + name + r"\(([^)]*)\)", ptx).group(1)
    return re.findall(r"\.param (\.\w+) ", body)


def planned_widths(plan):
    """The .param types a Launch's arguments need: .u64 for an array, else its dtype's."""
    from minidist.autograd import cuda_kernels as ck
    return [".u64" if kind == "array" else PTX_TYPES[dt] for kind, dt, *_ in
            ck.describe(plan.args)]


# What one block may use on a GPU of compute capability 9.0 (H100, H200): 65536 32-bit
# registers and 48 KiB of static shared memory (more needs a dynamic opt-in, which these
# kernels do not make: cuda_source.py's parts use static __shared__ only)
REGISTERS_PER_BLOCK = 65536
STATIC_SMEM_MAX = 48 * 1024


def nvcc_resources(source, folder):
    """{kernel: (registers per thread, static shared bytes)} as ptxas reports them when nvcc
    builds `source` for sm_90 (the calling test is skipped where no nvcc is on PATH). What a
    launch needs beyond the harness's model: a block of b threads needs about b x registers
    of the SM's 65536, and ptxas itself refuses more than 48 KiB of static shared memory."""
    import pytest
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    src = pathlib.Path(folder) / "r.cu"
    src.write_text(source)
    res = subprocess.run([nvcc, "-arch=sm_90", "--std=c++14", "-cubin", "-Xptxas", "-v",
                          str(src), "-o", str(pathlib.Path(folder) / "r.cubin")],
                         check=True, capture_output=True, text=True, timeout=300)
    out = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry|\Z)",
                                 res.stderr, re.S):
        regs = re.search(r"Used (\d+) registers", body)
        smem = re.search(r"(\d+) bytes smem", body)
        out[name] = (int(regs.group(1)), int(smem.group(1)) if smem else 0)
    return out
