"""The fused kernels of minidist/autograd/cuda_source_fusions.py (bias+GELU, residual+layer
norm, cross-entropy over a padded vocabulary) RUN on the CPU (tests/cuda_cpu.py) against
the xp code (bias add then fused.gelu; x + r then fused.layer_norm; the xp path of
fusions.padded_cross_entropy: -inf padding, then fused.cross_entropy's code) in float64,
forward and gradients, in float16, bfloat16, float32 and float64, both thread orders;
broken variants that must fail; the plans' argument types; nvcc compiles them where installed.
Run: python -m pytest -q tests/test_cuda_fusions_cpu.py   (skips without a C++ compiler)
"""
import functools

import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import cuda_kernels as ck, cuda_kernels_new as ckn
from minidist.autograd import cuda_source as cs, fused as F, fusions
from minidist.autograd.cuda_source_fusions import FUSIONS
from test_cuda_kernels_cpu import (DTYPES, ORDERS, assert_declared_types, close, f64,
                                   failing_orders, grads, nth_replaced, rand)

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))


def check_bias_gelu(dtype, shape=(3, 7, 33), src=None, order="low"):
    x, b, g = rand(dtype, *shape) * 2, rand(dtype, shape[-1], seed=1), rand(dtype, *shape, seed=2)
    plan, y = ckn.bias_gelu_fwd_launch(np, x, b)
    plan_b, dx = ckn.bias_gelu_bwd_launch(np, x, b, g)
    y[...], dx[...] = np.nan, np.nan
    cuda_cpu.run(plan, src, order)
    cuda_cpu.run(plan_b, src, order)
    want, (dx_want, db_want) = grads(lambda a, c: F.gelu(a + c), [x, b], g)
    close(y, want, dtype, "bias_gelu_fwd")
    close(dx, dx_want, dtype, "bias_gelu_bwd dx")
    close(f64(dx).reshape(-1, shape[-1]).sum(0), db_want, dtype, "bias_gelu_bwd db")


def check_ln_residual(dtype, shape=(3, 5, 37), bias=True, src=None, order="low"):
    C = shape[-1]
    x, r, gy, gs = (rand(dtype, *shape, seed=s) for s in range(4))
    w, b = rand(dtype, C, seed=4), rand(dtype, C, seed=5)
    plan, (s, y, wc, mean, rstd) = ckn.ln_residual_fwd_launch(np, x, r, w, b if bias else None,
                                                              1e-5)
    s[...], y[...] = np.nan, np.nan
    cuda_cpu.run(plan, src, order)
    s_want = (x + r).astype(np.float64)           # the xp code adds in the storage dtype
    close(s, s_want, dtype, "ln_residual_fwd s")
    inputs = [s_want, w, b] if bias else [s_want, w]
    y_want, (ds_ln, *dwb) = grads(lambda *t: F.layer_norm(*t, eps=1e-5), inputs, gy)
    close(y, y_want, dtype, "ln_residual_fwd y")
    plan_x, dx = ckn.ln_residual_bwd_x_launch(np, gy, gs, s, wc, mean, rstd)
    plan_wb, (dw, db) = ck.ln_bwd_wb_launch(np, gy.reshape(-1, C), s.reshape(-1, C), mean, rstd)
    dx[...] = np.nan
    cuda_cpu.run(plan_x, src, order)
    cuda_cpu.run(plan_wb, cs.source(dtype), order)               # the existing kernel
    close(dx, ds_ln + f64(gs), dtype, "ln_residual_bwd_x dx (= dr)")
    close(dw.sum(0), dwb[0], "float32", "dw")
    if bias:
        close(db.sum(0), dwb[1], "float32", "db")


def check_ce_pad(dtype, N=7, V=1001, Vp=1024, src=None, order="low"):
    z = rand(dtype, N, Vp) * 3
    t = np.random.default_rng(4).integers(0, V, N)
    t[1], t[-1] = -1, V - 1
    plan, (zc, tc, lse, rows) = ckn.ce_pad_fwd_launch(np, z, t, V, -1)
    lse[...], rows[...] = np.nan, np.nan
    cuda_cpu.run(plan, src, order)
    n = np.maximum((tc != -1).sum(), 1).astype(lse.dtype)
    want, (dz_want,) = grads(lambda a: fusions.padded_cross_entropy(a, t, V),
                             [z], np.float64(0.5))
    close(rows.sum() / n, want, "float32", "ce_pad_fwd loss")
    plan_b, dz = ckn.ce_pad_bwd_launch(np, np.float64(0.5), (zc, tc, lse, n), V, -1)
    dz[...] = np.nan
    cuda_cpu.run(plan_b, src, order)
    close(dz, dz_want, dtype, "ce_pad_bwd dz")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernels_equal_the_xp_code(dtype, order):
    """Odd sizes (693 values in blocks of 256; rows of 37 and 33), the widest block (rows of
    2049: 1024 threads striding), no bias, a vocabulary padded 1001 -> 1024 and 5 -> 64
    (a block of 32 threads over 64 columns: the padding is written by lanes that read
    nothing)."""
    check_bias_gelu(dtype, (3, 7, 33), order=order)
    check_ln_residual(dtype, (3, 5, 37), True, order=order)
    check_ln_residual(dtype, (2, 2049), True, order=order)
    check_ln_residual(dtype, (4, 33), False, order=order)
    check_ce_pad(dtype, 7, 1001, 1024, order=order)
    check_ce_pad(dtype, 3, 5, 64, order=order)


BROKEN = {   # name -> (check, old, new, occurrence) in the fusions' text
    "bias_gelu adds the bias of the wrong column": (check_bias_gelu, "ld(b, i % C)",
                                                    "ld(b, (i + 1) % C)", 0),
    "ln_residual_fwd normalises x, not x + r": (check_ln_residual, "sum += ld(s, off + c)",
                                                "sum += ld(x, off + c)", 0),
    "ln_residual_bwd_x forgets the residual's gradient": (check_ln_residual,
                                                          "ld(gs, off + c) + rd", "rd", 0),
    "ce_pad_fwd reads the padding": (check_ce_pad, "lse, loss, V, ignore);",
                                     "lse, loss, Vp, ignore);", 0),
    "ce_pad_bwd writes softmax into the padding": (check_ce_pad, "c < V ? k", "c < Vp ? k", 0),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_fused_kernel_fails(name):
    check, old, new, n = BROKEN[name]
    src = cs.source("float32", "fusions").replace(FUSIONS, nth_replaced(FUSIONS, old, new, n))
    failed = failing_orders(functools.partial(check, "float32"), src)
    assert failed, f"{name}: the broken kernel passed in both orders"


def _plans(dtype):
    a = lambda *shape: rand(dtype, *shape)              # noqa: E731
    x, w = a(3, 37), a(37)
    p_ln, (s, _, wc, mean, rstd) = ckn.ln_residual_fwd_launch(np, x, x, w, w, 1e-5)
    p_ce, (z, t, lse, _) = ckn.ce_pad_fwd_launch(np, a(4, 64), np.arange(4), 50, -1)
    n = np.ones((), lse.dtype)
    return [ckn.bias_gelu_fwd_launch(np, x, w)[0], ckn.bias_gelu_bwd_launch(np, x, w, x)[0],
            p_ln, ckn.ln_residual_bwd_x_launch(np, x, x, s, wc, mean, rstd)[0], p_ce,
            ckn.ce_pad_bwd_launch(np, np.float32(1), (z, t, lse, n), 50, -1)[0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_plans_hand_each_kernel_its_declared_types(dtype):
    assert_declared_types(_plans(dtype), dtype, "fusions")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvcc_compiles_the_fused_kernels(dtype, tmp_path):
    """Where a CUDA toolkit is installed (no GPU needed)."""
    assert ".entry" in cuda_cpu.nvcc_ptx(cs.source(dtype, "fusions"), tmp_path)
