"""cuBLAS's gemmStridedBatchedEx, interpreted on numpy memory: the CPU proof of minidist/gemm.py.

`run(plan)` executes a `gemm.Gemm` the way cuBLAS's documentation defines the call, reading
only what cuBLAS gets: a pointer per operand (the array's first element; everything after it
in memory is reachable, as far as the array's own span goes), the ld/stride/trans numbers
and the type codes. For batch i, with column-major matrices (element (r, c) of a matrix with
leading dimension ld at pointer + r + c * ld):

    C_i = alpha * op(A_i) @ op(B_i) + beta * C_i,   A_i at A + i*strideA, op(A) m x k,
                                                     B_i at B + i*strideB, op(B) k x n,
                                                     C_i at C + i*strideC, m x n (ldc)

op(X) = X (CUBLAS_OP_N) or X^T (CUBLAS_OP_T). Products accumulate in the compute type (float32
for COMPUTE_32F, double for 64F; 32F_FAST_TF32 is taken as float32 here: the rounding of
inputs to TF32 is the GPU's), then round to C's type. alpha and beta are read from their
host memory AS the scale type, so a scalar of the wrong width gives wrong numbers (or reads
past its buffer), as it would on the GPU. The argument checks are those cuBLAS documents as
CUBLAS_STATUS_INVALID_VALUE (negative sizes, an ld below its minimum) and
CUBLAS_STATUS_NOT_SUPPORTED (a type combination outside its table); a read or write outside an
operand's memory raises IndexError instead of reading garbage.
"""
import numpy as np

from minidist import gemm

_NAMES = {code: name for name, code in gemm.DATA_TYPES.items()}
# (Atype = Btype, computeType) -> the C types cuBLAS's gemmStridedBatchedEx table allows
SUPPORTED = {("float16", gemm.CUBLAS_COMPUTE_32F): ("float16", "float32"),
             ("bfloat16", gemm.CUBLAS_COMPUTE_32F): ("bfloat16", "float32"),
             ("float32", gemm.CUBLAS_COMPUTE_32F): ("float32",),
             ("float32", gemm.CUBLAS_COMPUTE_32F_FAST_TF32): ("float32",),
             ("float64", gemm.CUBLAS_COMPUTE_64F): ("float64",)}


def memory(x):
    """The elements cuBLAS can reach through x's pointer: a flat view of x's memory from its
    first element to its last (x's strides must be >= 0, as in every plan)."""
    assert all(s >= 0 for s in x.strides), x.strides
    span = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.strides)) // x.itemsize
    return np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(x.itemsize,))


def check_arguments(p):
    """Raise ValueError where cuBLAS returns INVALID_VALUE or NOT_SUPPORTED."""
    if min(p.m, p.n, p.k, p.batch) < 0:
        raise ValueError(f"negative size: m={p.m} n={p.n} k={p.k} batchCount={p.batch}")
    if p.transa not in (gemm.CUBLAS_OP_N, gemm.CUBLAS_OP_T) or \
            p.transb not in (gemm.CUBLAS_OP_N, gemm.CUBLAS_OP_T):
        raise ValueError(f"trans flags {p.transa}, {p.transb}")
    need = {"lda": max(1, p.m if p.transa == gemm.CUBLAS_OP_N else p.k),
            "ldb": max(1, p.k if p.transb == gemm.CUBLAS_OP_N else p.n),
            "ldc": max(1, p.m)}
    for name, low in need.items():
        if getattr(p, name) < low:
            raise ValueError(f"{name}={getattr(p, name)} < {low}")
    ab = _NAMES.get(p.atype)
    if p.atype != p.btype or _NAMES.get(p.ctype) not in SUPPORTED.get((ab, p.compute), ()):
        raise ValueError(f"types A {p.atype} B {p.btype} C {p.ctype} compute {p.compute}: "
                         "not supported")


def scalar(x, compute):
    """A host scalar read as cuBLAS reads it: the scale type's width from x's first byte."""
    dtype = gemm.scale_dtype(compute)
    raw = x.tobytes()
    if len(raw) < dtype.itemsize:
        raise IndexError(f"a {dtype.name} scalar read from a {len(raw)}-byte buffer")
    return np.frombuffer(raw[:dtype.itemsize], dtype)[0]


def _index(mem, offset, rows, cols, ld):
    """The flat indices of a column-major (rows x cols) matrix at offset with ld."""
    idx = offset + np.arange(rows)[:, None] + np.arange(cols)[None, :] * ld
    if idx.size and (idx.min() < 0 or idx.max() >= mem.size):
        raise IndexError(f"matrix {rows}x{cols} ld {ld} at {offset} outside {mem.size} "
                         "elements")
    return idx


def _op(mem, offset, trans, rows, cols, ld, acc):
    """op(X) (rows x cols) of the matrix stored at offset: X itself, or X^T stored."""
    if trans == gemm.CUBLAS_OP_N:
        return mem[_index(mem, offset, rows, cols, ld)].astype(acc)
    return mem[_index(mem, offset, cols, rows, ld)].astype(acc).T


def run(p):
    """Execute plan p on numpy arrays (writes p.C); returns p.C."""
    check_arguments(p)
    acc = gemm.scale_dtype(p.compute)
    alpha, beta = scalar(p.alpha, p.compute), scalar(p.beta, p.compute)
    mem_a, mem_b, mem_c = memory(p.A), memory(p.B), memory(p.C)
    for i in range(p.batch):
        op_a = _op(mem_a, i * p.strideA, p.transa, p.m, p.k, p.lda, acc)
        op_b = _op(mem_b, i * p.strideB, p.transb, p.k, p.n, p.ldb, acc)
        idx = _index(mem_c, i * p.strideC, p.m, p.n, p.ldc)
        c = alpha * (op_a @ op_b)
        if beta != 0:                        # beta == 0: C is not read (it may hold NaN)
            c += beta * mem_c[idx].astype(acc)
        mem_c[idx] = c.astype(mem_c.dtype)
    return p.C
