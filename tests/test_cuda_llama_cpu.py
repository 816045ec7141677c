"""Llama's block's CUDA kernels (minidist/autograd/cuda_source_llama.py: RMSNorm, SwiGLU,
RoPE) RUN on the CPU (tests/cuda_cpu.py) through the glue llama_ops.py calls
(minidist/autograd/cuda_kernels_llama.py), against llama_ops.py's xp code in float64, forward
and gradients, in float16, bfloat16, float32 and float64, both thread orders; broken variants
that must fail; the plans' argument types; nvcc compiles them where installed.
Run: python -m pytest -q tests/test_cuda_llama_cpu.py   (skips without a C++ compiler)
"""
import functools

import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import cuda_kernels as ck, cuda_kernels_llama as ckl
from minidist.autograd import cuda_source as cs, llama_ops as LL
from minidist.autograd.cuda_source_llama import LLAMA
from test_cuda_kernels_cpu import (DTYPES, ORDERS, assert_declared_types, close, f64,
                                   failing_orders, grads, nth_replaced, rand)

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))


def runner(src, order):
    """run(plan) on the harness: Llama's kernels from `src` (a broken variant) if given, any
    other (ln_bwd_wb, RMSNorm's dw) from its own part."""
    def run(plan):
        mine = src is not None and cs.part_of(plan.name) == "llama"
        cuda_cpu.run(plan, src if mine else None, order)
    return run


def check_rms(dtype, shape=(3, 5, 37), src=None, order="low"):
    C = shape[-1]
    x, w, g = rand(dtype, *shape), rand(dtype, C, seed=1), rand(dtype, *shape, seed=2)
    run = runner(src, order)
    y, saved = ckl.rms_norm(np, run, x, w, 1e-5)
    dx, dw = ckl.rms_norm_backward(np, run, g, saved, (True, True))
    want, (dx_want, dw_want) = grads(lambda a, b: LL.rms_norm(a, b, 1e-5), [x, w], g)
    close(y, want, dtype, "rms_fwd y")
    close(dx, dx_want, dtype, "rms_bwd_x dx")
    close(dw, dw_want, dtype, "dw (ln_bwd_wb over a zero mean, cast to w's dtype)")
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert saved[2].dtype == ck.acc_dtype(x.dtype)                 # rstd accumulates


def check_swiglu(dtype, shape=(3, 7, 2 * 33), src=None, order="low"):
    h = rand(dtype, *shape) * 3                                   # a << 0: exp(-a) = inf
    h.flat[0] = -100.0
    g = rand(dtype, *shape[:-1], shape[-1] // 2, seed=1)
    run = runner(src, order)
    y = ckl.swiglu(np, run, h)
    dh = ckl.swiglu_backward(np, run, h, g)
    want, (dh_want,) = grads(LL.swiglu, [h], g)
    close(y, want, dtype, "swiglu_fwd")
    close(dh, dh_want, dtype, "swiglu_bwd")


def check_rope(dtype, B=2, T=6, nh=4, nkv=2, hs=8, src=None, order="low"):
    """Scattered positions (a cp rank's zig-zag chunks), grouped-query widths, in place."""
    pos, theta = np.array([0, 1, 10, 11, 5, 3]), 500.0
    qkv = rand(dtype, B, T, (nh + 2 * nkv) * hs)
    g = rand(dtype, B, T, (nh + 2 * nkv) * hs, seed=1)
    tables = LL.rotary_tables(np, pos, hs, theta, ck.acc_dtype(qkv.dtype))
    run = runner(src, order)
    fresh = qkv.copy()
    y = ckl.rotary(np, run, fresh, nh + nkv, hs, tables)
    assert y is fresh                                             # turned in place
    dq = ckl.rotary_backward(np, run, g, nh + nkv, hs, tables)
    want, (dq_want,) = grads(lambda a: LL.rotary(a * 1.0, nh, nkv, pos, theta), [qkv], g)
    close(y, want, dtype, "rope forward")
    close(dq, dq_want, dtype, "rope backward")
    np.testing.assert_array_equal(f64(y)[..., (nh + nkv) * hs:], f64(qkv)[..., (nh + nkv) * hs:])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_kernels_equal_the_xp_code(dtype, order):
    """Rows of 37 (blocks of 64 threads, some idle) and 2049 (1024 threads striding), 693
    SwiGLU outputs (blocks of 256), RoPE under grouped-query and multi-query widths."""
    check_rms(dtype, (3, 5, 37), order=order)
    check_rms(dtype, (2, 2049), order=order)
    check_swiglu(dtype, (3, 7, 66), order=order)
    check_rope(dtype, order=order)
    check_rope(dtype, B=1, T=6, nh=2, nkv=1, hs=4, order=order)


BROKEN = {   # name -> (check, old, new, occurrence) in LLAMA's text
    "rms_bwd_x drops rstd's term": (check_rms, "- xh * m", "", 0),
    "rms_fwd keeps no rstd": (check_rms, "rstd[blockIdx.x] = rd", "rstd[blockIdx.x] = 1", 0),
    "swiglu_fwd forgets the up half": (check_swiglu, "st(y, i, s * a * b)",
                                       "st(y, i, s * a)", 0),
    "swiglu_bwd writes db into the gate's half": (check_swiglu, "st(dh, o + F, silu * gv)",
                                                  "st(dh, o, silu * gv)", 0),
    "rope turns the wrong way": (check_rope, "x1 * c - x2 * s", "x1 * c + x2 * s", 0),
    "rope takes every row's angle from position 0": (check_rope, "t = row % Tn", "t = 0", 0),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_llama_kernel_fails(name):
    check, old, new, n = BROKEN[name]
    src = cs.source("float32", "llama").replace(LLAMA, nth_replaced(LLAMA, old, new, n))
    failed = failing_orders(functools.partial(check, "float32"), src)
    assert failed, f"{name}: the broken kernel passed in both orders"


def _plans(dtype):
    x, w = rand(dtype, 3, 37), rand(dtype, 37)
    p_fwd, (_, (xc, wc, rstd)) = ckl.rms_fwd_launch(np, x, w, 1e-5)
    h = rand(dtype, 3, 8)
    qkv = rand(dtype, 1, 2, 16)
    tables = LL.rotary_tables(np, np.arange(2), 4, 1e4, ck.acc_dtype(qkv.dtype))
    return [p_fwd, ckl.rms_bwd_x_launch(np, x, xc, wc, rstd)[0],
            ckl.swiglu_fwd_launch(np, h)[0], ckl.swiglu_bwd_launch(np, h, h[:, :4])[0],
            ckl.rope_launch(np, qkv, qkv, tables, 3, 4, 1.0)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_plans_hand_each_kernel_its_declared_types(dtype):
    assert_declared_types(_plans(dtype), dtype, "llama")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvcc_compiles_the_llama_kernels(dtype, tmp_path):
    """Where a CUDA toolkit is installed (no GPU needed)."""
    assert ".entry" in cuda_cpu.nvcc_ptx(cs.source(dtype, "llama"), tmp_path)


# ---- on a GPU (pytest -m gpu --device cuda): the kernels llama_ops.py launches there ---------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_ops_on_a_gpu_equal_the_xp_code(cupy_new, dtype):
    """Each op's output and gradients by the kernels (cupy) against the xp code (numpy); a
    Llama GPT with the kernels on against off: tests/test_fusions.py."""
    from minidist.autograd.tensor import Tensor
    pos = np.array([0, 1, 10, 11, 5, 3])
    cases = [(lambda a, b: LL.rms_norm(a, b), [rand(dtype, 4, 6, 96), rand(dtype, 96, seed=1)]),
             (LL.swiglu, [rand(dtype, 4, 6, 192) * 3]),
             (lambda a: LL.rotary(a * 1.0, 4, 2, pos, 500.0), [rand(dtype, 2, 6, 64)])]
    for fn, arrays in cases:
        outs = []
        for xp in (cupy_new, np):
            ts = [Tensor(xp.asarray(a), requires_grad=True) for a in arrays]
            y = fn(*ts)
            g = xp.asarray(rand(dtype, *y.shape, seed=7))
            (y * Tensor(g)).sum().backward()
            outs.append([cupy_new.asnumpy(a) if xp is cupy_new else a
                         for a in [y.data] + [t.grad for t in ts]])
        for i, (a, c) in enumerate(zip(*outs)):
            close(a, c, dtype, f"{getattr(fn, '__name__', 'op')} #{i} on cupy")
