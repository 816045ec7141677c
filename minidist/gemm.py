"""Batched GEMMs on tensor cores: cuBLAS `gemmStridedBatchedEx`, planned by a pure function.

Why: on an H100, CuPy's batched `cupy.matmul` does not reach the tensor cores (its float16 is
slower than its float32; its bfloat16 raises "data type 'E' not understood"), while calling
cuBLAS's strided-batched Ex GEMM directly ran ~10x faster in float16 and works in bfloat16
(measured once, outside this repository; see examples/GPU_NOTES.md). backend.matmul sends
batched float16/bfloat16 products here on cupy arrays, and float32 ones under MINIDIST_TF32=1,
only with MINIDIST_CUDA_NEW_KERNELS=1 (`chosen`): proven on the CPU, never run on a GPU yet.

cuBLAS is column-major; numpy is row-major. A row-major (n, k) matrix with row stride ld IS
the column-major (k x n) matrix a^T with leading dimension ld, so the row-major product
C = a @ b (n x m) is computed as the column-major C^T = b^T a^T (m x n): cuBLAS's operand "A"
is our b, its "B" our a, with m, n swapped. An operand stored row-major per matrix (last
stride 1) needs no transpose (CUBLAS_OP_N); one stored column-major (a transposed view such
as k.swapaxes(-1, -2), first stride 1) is read with CUBLAS_OP_T, without a copy. E.g.
S = q @ k^T (T, hs) @ (hs, T): transa = T, transb = N, m = n = T, k = hs, lda = ldb = hs,
ldc = T. The batch dimensions (numpy broadcasting) must walk each operand with ONE stride
(strideA/B; 0 for a broadcast operand); where they do not (GPT's q, k, v are views into the
fused qkv activation: batch strides (T*3C, hs) over (B, nh)), the operand is copied contiguous.

`plan(xp, a, b, compute)` is pure: it returns a `Gemm` (every argument of the call, operands as
arrays whose first element is the pointer cuBLAS gets) and allocates C with xp;
tests/cublas_cpu.py executes such a plan on numpy memory by cuBLAS's documented semantics
(tests/test_gemm.py). `run(plan)` makes the call on the GPU.
"""
import collections
import math
import os
import sys

import numpy as np

# cudaDataType_t (CUDA's library_types.h) and cuBLAS's enums (cublas_api.h); the values agree
# with cupy_backends (v13.6.0, v14.0.1: cuda/api/_runtime_enum.pxd, cuda/libs/cublas.pxd).
# tests/test_gemm.py checks them against the headers where a CUDA toolkit is installed.
DATA_TYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}   # CUDA_R_32F ...
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F = 68, 77, 70
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0
INT_MAX = 2 ** 31 - 1        # m, n, k, ld and batchCount are C ints in the call

Gemm = collections.namedtuple(
    "Gemm", "transa transb m n k alpha A atype lda strideA B btype ldb strideB "
            "beta C ctype ldc strideC batch compute")


def compute_type(dtype, tf32=False):
    """The cublasComputeType_t for operands of `dtype`: 64F for float64; 32F_FAST_TF32 for
    float32 when tf32; else 32F (float16/bfloat16 in, float32 accumulate)."""
    name = np.dtype(dtype).name
    if name not in DATA_TYPES:
        raise ValueError(f"no cuBLAS GEMM plan for dtype {name}")
    if name == "float64":
        return CUBLAS_COMPUTE_64F
    return CUBLAS_COMPUTE_32F_FAST_TF32 if tf32 and name == "float32" else CUBLAS_COMPUTE_32F


def scale_dtype(compute):
    """The type alpha and beta must have (cuBLAS's "scale type"): double for 64F, else float."""
    return np.dtype(np.float64 if compute == CUBLAS_COMPUTE_64F else np.float32)


def chosen(a, b):
    """The compute type backend.matmul should run a @ b with here, or None for the default
    path: batched (both >= 2-D, one > 2-D), non-empty, one dtype: float16/bfloat16 (32F), or
    float32 under MINIDIST_TF32=1 (32F_FAST_TF32); only with MINIDIST_CUDA_NEW_KERNELS=1.
    It reads dtypes, shapes and the environment only; the caller checks for cupy."""
    if os.environ.get("MINIDIST_CUDA_NEW_KERNELS", "0") != "1":
        return None
    if min(a.ndim, b.ndim) < 2 or max(a.ndim, b.ndim) < 3 or a.dtype != b.dtype:
        return None
    if a.size == 0 or b.size == 0 or max(a.shape + b.shape) > INT_MAX:
        return None
    name = a.dtype.name
    if name in ("float16", "bfloat16"):
        return CUBLAS_COMPUTE_32F
    if name == "float32" and os.environ.get("MINIDIST_TF32") == "1":
        return CUBLAS_COMPUTE_32F_FAST_TF32
    return None


def matrix_layout(rows, cols, rs, cs):
    """How cuBLAS can read a (rows, cols) row-major-indexed matrix with element strides
    (rs, cs): (CUBLAS_OP_N, ld) when stored row-major (column-major of its transpose),
    (CUBLAS_OP_T, ld) when stored column-major, None when neither (then a copy). A stride
    along a dimension of size 1 is never used, so it may be anything."""
    if (cols == 1 or cs == 1) and (rows == 1 or rs >= cols):
        return CUBLAS_OP_N, (rs if rows > 1 else cols)
    if (rows == 1 or rs == 1) and (cols == 1 or cs >= rows):
        return CUBLAS_OP_T, (cs if cols > 1 else rows)
    return None


def batch_stride(shape, strides):
    """One element stride s with offset(flat batch index i) = i * s over these batch dims
    (C order), or None (also for a negative one). Size-1 dims do not count; all-broadcast
    dims give 0."""
    stride, inner = None, 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1:
            if s % inner or (stride is not None and s != stride * inner):
                return None
            stride = s // inner if stride is None else stride
        inner *= n
    if stride is None:
        return 0
    return None if stride < 0 else stride


def _layout(x):
    """(op, ld, batch stride) of x (..., rows, cols) in elements, or None."""
    if any(s % x.itemsize for s in x.strides):
        return None
    st = [s // x.itemsize for s in x.strides]
    mat = matrix_layout(x.shape[-2], x.shape[-1], st[-2], st[-1])
    bs = batch_stride(x.shape[:-2], st[:-2])
    if mat is None or bs is None or mat[1] > INT_MAX:
        return None
    return mat + (bs,)


def operand(xp, x, batch):
    """x broadcast over the batch shape, as cuBLAS takes it: (op, ld, stride, array). A
    broadcast operand keeps stride 0; one its batch dims cannot walk with one stride, or
    whose matrices are neither row- nor column-major, is copied contiguous."""
    x = xp.broadcast_to(x, tuple(batch) + x.shape[-2:])
    fits = _layout(x)
    if fits is None:
        x = xp.ascontiguousarray(x)
        fits = _layout(x)
    return fits + (x,)


def plan(xp, a, b, compute=None):
    """The Gemm plan of the row-major batched product a @ b, (..., n, k) @ (..., k, m) with
    numpy's broadcasting of the batch dims, and its output C (batch..., n, m), C-contiguous,
    allocated with xp. compute: a cublasComputeType_t (default: compute_type(a.dtype))."""
    if a.ndim < 2 or b.ndim < 2 or a.dtype != b.dtype:
        raise ValueError("a GEMM plan takes two >= 2-D operands of one dtype, not "
                         f"{a.shape} {a.dtype} and {b.shape} {b.dtype}")
    (n, k), (k2, m) = a.shape[-2:], b.shape[-2:]
    if k != k2:
        raise ValueError(f"inner dimensions differ: {a.shape} @ {b.shape}")
    compute = compute_type(a.dtype) if compute is None else compute
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    transb, ldb, stride_b, B = operand(xp, a, batch)     # cuBLAS's B is our a (k x n, col-major)
    transa, lda, stride_a, A = operand(xp, b, batch)     # cuBLAS's A is our b (m x k, col-major)
    C = xp.empty(batch + (n, m), a.dtype)
    count, code, acc = math.prod(batch), DATA_TYPES[a.dtype.name], scale_dtype(compute)
    if max(m, n, k, lda, ldb, count) > INT_MAX:
        raise ValueError(f"{a.shape} @ {b.shape} exceeds cuBLAS's 32-bit sizes")
    return Gemm(transa=transa, transb=transb, m=m, n=n, k=k, alpha=np.array(1.0, acc),
                A=A, atype=code, lda=lda, strideA=stride_a, B=B, btype=code, ldb=ldb,
                strideB=stride_b, beta=np.array(0.0, acc), C=C, ctype=code, ldc=m,
                strideC=n * m, batch=count, compute=compute), C


def run(p):
    """Make the planned call on the GPU (p's arrays are cupy arrays).

    The binding, read in CuPy's source (cupy_backends/cuda/libs/cublas.pyx, the same in
    v13.6.0, v14.0.1 and v14.2.0): gemmStridedBatchedEx(handle, transa, transb, m, n, k,
    alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC,
    batchCount, computeType, algo), every pointer a size_t; it sets the handle's stream to
    CuPy's current stream and, for computeType >= CUBLAS_COMPUTE_16F (64), calls
    cublasGemmStridedBatchedEx with a cublasComputeType_t. alpha and beta are HOST pointers
    (cublas.create leaves CUBLAS_POINTER_MODE_HOST, and CuPy's own tensordot_core passes
    host floats the same way; cupy/cublas.py restores the mode after every change), so the
    mode is checked here and set to host only for this call if something left it on device.
    """
    from cupy_backends.cuda.libs import cublas
    handle = sys.modules["cupy"].cuda.device.get_cublas_handle()
    mode = cublas.getPointerMode(handle)
    if mode != CUBLAS_POINTER_MODE_HOST:
        cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmStridedBatchedEx(
            handle, p.transa, p.transb, p.m, p.n, p.k, p.alpha.ctypes.data,
            p.A.data.ptr, p.atype, p.lda, p.strideA, p.B.data.ptr, p.btype, p.ldb, p.strideB,
            p.beta.ctypes.data, p.C.data.ptr, p.ctype, p.ldc, p.strideC, p.batch, p.compute,
            CUBLAS_GEMM_DEFAULT)
    finally:
        if mode != CUBLAS_POINTER_MODE_HOST:
            cublas.setPointerMode(handle, mode)


def matmul(a, b, compute):
    """a @ b on cupy arrays through one cuBLAS strided-batched call (compute: chosen(a, b))."""
    p, c = plan(sys.modules["cupy"], a, b, compute)
    run(p)
    return c
