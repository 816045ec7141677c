"""minidist/gemm.py's cuBLAS strided-batched GEMM plans, proven on the CPU: every plan, executed
by tests/cublas_cpu.py (cuBLAS's documented column-major semantics on the raw memory), must
give np.matmul, for every shape the model makes; broken plans must fail; the enum values must
be the CUDA headers'. The `gpu` test makes the real call (no GPU has run it yet):

    python -m pytest -q tests/test_gemm.py
    MINIDIST_CUDA_NEW_KERNELS=1 python -m pytest -m gpu --device cuda tests/test_gemm.py
"""
import glob
import os
import re
import shutil
import sys

import numpy as np
import pytest

import cublas_cpu
from minidist import gemm
from minidist.autograd.attention import heads_view

ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 on numpy needs ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
N, T = gemm.CUBLAS_OP_N, gemm.CUBLAS_OP_T


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def maker(xp=np, dtype=np.float64):
    """rand(...) as an xp array of dtype: the cases build the same views on numpy and cupy."""
    return lambda *shape, seed=0: xp.asarray(rand(*shape, seed=seed).astype(dtype))


def _qkv(r):
    """q, k, v (2, 3, 7, 4) as GPT makes them: views into one (B, T, 3C) activation."""
    return heads_view(r(2, 7, 3 * 12, seed=3), 3)


def _attn(r):
    q, k, v = (r(2, 3, 7, 4, seed=s) for s in range(3))
    return q, k, v, r(2, 3, 7, 7, seed=4), r(2, 3, 7, 4, seed=5)   # q k v P g


# name -> (a, b, the operands of `a` and `b` that must reach cuBLAS without a copy)
CASES = {
    "square": lambda xp, r: (r(4, 5, 5), r(4, 5, 5, seed=1), "ab"),
    "non_square": lambda xp, r: (r(3, 4, 6), r(3, 6, 2, seed=1), "ab"),
    "k_is_1": lambda xp, r: (r(3, 4, 1), r(3, 1, 5, seed=1), "ab"),
    "n_is_1": lambda xp, r: (r(3, 1, 6), r(3, 6, 5, seed=1), "ab"),
    "m_is_1": lambda xp, r: (r(3, 4, 6), r(3, 6, 1, seed=1), "ab"),
    "one_by_one": lambda xp, r: (r(2, 1, 1), r(2, 1, 1, seed=1), "ab"),
    "two_d": lambda xp, r: (r(5, 3), r(3, 4, seed=1), "ab"),
    "five_d": lambda xp, r: (r(2, 2, 2, 3, 4), r(2, 2, 2, 4, 3, seed=1), "ab"),
    "shared_weight": lambda xp, r: (r(4, 3, 5), r(5, 2, seed=1), "ab"),     # b: strideA 0
    "shared_left": lambda xp, r: (r(3, 5), r(4, 5, 2, seed=1), "ab"),       # a: strideB 0
    "broadcast_batch": lambda xp, r: (r(2, 1, 4, 3), r(5, 3, 2, seed=1), ""),
    "broadcast_heads": lambda xp, r: (r(2, 3, 4, 5), r(1, 3, 5, 2, seed=1), "a"),  # (0, 10)
    "scores_q_kT": lambda xp, r: (_attn(r)[0], _attn(r)[1].swapaxes(-1, -2), "ab"),
    "y_P_v": lambda xp, r: (_attn(r)[3], _attn(r)[2], "ab"),
    "dP_g_vT": lambda xp, r: (_attn(r)[4], _attn(r)[2].swapaxes(-1, -2), "ab"),
    "dv_PT_g": lambda xp, r: (_attn(r)[3].swapaxes(-1, -2), _attn(r)[4], "ab"),
    "dq_dS_k": lambda xp, r: (_attn(r)[3], _attn(r)[1], "ab"),
    "dk_dST_q": lambda xp, r: (_attn(r)[3].swapaxes(-1, -2), _attn(r)[0], "ab"),
    "gb_aT_g": lambda xp, r: (_attn(r)[0].swapaxes(-1, -2), _attn(r)[4], "ab"),   # hs x hs
    "gpt_heads_q_kT": lambda xp, r: (_qkv(r)[0], _qkv(r)[1].swapaxes(-1, -2), ""),
    "gpt_heads_P_v": lambda xp, r: (_attn(r)[3], _qkv(r)[2], "a"),
    "flash_tiles": lambda xp, r: (_attn(r)[0][..., 2:6, :],
                                  _attn(r)[1][..., 1:5, :].swapaxes(-1, -2), "ab"),
    "flash_dv_tile": lambda xp, r: (_attn(r)[3][..., 2:6, 1:5].swapaxes(-1, -2),
                                    _attn(r)[4][..., 2:6, :], "ab"),
    "column_slice": lambda xp, r: (r(3, 4, 6)[..., 1:4], r(3, 3, 5, seed=1), "ab"),
    "interleaved": lambda xp, r: (xp.asfortranarray(r(3, 4, 6)), r(3, 6, 2, seed=1), "b"),
    "negative_strides": lambda xp, r: (r(3, 4, 6)[:, ::-1], r(3, 6, 2, seed=1)[..., ::-1], ""),
    "zero_row_stride": lambda xp, r: (xp.broadcast_to(r(3, 1, 6), (3, 4, 6)),
                                      r(3, 6, 2, seed=1), "b"),
}


def execute(p):
    """Run a plan through the interpreter with C poisoned first (unwritten parts show)."""
    p.C[...] = np.nan
    return cublas_cpu.run(p)


@pytest.mark.parametrize("name", CASES)
def test_plans_executed_as_cublas_reads_them_equal_np_matmul(name):
    """float64 (compute 64F): the interpreted call = np.matmul; no copy where none is needed."""
    a, b, in_place = CASES[name](np, maker())
    p, c = gemm.plan(np, a, b)
    assert execute(p) is c and c.shape == np.matmul(a, b).shape and c.flags.c_contiguous
    np.testing.assert_allclose(c, np.matmul(a, b), rtol=1e-12, atol=1e-12)
    assert np.shares_memory(p.B, a) == ("a" in in_place), "a copied (or not) unexpectedly"
    assert np.shares_memory(p.A, b) == ("b" in in_place), "b copied (or not) unexpectedly"


def test_the_attention_scores_plan_is_the_measured_one():
    """S = q k^T, k given as k.swapaxes(-1, -2): transa=T, transb=N, m=n=T, k=hs,
    lda=ldb=hs, ldc=T, strides T*hs, T*hs, T*T over B*nh; a weight shared by the batch and a
    broadcast left operand get stride 0."""
    q, k = _attn(maker())[:2]
    p, _ = gemm.plan(np, q, k.swapaxes(-1, -2))
    assert (p.transa, p.transb, p.m, p.n, p.k, p.lda, p.ldb, p.ldc) == (T, N, 7, 7, 4, 4, 4, 7)
    assert (p.strideA, p.strideB, p.strideC, p.batch) == (28, 28, 49, 6)
    assert gemm.plan(np, rand(4, 3, 5), rand(5, 2))[0].strideA == 0
    assert gemm.plan(np, rand(3, 5), rand(4, 5, 2))[0].strideB == 0


def test_matrix_layouts_and_batch_strides_by_hand():
    """Row-major -> OP_N with ld = row stride; column-major -> OP_T with ld = column stride;
    strides along size-1 dims ignored; a batch walked by one stride, 0 when broadcast."""
    assert gemm.matrix_layout(4, 6, 6, 1) == (N, 6) and gemm.matrix_layout(4, 6, 9, 1) == (N, 9)
    assert gemm.matrix_layout(4, 6, 1, 4) == (T, 4) and gemm.matrix_layout(1, 6, 99, 1) == (N, 6)
    assert gemm.matrix_layout(4, 1, 1, 99) == (N, 1) and gemm.matrix_layout(1, 6, 0, 3) == (T, 3)
    for bad in [(4, 6, 0, 1), (4, 6, 3, 1), (4, 6, 1, 3), (4, 6, -6, 1), (4, 6, 12, 2)]:
        assert gemm.matrix_layout(*bad) is None, bad
    assert gemm.batch_stride((2, 3), (12, 4)) == 4 and gemm.batch_stride((2, 3), (0, 0)) == 0
    assert gemm.batch_stride((2, 1, 3), (12, 77, 4)) == 4 and gemm.batch_stride((), ()) == 0
    for bad in [((2, 3), (12, 0)), ((2, 3), (0, 4)), ((2, 3), (13, 4)), ((2,), (-5,))]:
        assert gemm.batch_stride(*bad) is None, bad


TYPES = {   # case -> (dtype, tf32, data type code, compute type, alpha/beta dtype)
    "float16": (np.float16, False, 2, 68, np.float32),
    "bfloat16": (BF16, False, 14, 68, np.float32),
    "float32": (np.float32, False, 0, 68, np.float32),
    "float32_tf32": (np.float32, True, 0, 77, np.float32),
    "float64": (np.float64, False, 1, 70, np.float64),
}


@pytest.mark.parametrize("case", TYPES)
def test_type_codes_compute_types_and_scalars(case):
    """Each dtype's cudaDataType code on A, B, C, its cublasComputeType (16-bit in, float32
    accumulate) and alpha = 1, beta = 0 as host scalars of the compute's type; the
    interpreted product = the float32 (float64) product rounded once to the dtype."""
    dtype, tf32, code, compute, scale = TYPES[case]
    q, k = _attn(maker(np, dtype))[:2]
    p, c = gemm.plan(np, q, k.swapaxes(-1, -2), gemm.compute_type(dtype, tf32))
    assert (p.atype, p.btype, p.ctype, p.compute) == (code, code, code, compute)
    assert p.alpha.dtype == scale and p.beta.dtype == scale and (p.alpha, p.beta) == (1, 0)
    acc = np.float64 if dtype == np.float64 else np.float32
    want = np.matmul(q.astype(acc), k.swapaxes(-1, -2).astype(acc))
    ulp = {2: 2.0 ** -11, 14: 2.0 ** -8}.get(code, 1e-6)
    np.testing.assert_allclose(execute(p).astype(acc), want, rtol=ulp, atol=ulp)


BROKEN = {   # name -> a wrong plan (cases where each number matters: n=7, m=9, k=4)
    "lda + 1": lambda p: p._replace(lda=p.lda + 1),
    "ldb + 1": lambda p: p._replace(ldb=p.ldb + 1),
    "ldc + 1": lambda p: p._replace(ldc=p.ldc + 1),
    "transa flipped": lambda p: p._replace(transa=1 - p.transa),
    "transb flipped": lambda p: p._replace(transb=1 - p.transb),
    "m and n swapped": lambda p: p._replace(m=p.n, n=p.m),
    "k - 1": lambda p: p._replace(k=p.k - 1),
    "A and B swapped": lambda p: p._replace(A=p.B, B=p.A),
    "alpha float32 for 64F": lambda p: p._replace(alpha=np.array(1.0, np.float32)),
    "C typed float32": lambda p: p._replace(ctype=gemm.DATA_TYPES["float32"]),
    # these only show over several matrices
    "strideA 0": lambda p: p._replace(strideA=0),
    "strideB + hs": lambda p: p._replace(strideB=p.strideB + 4),
    "batch - 1": lambda p: p._replace(batch=p.batch - 1),
}
BATCH_LEVEL = ("strideA 0", "strideB + hs", "batch - 1")


@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "padded"])
@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_plan_fails(name, padded):
    """Each wrong number gives a wrong product, a read past an operand, or cuBLAS's
    INVALID_VALUE / NOT_SUPPORTED: the interpreter cannot be passed by a wrong plan. Padded:
    q and k are blocks of larger arrays, so most wrong reads land inside memory (and give
    wrong numbers rather than an IndexError)."""
    q, k = rand(2, 3, 7, 4), rand(2, 3, 9, 4, seed=1)
    if padded:
        q = np.pad(q, [(0, 1), (0, 0), (0, 3), (0, 5)])[:2, :, :7, :4]
        k = np.pad(k, [(0, 1), (0, 0), (0, 3), (0, 5)])[:2, :, :9, :4]
    want = np.matmul(q, k.swapaxes(-1, -2))
    p, c = gemm.plan(np, q, k.swapaxes(-1, -2))
    np.testing.assert_allclose(execute(p), want, rtol=1e-12)      # the plan itself is right
    broken = BROKEN[name](p)
    runs = [(broken, 6)] + ([] if name in BATCH_LEVEL else [(broken._replace(batch=1), 1)])
    for bp, count in runs:               # the first batch alone: reads that stay in memory
        try:
            got = execute(bp).reshape(6, 7, 9)[:count]
        except (ValueError, IndexError):
            continue
        assert not np.allclose(got, want.reshape(6, 7, 9)[:count]), f"{name} passed"


def test_alpha_of_the_wrong_width_reads_wrong_numbers():
    """A float64 1.0 handed to a float32-scaled call is read as its low 4 bytes: 0.0."""
    q, k = _attn(maker(np, np.float16))[:2]
    p, _ = gemm.plan(np, q, k.swapaxes(-1, -2))
    assert np.all(execute(p._replace(alpha=np.array(1.0, np.float64))) == 0)


def test_the_argument_checks_are_cublas_documented_ones():
    p, _ = gemm.plan(np, rand(2, 5, 3), rand(2, 3, 4, seed=1))      # m=4, n=5, k=3, all N
    for bad in (dict(lda=3), dict(ldb=2), dict(ldc=3), dict(m=-1), dict(batch=-1),
                dict(transa=2), dict(compute=gemm.CUBLAS_COMPUTE_32F)):
        with pytest.raises(ValueError):
            cublas_cpu.check_arguments(p._replace(**bad))
    cublas_cpu.check_arguments(p._replace(transa=T, lda=3))         # T: lda >= k is enough


def test_chosen_only_with_the_flag_for_16_bit_or_tf32_batched(monkeypatch):
    """backend.matmul's test (it also checks for cupy): off by default; float16/bfloat16
    batched -> 32F; float32 only under MINIDIST_TF32=1 -> 32F_FAST_TF32; float64, 2-D,
    1-D, mixed dtypes and empty operands keep the default path."""
    a3, a2 = np.zeros((2, 3, 4), np.float16), np.zeros((4, 5), np.float16)
    monkeypatch.delenv("MINIDIST_CUDA_NEW_KERNELS", raising=False)
    monkeypatch.delenv("MINIDIST_TF32", raising=False)
    assert gemm.chosen(a3, a2) is None
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    assert gemm.chosen(a3, a2) == gemm.chosen(a3.astype(BF16), a2.astype(BF16)) == 68
    assert gemm.chosen(a3.astype(np.float32), a2.astype(np.float32)) is None
    assert gemm.chosen(a3.astype(np.float64), a2.astype(np.float64)) is None
    assert gemm.chosen(a3[0], a2) is None                               # 2-D @ 2-D
    assert gemm.chosen(a3, np.zeros(4, np.float16)) is None             # 1-D
    assert gemm.chosen(a3, a2.astype(np.float32)) is None               # mixed dtypes
    assert gemm.chosen(np.zeros((0, 3, 4), np.float16), a2) is None     # empty
    monkeypatch.setenv("MINIDIST_TF32", "1")
    assert gemm.chosen(a3.astype(np.float32), a2.astype(np.float32)) == 77


def _headers():
    """The include folders of an installed CUDA toolkit or cuBLAS wheel (none: [])."""
    dirs = glob.glob("/usr/local/cuda*/include")
    if shutil.which("nvcc"):
        dirs.append(os.path.join(os.path.dirname(os.path.realpath(shutil.which("nvcc"))),
                                 "..", "include"))
    for root in sys.path:
        dirs += glob.glob(os.path.join(root, "nvidia", "*", "include"))
    return dirs


def _enum(header, names):
    """{name: value} of `NAME = value` lines in the first header found (None: not found)."""
    for d in _headers():
        path = os.path.join(d, header)
        if os.path.exists(path):
            text = open(path).read()
            return {n: int(re.search(rf"\b{n}\s*=\s*(-?\d+)", text).group(1)) for n in names}
    return None


def test_type_codes_are_library_types_h():
    found = _enum("library_types.h", ["CUDA_R_32F", "CUDA_R_64F", "CUDA_R_16F", "CUDA_R_16BF"])
    if found is None:
        pytest.skip("no CUDA toolkit headers (library_types.h)")
    assert [found[n] for n in found] == [gemm.DATA_TYPES[d] for d in
                                         ("float32", "float64", "float16", "bfloat16")]


def test_cublas_enums_are_cublas_api_h():
    names = ["CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_COMPUTE_32F", "CUBLAS_COMPUTE_32F_FAST_TF32",
             "CUBLAS_COMPUTE_64F", "CUBLAS_GEMM_DEFAULT", "CUBLAS_POINTER_MODE_HOST"]
    found = _enum("cublas_api.h", names)
    if found is None:
        pytest.skip("no cuBLAS headers (cublas_api.h; the toolkit here has none)")
    assert found == {n: getattr(gemm, n) for n in names}


# cuBLAS's and CUDA's enum values as their headers give them, copied by hand from CuPy's
# cupy_backends/cuda/libs/cublas.pxd (v13, v14; it mirrors cublas_api.h) and CUDA's
# library_types.h: a source other than gemm.py, for machines with no headers (the tests above
# skip there, and the CPU executor reads gemm.py's own values, so a wrong one passed them)
DOCUMENTED = {"CUBLAS_OP_N": 0, "CUBLAS_OP_T": 1, "CUBLAS_COMPUTE_32F": 68,
              "CUBLAS_COMPUTE_32F_FAST_TF32": 77, "CUBLAS_COMPUTE_64F": 70,
              "CUBLAS_GEMM_DEFAULT": -1, "CUBLAS_POINTER_MODE_HOST": 0}
DOCUMENTED_TYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 14}  # CUDA_R_*


def test_the_enums_are_the_documented_values():
    assert {n: getattr(gemm, n) for n in DOCUMENTED} == DOCUMENTED
    assert gemm.DATA_TYPES == DOCUMENTED_TYPES


GPU_TOL = {"float32": 1e-5, "float32_tf32": 1e-2, "float16": 2e-3, "bfloat16": 8e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_TOL)
def test_the_real_call_on_a_gpu_equals_cupy_matmul(device, case, monkeypatch):
    """For the GPU session that confirms it: the enums are cupy_backends' own, and every CASE
    through gemm.run and through backend.matmul (MINIDIST_CUDA_NEW_KERNELS=1) = cupy.matmul
    of float64 copies, to the dtype's tolerance relative to the largest entry
    (MINIDIST_CUDA_NEW_KERNELS=1 python -m pytest -m gpu --device cuda tests/test_gemm.py)."""
    if device != "cuda":
        pytest.skip("needs --device cuda")
    import cupy
    from cupy_backends.cuda.api import runtime
    from cupy_backends.cuda.libs import cublas
    from minidist import backend
    from minidist.train.amp import half_dtype
    # CuPy 13's runtime has no CUDA_R_16BF (v13.6.0 cupy_backends/cuda/api/_runtime_enum.pxd;
    # v14.0.1 has it): there test_type_codes_are_library_types_h checks bfloat16's code
    codes = {"32F": "float32", "64F": "float64", "16F": "float16", "16BF": "bfloat16"}
    for n, d in codes.items():
        assert getattr(runtime, f"CUDA_R_{n}", gemm.DATA_TYPES[d]) == gemm.DATA_TYPES[d], n
    for n in ("CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_COMPUTE_32F", "CUBLAS_COMPUTE_64F",
              "CUBLAS_COMPUTE_32F_FAST_TF32", "CUBLAS_GEMM_DEFAULT", "CUBLAS_POINTER_MODE_HOST"):
        assert getattr(cublas, n) == getattr(gemm, n), n
    dtype, tf32 = TYPES[case][:2]
    if dtype == BF16 and half_dtype(cupy) != BF16:
        pytest.skip("this CuPy holds no bfloat16 arrays (CuPy 13; CuPy 14 needs ml_dtypes and "
                    "NumPy >= 2.1.2)")
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    monkeypatch.setenv("MINIDIST_TF32", "1" if tf32 else "0")
    for name, make in CASES.items():
        a, b, _ = make(cupy, maker(cupy, dtype))          # the same views, on the GPU
        want = cupy.matmul(a.astype(cupy.float64), b.astype(cupy.float64))
        p, c = gemm.plan(cupy, a, b, gemm.compute_type(dtype, tf32))
        gemm.run(p)
        got = [c] + ([backend.matmul(a, b)] if gemm.chosen(a, b) is not None else [])
        for g in got:
            err = float(cupy.abs(g.astype(cupy.float64) - want).max() / cupy.abs(want).max())
            assert err < GPU_TOL[case], (name, err)
