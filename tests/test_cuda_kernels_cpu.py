"""Every CUDA kernel of minidist/autograd/cuda_source.py RUN on the CPU (tests/cuda_cpu.py:
the same source, g++, fibers for threads) against the numpy code it replaces, in float16,
bfloat16, float32 and float64, under both thread orders of the scheduler; and broken
variants of the kernels (a dropped __syncthreads, a short shuffle, an off-by-one loop),
made by text substitution, that the harness must catch.

References are the xp code on float64 copies of the (already rounded) inputs, so a kernel is
off only by its own float32 accumulation and its output rounding.
Run: python -m pytest -q tests/test_cuda_kernels_cpu.py   (skips without a C++ compiler)
"""
import functools
import math

import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import Tensor, attention, cuda_kernels as ck, cuda_source as cs
from minidist.autograd import fused as F
from minidist.optim import adamw_update

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))

DTYPES = ["float16", "bfloat16", "float32", "float64"]
ORDERS = ["low", "high"]
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def np_dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 on numpy needs ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def rand(dtype, *shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np_dtype(dtype))


def f64(a):
    """float64 of `a`; a broken variant's output may hold NaN bit patterns of a 16-bit type,
    whose cast numpy warns of: the comparison reports them, the warning adds nothing."""
    with np.errstate(invalid="ignore"):
        return np.asarray(a).astype(np.float64)


def close(got, want, dtype, what):
    """|got - want| <= tol (|want| + max|want|): relative to the element and to the array."""
    got, want = f64(got), f64(want)
    scale = max(np.abs(want).max(initial=0.0), 1.0)
    tol = TOL[cs.dtype_name(dtype)]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=what)


def grads(fn, inputs, g):
    """fn's output and d(sum(out * g))/d(inputs), in float64, through the numpy code."""
    ts = [Tensor(f64(a), requires_grad=True) for a in inputs]
    out = fn(*ts)
    (out * Tensor(f64(g))).sum().backward()
    return out.data, [t.grad for t in ts]


# ---- one check per kernel family: raises AssertionError (or KernelError) on a wrong answer --

def check_layer_norm(dtype, shape=(3, 5, 37), bias=True, src=None, order="low"):
    C = shape[-1]
    x, w, b, g = rand(dtype, *shape), rand(dtype, C, seed=1), rand(dtype, C, seed=2), \
        rand(dtype, *shape, seed=3)
    plan, (y, xc, wc, mean, rstd) = ck.ln_fwd_launch(np, x, w, b if bias else None, 1e-5)
    y[...], mean[...], rstd[...] = np.nan, np.nan, np.nan
    cuda_cpu.run(plan, src, order)
    inputs = [x, w, b] if bias else [x, w]
    want, dwant = grads(lambda *t: F.layer_norm(*t, eps=1e-5), inputs, g)
    close(y, want, dtype, "ln_fwd y")
    x2 = f64(x).reshape(-1, C)
    close(mean, x2.mean(-1), "float32", "ln_fwd mean")
    close(rstd, 1 / np.sqrt(x2.var(-1) + 1e-5), "float32", "ln_fwd rstd")
    g2 = g.reshape(-1, C)
    plan_x, dx = ck.ln_bwd_x_launch(np, g2, xc.reshape(-1, C), wc, mean, rstd)
    plan_wb, (dw_part, db_part) = ck.ln_bwd_wb_launch(np, g2, xc.reshape(-1, C), mean, rstd)
    dx[...], dw_part[...], db_part[...] = np.nan, np.nan, np.nan
    cuda_cpu.run(plan_x, src, order)
    cuda_cpu.run(plan_wb, src, order)
    close(dx.reshape(shape), dwant[0], dtype, "ln_bwd_x dx")
    close(dw_part.sum(0), dwant[1], "float32", "ln_bwd_wb dw")
    if bias:
        close(db_part.sum(0), dwant[2], "float32", "ln_bwd_wb db")


def check_cross_entropy(dtype, N=7, V=1001, src=None, order="low"):
    z = rand(dtype, N, V) * 3
    t = np.random.default_rng(4).integers(0, V, N)
    t[1], t[-1] = -1, V - 1                                   # an ignored row; the last id
    plan, (zc, tc, lse, rows) = ck.ce_fwd_launch(np, z, t, -1)
    lse[...], rows[...] = np.nan, np.nan
    cuda_cpu.run(plan, src, order)
    n = np.maximum((tc != -1).sum(), 1).astype(lse.dtype)
    want, (dz_want,) = grads(lambda a: F.cross_entropy(a, t), [z], np.float64(0.5))
    close(rows.sum() / n, want, "float32", "ce_fwd loss")
    close(lse, np.log(np.exp(f64(z)).sum(-1)), "float32", "ce_fwd lse")
    plan_b, dz = ck.ce_bwd_launch(np, np.float64(0.5), (zc, tc, lse, n), -1)
    dz[...] = np.nan
    cuda_cpu.run(plan_b, src, order)
    close(dz, dz_want, dtype, "ce_bwd dz")


def check_attn_softmax(dtype, BH=3, T=37, src=None, order="low"):
    S, dP, gy = rand(dtype, BH, T, T), rand(dtype, BH, T, T, seed=1), rand(dtype, BH, T, 1, seed=2)
    scale = 1 / math.sqrt(8)
    want = f64(S) * scale + attention.causal_bias(np, T, np.float64)   # attention.py's xp
    want = np.exp(want - want.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    P = S.copy()
    cuda_cpu.run(ck.attn_fwd_launch(P, scale), src, order)
    close(P, want, dtype, "attn_softmax_fwd P")
    dS = dP.copy()
    cuda_cpu.run(ck.attn_bwd_launch(np, dS, P, gy, scale), src, order)
    close(dS, f64(P) * (f64(dP) - f64(gy)) * scale, dtype,
          "attn_softmax_bwd dS")


def check_gelu(dtype, n=693, src=None, order="low"):
    x, g = rand(dtype, n) * 3, rand(dtype, n, seed=1)
    plan, y = ck.gelu_fwd_launch(np, x)
    plan_b, dx = ck.gelu_bwd_launch(np, x, g)
    y[...], dx[...] = np.nan, np.nan
    cuda_cpu.run(plan, src, order)
    cuda_cpu.run(plan_b, src, order)
    want, (dwant,) = grads(F.gelu, [x], g)
    close(y, want, dtype, "gelu_fwd")
    close(dx, dwant, dtype, "gelu_bwd")


def check_adamw(dtype, n=1000, src=None, order="low", step=3, wd=0.1):
    """The kernel equals adamw_update's xp code on the CPU bitwise (same operations, same
    order, each rounded to the dtype; g++ contracts no multiply-add here)."""
    p, g = rand(dtype, n), rand(dtype, n, seed=1)
    m, v = rand(dtype, n, seed=2) * 0.1, np.abs(rand(dtype, n, seed=3))
    got, want = [p.copy(), g, m.copy(), v.copy()], [p.copy(), g, m.copy(), v.copy()]
    cuda_cpu.run(ck.adamw_launch(*got, step, 0.01, 0.9, 0.95, 1e-8, wd), src, order)
    adamw_update(*want, step, 0.01, 0.9, 0.95, 1e-8, wd)
    for name, a, b in zip("pgmv", got, want):
        np.testing.assert_array_equal(a, b, err_msg=f"adamw_step {name}")


# ---- every kernel, every dtype, both orders ---------------------------------------------

@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_kernels(dtype, order):
    """Odd rows of 37 (a 64-thread block, two warps); 2049 columns (1024 threads, each
    striding 3 times: any length works, this is the longest block); no bias; 70 rows, so dw
    and db are summed over 3 row chunks of ln_bwd_wb."""
    check_layer_norm(dtype, (3, 5, 37), True, order=order)
    check_layer_norm(dtype, (2, 2049), True, order=order)
    check_layer_norm(dtype, (70, 33), False, order=order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_kernels(dtype, order):
    """V = 1001 (a 1024-thread block, 23 idle threads), V = 2500 (striding), V = 5 (one
    warp, 27 idle lanes); an ignored row and the last id."""
    check_cross_entropy(dtype, 7, 1001, order=order)
    check_cross_entropy(dtype, 2, 2500, order=order)
    check_cross_entropy(dtype, 4, 5, order=order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_softmax_kernels(dtype, order):
    """T = 37 and 70 (masked tails of many lengths); T = 1 (a one-column row). Rows longer
    than 1024 (striding) are the slow test below."""
    check_attn_softmax(dtype, 3, 37, order=order)
    check_attn_softmax(dtype, 1, 70, order=order)
    check_attn_softmax(dtype, 2, 1, order=order)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_softmax_rows_longer_than_a_block(dtype):
    check_attn_softmax(dtype, 1, 1100)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_kernels(dtype, order):
    """693 values: 3 blocks of 256, the last one partly idle; and 5 values."""
    check_gelu(dtype, 693, order=order)
    check_gelu(dtype, 5, order=order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_adamw_kernel_equals_adamw_update_bitwise(dtype, order):
    check_adamw(dtype, 1000, order=order)
    check_adamw(dtype, 7, order=order, step=1, wd=0.0)


# ---- broken kernels must fail -----------------------------------------------------------

def assert_declared_types(plans, dtype, part):
    """Each plan of `part`'s kernels hands every parameter what the source declares: T*
    arrays of `dtype`, A of its accumulation dtype, long long int64, int int32."""
    want = {"T": dtype, "A": ck.acc_dtype(dtype).name, "long long": "int64", "int": "int32"}
    for p in plans:
        params, args = cs.signature(p.name), ck.describe(p.args)
        assert cs.part_of(p.name) == part and len(params) == len(args), p.name
        for (ctype, pointer), arg in zip(params, args):
            assert arg[:2] == (("array" if pointer else "scalar"), want[ctype]), p.name


def nth_replaced(text, old, new, n):
    """text with the n-th (0-based) occurrence of `old` replaced by `new`."""
    parts = text.split(old)
    assert len(parts) > n + 1, f"{old!r} occurs {len(parts) - 1} times"
    return old.join(parts[:n + 1]) + new + old.join(parts[n + 1:])


def failing_orders(check, src):
    """The thread orders under which `check(src=src, order=...)` fails (a wrong answer, a
    guard write, a deadlock), each with the first line of its error."""
    failed = []
    for order in ORDERS:
        try:
            check(src=src, order=order)
        except (AssertionError, cuda_cpu.KernelError) as e:
            failed.append(f"{order}: {str(e).splitlines()[0][:80]}")
    return failed


BROKEN = {   # name -> (check, old, new, occurrence): one defect each
    "block_reduce without its first __syncthreads": (check_layer_norm, "__syncthreads();",
                                                     "", 0),
    "block_reduce without its second __syncthreads": (check_layer_norm, "__syncthreads();",
                                                      "", 1),
    "block_reduce without its third __syncthreads": (check_layer_norm, "__syncthreads();",
                                                     "", 2),
    "warp_reduce one shuffle short": (check_cross_entropy, "o > 0; o >>= 1", "o > 1; o >>= 1",
                                      0),
    "warp_reduce shuffles start at 8": (check_layer_norm, "int o = 16", "int o = 8", 0),
    "warp_reduce shuffles up, not across": (check_layer_norm, "__shfl_xor_sync(",
                                            "__shfl_up_sync(", 0),
    "ln_fwd reads one past the row": (check_layer_norm, "c < C; c += blockDim.x) s +=",
                                      "c <= C; c += blockDim.x) s +=", 0),
    "attention mask off by one": (check_attn_softmax, "j <= i ?", "j < i ?", 0),
    "gelu writes one past the end": (check_gelu, "i < n;", "i <= n;", 0),
    "__syncthreads under a condition": (check_layer_norm, "if (lane == 0) sh[w] = v;",
                                        "if (lane == 0) { sh[w] = v; __syncthreads(); }", 0),
    "adamw_step without the decay": (check_adamw, "ld(p, i) * decay", "ld(p, i)", 0),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_kernel_fails_its_check(name):
    """Each defect makes the kernel's check fail (a wrong answer, a guard write or a
    deadlock) under at least one of the two orders every kernel test runs in; the intact
    source passes the same checks (the tests above)."""
    check, old, new, n = BROKEN[name]
    src = nth_replaced(cs.source("float32"), old, new, n)
    failed = failing_orders(functools.partial(check, "float32"), src)
    assert failed, f"{name}: the broken kernel passed in both orders"
