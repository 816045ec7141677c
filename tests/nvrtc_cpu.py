"""NVRTC, CuPy's runtime compiler, called through ctypes on a machine without a GPU: the
kernels' sources compiled as CuPy compiles them, with ptxas's register and shared-memory
counts. NVRTC comes from NVIDIA's pip packages (`pip install --target DIR
nvidia-cuda-nvrtc nvidia-cuda-runtime`, CUDA 12 or 13) or a toolkit; say where with
MINIDIST_NVRTC_LIB (libnvrtc.so.*) and MINIDIST_CUDA_INCLUDE (the folder of cuda_fp16.h),
else the installed `nvidia` package is looked in. Used by tests/test_nvrtc.py.
"""
import ctypes
import glob
import importlib.util
import os
import re

# CuPy 14's options for a RawKernel (--std=c++14, its own include folder) and the H100's arch
OPTIONS = ("--std=c++14", "-arch=sm_90", "--device-as-default-execution-space", "-Xptxas=-v")


def find():
    """(libnvrtc path, include folder), or None where neither the variables nor the
    `nvidia` package give them."""
    lib, inc = os.environ.get("MINIDIST_NVRTC_LIB"), os.environ.get("MINIDIST_CUDA_INCLUDE")
    if lib and inc:
        return lib, inc
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        libs = sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so.*")))
        heads = glob.glob(os.path.join(root, "*", "include", "cuda_fp16.h"))
        if libs and heads:
            return libs[-1], os.path.dirname(heads[0])
    return None


def compile_source(lib_path, include, source):
    """(return code, ptxas's log) of NVRTC compiling `source` with OPTIONS."""
    for builtins in glob.glob(os.path.join(os.path.dirname(lib_path),
                                           "libnvrtc-builtins.so.*")):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)    # NVRTC opens it by name at compile
    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"minidist.cu", 0,
                                None, None)
    if rc:
        return rc, f"nvrtcCreateProgram returned {rc}"
    opts = [*OPTIONS, f"-I{include}"]
    rc = lib.nvrtcCompileProgram(prog, len(opts),
                                 (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def resources(log):
    """{kernel: (registers, static shared-memory bytes)} from ptxas's -v lines."""
    out = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry|\Z)",
                                 log, re.S):
        used = re.search(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?",
                         body)
        if used:
            out[name] = (int(used.group(1)), int(used.group(2) or 0))
    return out
