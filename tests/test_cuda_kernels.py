"""CUDA kernels (minidist/autograd/cuda_kernels.py): each kernel against the generic xp code
on the same cupy arrays (MINIDIST_CUDA_KERNELS=1 vs 0), forward and backward, float32,
float16 and float64, odd sizes, ignored targets; one GPT training step on the GPU against
the CPU in float32; the cross-entropy step without a device-to-host sync.

Run on a GPU: python -m pytest -m gpu --device cuda tests/test_cuda_kernels.py
Without one, the gpu tests skip; the rest (imports, routing, source text) run everywhere,
and tests/test_cuda_kernels_cpu.py runs every kernel on the CPU (tests/cuda_cpu.py).
"""
import subprocess
import sys

import numpy as np
import pytest

import cuda_cpu
from minidist import backend
from minidist.autograd import Tensor, cuda_kernels as ck, cuda_source as cs, fused as F

TOL = {"float64": (1e-10, 1e-12), "float32": (2e-5, 2e-6), "float16": (2e-2, 2e-3),
       "bfloat16": (1.6e-1, 2e-2)}


# ---- everywhere: what each kernel is handed, planned with numpy arrays -------------------------

ml_dtypes = None
try:
    import ml_dtypes
except ImportError:
    pass

DTYPES = ["float16", "bfloat16", "float32", "float64"]
ACC = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}


def _np_dtype(name):
    if name == "bfloat16":
        if ml_dtypes is None:
            pytest.skip("bfloat16 on numpy needs ml_dtypes (pip install ml_dtypes)")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _plans(name):
    """Every kernel's launch for storage dtype `name`, planned with numpy arrays."""
    dt, r = _np_dtype(name), np.random.default_rng(0)
    a = lambda *shape: r.standard_normal(shape).astype(dt)           # noqa: E731
    x, w, b, g = a(3, 5, 37), a(37), a(37), a(3, 5, 37)
    ln, (_, xc, wc, mean, rstd) = ck.ln_fwd_launch(np, x, w, b, 1e-5)
    ce, (z, t, lse, _) = ck.ce_fwd_launch(np, a(2, 5, 11), T_ODD % 11, -1)
    n = np.maximum((t != -1).sum(), 1).astype(lse.dtype)
    S, gy = a(2, 3, 7, 7), a(2, 3, 7, 1)
    return {"ln_fwd": ln,
            "ln_fwd_no_bias": ck.ln_fwd_launch(np, x, w, None, 1e-5)[0],
            "ln_bwd_x": ck.ln_bwd_x_launch(np, g, xc, wc, mean, rstd)[0],
            "ln_bwd_wb": ck.ln_bwd_wb_launch(np, g, xc, mean, rstd)[0],
            "ce_fwd": ce,
            "ce_bwd": ck.ce_bwd_launch(np, np.float32(1.0), (z, t, lse, n), -1)[0],
            "attn_softmax_fwd": ck.attn_fwd_launch(S, 0.125),
            "attn_softmax_bwd": ck.attn_bwd_launch(np, a(2, 3, 7, 7), S, gy, 0.125),
            "gelu_fwd": ck.gelu_fwd_launch(np, a(3, 7, 33))[0],
            "gelu_bwd": ck.gelu_bwd_launch(np, a(3, 7, 33), a(3, 7, 33))[0],
            "adamw_step": ck.adamw_launch(a(37), a(37), a(37), a(37), 3, 1e-3, 0.9, 0.95,
                                          1e-8, 0.1)}


def test_accumulation_dtypes():
    """C "float" is float32 (np.dtype("float") is float64: the bug that made every float32
    and float16 kernel write garbage on the first GPU run)."""
    for name in DTYPES:
        assert ck.acc_dtype(name) == np.dtype(ACC[name]), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_launch_hands_the_kernel_its_declared_types(dtype):
    """Each argument against the kernel's parameter list: T* an array of the storage dtype,
    A* of the accumulation dtype, long long* int64, contiguous; A, long long and int scalars
    numpy scalars of exactly float32/64, int64, int32 (a Python float would be a double)."""
    want = {"T": dtype, "A": ACC[dtype], "long long": "int64", "int": "int32"}
    for key, plan in _plans(dtype).items():
        assert plan.name in cs.NAMES and cs.dtype_name(plan.dtype) == dtype, key
        params, args = cs.signature(plan.name), ck.describe(plan.args)
        assert len(params) == len(args), f"{key}: {len(args)} args for {len(params)} params"
        for i, ((ctype, pointer), arg, raw) in enumerate(zip(params, args, plan.args)):
            kind = ("array", want[ctype]) if pointer else ("scalar", want[ctype])
            assert arg[:2] == kind, f"{key} argument #{i} ({ctype}{'*' * pointer}): {arg}"
            assert not pointer or raw.flags.c_contiguous, f"{key} argument #{i}"


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_launch_shapes(dtype):
    """Row kernels: one block per row, a power-of-two block of whole warps; the saved
    statistics have one value per row; elementwise kernels cover every value."""
    plans = _plans(dtype)
    rows = {"ln_fwd": 15, "ln_bwd_x": 15, "ce_fwd": 10, "ce_bwd": 10,
            "attn_softmax_fwd": 42, "attn_softmax_bwd": 42}
    for key, n in rows.items():
        (grid,), (block,) = plans[key].grid, plans[key].block
        assert grid == n and block % 32 == 0 and block & (block - 1) == 0, key
    assert ck.describe(plans["ln_fwd"].args)[4] == ("array", "float32", (15,))   # mean
    assert plans["ln_fwd"].args[-1] == 1 and plans["ln_fwd_no_bias"].args[-1] == 0
    grid, chunks = plans["ln_bwd_wb"].grid
    assert grid * plans["ln_bwd_wb"].block[0] >= 37 and chunks == 1
    g = plans["gelu_fwd"]
    assert g.grid[0] * g.block[0] >= 3 * 7 * 33 and g.args[-1] == 3 * 7 * 33


@pytest.mark.parametrize("dtype", DTYPES)
def test_sources_compile_with_nvcc_and_take_the_planned_widths(dtype, tmp_path):
    """Where a CUDA toolkit is installed (no GPU needed): nvcc compiles the source for
    sm_90, and the PTX parameter list of every kernel has the planned widths (pointers
    .u64, float .f32, double .f64, long long .u64, int .u32)."""
    text = cuda_cpu.nvcc_ptx(cs.source(dtype), tmp_path)
    for key, plan in _plans(dtype).items():
        assert cuda_cpu.ptx_params(text, plan.name) == cuda_cpu.planned_widths(plan), key


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_fits_a_1024_thread_block_on_sm_90(dtype, tmp_path):
    """Where a CUDA toolkit is installed (no GPU needed), what the CPU harness does not
    model: ptxas's registers and static shared memory of every kernel of every part. Each
    kernel must launch with blocks of up to 1024 threads (the row kernels' largest,
    cuda_kernels._threads): at most 64 registers a thread (65536 per block), and at most
    48 KiB of static shared memory (more needs a dynamic opt-in the kernels do not make).
    Measured 2026-11-29 with nvcc 13.0: at most 48 registers (multi_adamw, float64), 34048
    bytes (flash_fwd)."""
    for part, (_, names) in cs.PARTS.items():
        got = cuda_cpu.nvcc_resources(cs.source(dtype, part), tmp_path)
        assert sorted(got) == sorted(names), part
        for name, (regs, smem) in got.items():
            assert regs * 1024 <= cuda_cpu.REGISTERS_PER_BLOCK, (name, regs)
            assert smem <= cuda_cpu.STATIC_SMEM_MAX, (name, smem)


def test_importing_minidist_does_not_import_cupy():
    code = ("import sys, minidist.nn, minidist.autograd.fused, minidist.autograd.cuda_kernels;"
            "sys.exit('cupy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_numpy_arrays_never_take_the_kernels():
    a = np.zeros((2, 3), np.float32)
    assert not ck.use(a) and not ck.use(a, None, a) and not ck.use()


@pytest.mark.parametrize("dtype", DTYPES)
def test_source_names_every_kernel_and_is_balanced(dtype):
    """What can be checked of CUDA source without a compiler (see the nvcc test above)."""
    src = cs.source(dtype)
    assert src.count("{") == src.count("}") and src.count("(") == src.count(")")
    for name in cs.NAMES:
        assert f'extern "C" __global__ void {name}(' in src
    assert f"typedef {cs.CTYPES[dtype][0]} T;" in src


def test_block_sizes_are_whole_warps():
    """row_grid's block for rows of n: a power of two, whole warps, one row per block."""
    for n in (1, 5, 32, 33, 768, 1024, 1025, 50257):
        grid, (t,) = ck.row_grid(np.empty((3, n), np.float32))
        assert grid == (3,)
        assert t & (t - 1) == 0 and 32 <= t <= 1024 and (t >= n or t == 1024)


# ---- on a GPU --------------------------------------------------------------------------------

@pytest.fixture
def cp(device):
    if device != "cuda":
        pytest.skip("needs --device cuda")
    return backend.get_xp()


def _inputs(cp, shapes, dtype, seed=1):
    r = np.random.default_rng(seed)
    return [Tensor(cp.asarray(r.standard_normal(s), dtype=_np_dtype(dtype)), requires_grad=True)
            for s in shapes]


def _run(cp, fn, shapes, dtype, kernels, monkeypatch):
    """fn's output and input gradients with the kernels on or off."""
    monkeypatch.setenv("MINIDIST_CUDA_KERNELS", "1" if kernels else "0")
    inputs = _inputs(cp, shapes, dtype)
    out = fn(*inputs)
    w = cp.asarray(np.random.default_rng(5).standard_normal(out.shape), dtype=out.dtype)
    (out * Tensor(w)).sum().backward()
    return [backend.to_host(a).astype(np.float64) for a in [out.data] + [x.grad for x in inputs]]


T_ODD = np.array([[3, -1, 0, 7, 2], [7, 1, -1, 2, 1000]])   # (2, 5), one id near V - 1
CASES = {   # name -> (fn, input shapes): odd sizes, rows longer than a 1024-thread block
    "ln": (F.layer_norm, [(3, 5, 37), (37,), (37,)]),
    "ln_wide": (F.layer_norm, [(7, 2049), (2049,), (2049,)]),
    "ln_no_bias": (lambda x, w: F.layer_norm(x, w, None), [(4, 300), (300,)]),
    "gelu": (F.gelu, [(3, 7, 33)]),
    "ce": (lambda z: F.cross_entropy(z, T_ODD), [(2, 5, 1001)]),
    "ce_all_ignored": (lambda z: F.cross_entropy(z, np.full((3,), -1)), [(3, 17)]),
    "attn": (F.causal_attention, [(2, 3, 7, 5)] * 3),
    "attn_long": (F.causal_attention, [(1, 2, 1100, 8)] * 3),
    "self_attn": (lambda x: F.causal_self_attention(x, 3), [(2, 33, 27)]),   # hs 3
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("name", CASES)
def test_kernel_equals_generic_xp_code(cp, name, dtype, monkeypatch):
    fn, shapes = CASES[name]
    launched, run = [], ck.launch
    monkeypatch.setattr(ck, "launch", lambda plan: launched.append(plan) or run(plan))
    got = _run(cp, fn, shapes, dtype, True, monkeypatch)
    assert launched, "the kernel path did not run"
    want = _run(cp, fn, shapes, dtype, False, monkeypatch)
    rtol, atol = TOL[dtype]
    for i, (g, w) in enumerate(zip(got, want)):
        scale = max(np.abs(w).max(), 1.0)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale,
                                   err_msg=f"{name} {dtype}: output/grad #{i}")


@pytest.mark.gpu
def test_all_ignored_rows_are_zero_not_nan(cp, monkeypatch):
    monkeypatch.setenv("MINIDIST_CUDA_KERNELS", "1")
    z, = _inputs(cp, [(4, 9)], "float32")
    loss = F.cross_entropy(z, np.array([-1, -1, -1, -1]))
    loss.backward()
    assert float(loss.data) == 0.0 and not cp.any(z.grad)


@pytest.mark.gpu
def test_cross_entropy_step_makes_no_device_to_host_sync(cp, monkeypatch):
    cupyx = pytest.importorskip("cupyx")
    if not hasattr(cupyx, "allow_synchronize"):
        pytest.skip("this CuPy has no cupyx.allow_synchronize")
    monkeypatch.setenv("MINIDIST_CUDA_KERNELS", "1")
    z, = _inputs(cp, [(8, 50)], "float32")
    t = cp.asarray(np.arange(8) % 5 - 1)           # on the device already, some ignored
    with cupyx.allow_synchronize(False):
        loss = F.cross_entropy(z, t)
        loss.backward()
    assert np.isfinite(float(loss.data))


def _one_step(device):
    """Loss, gradients and parameters after one SGD step of a small GPT built on `device`
    (SGD, not AdamW: Adam's first step is ~lr * sign(g), which flips on tiny gradients)."""
    from minidist.nn import GPT, GPTConfig
    from minidist.optim import SGD
    backend.set_device(device)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=67,
                    dropout=0.0, bias=True)
    model = GPT(cfg, seed=3, dtype="float32")
    opt = SGD(model.named_parameters(), lr=0.1)
    r = np.random.default_rng(0)
    x, y = r.integers(0, 67, (3, 16)), r.integers(0, 67, (3, 16))
    _, loss = model(x, y)
    loss.backward()
    grads = {n: backend.to_host(p.grad) for n, p in model.named_parameters()}
    opt.step()
    return float(backend.to_host(loss.data)), grads, {
        n: backend.to_host(p.data) for n, p in model.named_parameters()}


@pytest.mark.gpu
def test_gpt_step_on_gpu_matches_cpu_float32(cp):
    try:
        loss_cpu, grads_cpu, params_cpu = _one_step("cpu")
    finally:
        backend.set_device("cuda")
    loss_gpu, grads_gpu, params_gpu = _one_step("cuda")
    np.testing.assert_allclose(loss_gpu, loss_cpu, rtol=1e-5)
    for name, g in grads_cpu.items():
        np.testing.assert_allclose(grads_gpu[name], g, rtol=1e-3,
                                   atol=1e-5 * np.abs(g).max(), err_msg=name)
        np.testing.assert_allclose(params_gpu[name], params_cpu[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)
