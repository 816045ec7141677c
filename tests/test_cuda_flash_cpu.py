"""The tiled (flash) attention kernels of minidist/autograd/cuda_source_flash.py RUN on the CPU
(tests/cuda_cpu.py) against flash.py's xp code in float64: forward y and lse, backward dq,
dk, dv, in float16, bfloat16, float32 and float64, both thread orders, without and with
dropout on the weights (the kernels' Philox numbers = the keyed site's); a central-difference
check of the kernels' own gradients in float64 (with dropout too); the dropout step read
on the device (a forward's masks drawn after a later next_step: counter less lag; plans made
once and re-run as the counter advances, a CUDA graph's replays); broken variants (each
__syncthreads dropped in turn, an off-by-one tile or mask, eight dropout defects) that must
fail; and the launch plans' argument types.
Run: python -m pytest -q tests/test_cuda_flash_cpu.py   (skips without a C++ compiler)
"""
import functools
import re

import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import Tensor, cuda_kernels as ck, cuda_kernels_new as ckn, flash
from minidist.autograd import cuda_source as cs
from minidist.autograd.cuda_source_flash import FLASH
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite
from test_cuda_kernels_cpu import DTYPES, ORDERS, close, f64, failing_orders, nth_replaced, rand

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))


def kernel_attention(q, k, v, g, src=None, order="low", dropout=None):
    """y, lse and (dq, dk, dv) from the kernels, run on the CPU (dropout: the kernels'
    dropout arguments, flash.AttnDropout.kernel_args)."""
    plan, (y, lse) = ckn.flash_fwd_launch(np, q, k, v, dropout)
    y[...], lse[...] = np.nan, np.nan
    cuda_cpu.run(plan, src, order)
    plans, grads = ckn.flash_bwd_launches(np, g, q, k, v, y, lse, dropout)
    for a in grads:
        a[...] = np.nan
    for p in plans:
        cuda_cpu.run(p, src, order)
    return y, lse, grads


def reference(q, k, v, g):
    """flash.py's tiled attention in float64 (tiles of 5: its own tiling differs)."""
    ts = [Tensor(f64(a), requires_grad=True) for a in (q, k, v)]
    y = flash.tiled_attention(*ts, block=5)
    (y * Tensor(f64(g))).sum().backward()
    _, lse = flash.partial_attention(*(f64(a) for a in (q, k, v)), block=5)
    return y.data, lse, [t.grad for t in ts]


def check_flash(dtype, shape=(3, 37, 8), src=None, order="low"):
    q, k, v, g = (rand(dtype, *shape, seed=s) for s in range(4))
    y, lse, grads = kernel_attention(q, k, v, g, src, order)
    y_want, lse_want, grads_want = reference(q, k, v, g)
    close(y, y_want, dtype, "flash_fwd y")
    close(lse, lse_want, "float32", "flash_fwd lse")
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_want):
        close(a, b, dtype, f"flash_bwd {name}")


def _site():
    """A tensor-parallel rank's attention-dropout site (heads 3..5 of 6), keyed numbers."""
    return DropoutSite(DropoutKeys(11), "transformer.h.0.attn.attn_dropout", axis=1, parts=2,
                       index=1)


def check_flash_dropout(dtype, shape=(2, 3, 37, 8), src=None, order="low", p=0.3):
    """The kernels with dropout p on the weights against flash.py's tiled attention with the
    same keyed site (float64): the same numbers decide every keep, computed in the kernels
    by Philox; batch rows 5 and 2 of the global batch, a TP rank's heads; at step 3, drawn
    after the keys moved on to step 4 (the step read on the device: counter 4, lag 1)."""
    q, k, v, g = (rand(dtype, *shape, seed=s) for s in range(4))
    site = _site()
    for _ in range(3):
        site.keys.next_step()
    with site.keys.rows_of([5, 2][:shape[0]]):
        drop = flash.AttnDropout(p, site, shape[:-1] + shape[-2:-1])
        ts = [Tensor(f64(a), requires_grad=True) for a in (q, k, v)]
        y_want = flash.tiled_attention(*ts, 5, p, site)
        (y_want * Tensor(f64(g))).sum().backward()
        site.keys.next_step()
        y, lse, grads = kernel_attention(q, k, v, g, src, order, drop.kernel_args(np))
    _, lse_want = flash.partial_attention(*(f64(a) for a in (q, k, v)), block=5)
    close(y.reshape(shape), y_want.data, dtype, "flash_fwd y (dropout)")
    close(lse.reshape(shape[:-1]), lse_want, "float32", "flash_fwd lse (dropout: undropped)")
    for name, a, t in zip(("dq", "dk", "dv"), grads, ts):
        close(a.reshape(shape), t.grad, dtype, f"flash_bwd {name} (dropout)")
    y_plain, _, _ = kernel_attention(q, k, v, g, src, order)
    assert np.abs(f64(y_plain) - f64(y)).max() > 1e-2                 # something dropped


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_kernels_with_dropout_equal_flash_py(dtype, order):
    """T = 37 (tiles not a multiple), 2 batch rows x 3 heads (the kernels find each
    batch-head's global row and head), hs = 128 once."""
    check_flash_dropout(dtype, (2, 3, 37, 8), order=order)
    check_flash_dropout(dtype, (1, 2, 20, 128), order=order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_kernels_equal_flash_py(dtype, order):
    """T = 37: not a multiple of any tile (16/8 forward, 8/4 backward), the diagonal tile
    masked, tiles in the future skipped; hs = 128, the largest head size; T = 1."""
    check_flash(dtype, (3, 37, 8), order=order)
    check_flash(dtype, (1, 20, 128), order=order)
    check_flash(dtype, (2, 1, 5), order=order)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_nan_or_inf_in_the_scores_gives_y_nan_as_flash_py(dtype):
    """A query row whose scores hold a NaN (or an inf: inf - inf in the softmax) has l NaN:
    its y is NaN, as flash.py's and attention.py's, not 0 (a NaN is never > 0: the kernel
    took it for a row that saw no key, hiding an fp16/bf16 overflow as a finite y)."""
    q, k, v = (rand(dtype, 2, 37, 8, seed=s) for s in range(3))
    q[0, 20, 3], q[1, 5, 0] = np.nan, np.inf
    plan, (y, lse) = ckn.flash_fwd_launch(np, q, k, v)
    cuda_cpu.run(plan)
    with np.errstate(invalid="ignore"):
        want, lse_want = flash.partial_attention(*(f64(a) for a in (q, k, v)), block=5)
    assert np.isnan(f64(y)).any(-1).tolist() == np.isnan(want).any(-1).tolist()
    assert np.isnan(want[0, 20]).all() and np.isnan(want[1, 5]).all()
    close(np.nan_to_num(f64(y)), np.nan_to_num(want), dtype, "flash_fwd y, finite rows")


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_flash_backward_kernels_are_the_forward_kernels_gradient(p):
    """Central differences of sum(R * y) through flash_fwd (run on the CPU) in float64 equal
    the backward kernels' dq, dk, dv; with dropout 0.4 too (the same keeps both ways)."""
    q, k, v, R = (rand("float64", 1, 2, 6, 3, seed=s) for s in range(4))
    site = _site()
    drop = flash.AttnDropout(p, site, (1, 2, 6, 6)).kernel_args(np) if p else None
    _, _, grads = kernel_attention(q, k, v, R, dropout=drop)
    eps = 1e-6
    for which, grad in enumerate(grads):
        args = [q, k, v]
        fd = np.empty_like(args[which])
        for i in np.ndindex(fd.shape):
            vals = []
            for sign in (1, -1):
                a = [x.copy() for x in args]
                a[which][i] += sign * eps
                plan, (y, _) = ckn.flash_fwd_launch(np, *a, drop)
                cuda_cpu.run(plan)
                vals.append((y.reshape(R.shape) * R).sum())
            fd[i] = (vals[0] - vals[1]) / (2 * eps)
        np.testing.assert_allclose(grad.reshape(fd.shape), fd, rtol=1e-6, atol=1e-8,
                                   err_msg="dqkv"[which:][:2])


def test_replayed_flash_plans_draw_each_replays_masks():
    """A captured graph's view, on the CPU: the forward and backward plans made once at
    step 2 (arguments frozen: the counter array, the lag), then per "replay" the counter's
    advance (next_step's device op) and the same plans: y and the gradients are flash.py's
    at step 2 + replay, and differ from replay to replay."""
    shape = (2, 3, 21, 8)
    q, k, v, g = (rand("float64", *shape, seed=s) for s in range(4))
    site = _site()
    site.keys.next_step()
    site.keys.next_step()
    with site.keys.rows_of([5, 2]):
        drop = flash.AttnDropout(0.3, site, shape[:-1] + shape[-2:-1]).kernel_args(np)
        fwd, (y, lse) = ckn.flash_fwd_launch(np, q, k, v, drop)
        cuda_cpu.run(fwd)
        plans, grads = ckn.flash_bwd_launches(np, g, q, k, v, y, lse, drop)
        last = None
        for replay in range(1, 3):
            site.keys.counter += 1                       # the captured next_step
            for plan in [fwd] + plans:
                cuda_cpu.run(plan)
            want = DropoutSite(DropoutKeys(11), site.name, axis=1, parts=2, index=1)
            for _ in range(2 + replay):
                want.keys.next_step()
            ts = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
            with want.keys.rows_of([5, 2]):
                y_want = flash.tiled_attention(*ts, 5, 0.3, want)
            (y_want * Tensor(g)).sum().backward()
            close(y.reshape(shape), y_want.data, "float64", f"y, replay {replay}")
            for name, a, t in zip(("dq", "dk", "dv"), grads, ts):
                close(a.reshape(shape), t.grad, "float64", f"{name}, replay {replay}")
            assert last is None or np.abs(last - y).max() > 1e-2      # new masks
            last = y.copy()


def flash_plans(dtype):
    """Every flash plan for storage dtype `dtype`, planned with numpy arrays: a whole
    sequence (T = 37) and ring attention's pieces (queries rows 3..22 of 30 at global
    positions 10.., keys rows 1..30 of 40 at 4..), each without and with dropout."""
    q = rand(dtype, 2, 3, 37, 8)
    qp, kp = rand(dtype, 2, 3, 30, 8), rand(dtype, 2, 3, 40, 8)
    acc = ck.acc_dtype(dtype)
    lse, D = np.zeros((2, 3, 30), acc), np.zeros((2, 3, 30), acc)
    plans = {}
    for tag, p in (("", 0.0), (" (dropout)", 0.1)):
        drop = flash.AttnDropout(p, _site(), (2, 3, 64, 64)).kernel_args(np) if p else None
        plans["flash_fwd" + tag], (y, lse_w) = ckn.flash_fwd_launch(np, q, q, q, drop)
        dot, dkdv, dq = ckn.flash_bwd_launches(np, q, q, q, q, y, lse_w, drop)[0]
        plans.update({"flash_bwd_dot" + tag: dot, "flash_bwd_dkdv" + tag: dkdv,
                      "flash_bwd_dq" + tag: dq})
        plans["flash_fwd piece" + tag] = ckn.flash_fwd_launch(np, qp, kp, kp, drop, 10, 4)[0]
        grads = (np.zeros_like(qp), np.zeros_like(kp), np.zeros_like(kp))
        dkdv, dq = ckn.flash_piece_bwd_launches(np, qp, qp, kp, kp, lse, D, grads, (3, 10, 20),
                                                (1, 4, 30), drop)
        plans.update({"flash_bwd_dkdv piece" + tag: dkdv, "flash_bwd_dq piece" + tag: dq})
    return plans


def test_flash_plans_hand_each_kernel_its_declared_types():
    """As test_cuda_kernels.py does for the other kernels: T* arrays of the storage dtype,
    A of the accumulation dtype, long long int64, int int32, all contiguous; the grid covers
    every tile of every head (of the piece's rows); the pieces' plans add into the given
    arrays themselves."""
    for dtype in DTYPES:
        want = {"T": dtype, "A": ck.acc_dtype(dtype).name, "long long": "int64", "int": "int32",
                "float": "float32"}
        plans = flash_plans(dtype)
        for key, p in plans.items():
            params, args = cs.signature(p.name), ck.describe(p.args)
            assert cs.part_of(p.name) == "flash" and len(params) == len(args), key
            for (ctype, pointer), arg, raw in zip(params, args, p.args):
                assert arg[:2] == (("array" if pointer else "scalar"), want[ctype]), key
                assert not pointer or raw.flags.c_contiguous, key
            if "dropout" in key and p.name != "flash_bwd_dot":
                assert p.args[-7] == 64, key               # dT: the whole sequence's length
        ft, bt = ckn.tiles(ck.acc_dtype(dtype).itemsize)
        assert plans["flash_fwd"].grid == (-(-37 // ft), 6)
        assert plans["flash_bwd_dkdv"].grid == (-(-37 // bt), 6)
        assert plans["flash_fwd piece"].grid == (-(-30 // ft), 6)
        dkdv, dq = plans["flash_bwd_dkdv piece"], plans["flash_bwd_dq piece"]
        assert dkdv.grid == (-(-30 // bt), 6) and dq.grid == (-(-20 // bt), 6)
        assert dq.args[7:16] == (30, 3, 20, 10, 40, 1, 30, 4, 1)      # Lq qo Tq q_start .. add
        assert plans["flash_bwd_dq"].args[7:16] == (37, 0, 37, 0, 37, 0, 37, 0, 0)
    with pytest.raises(ValueError, match="head sizes up to 128 and up to 65535"):
        ckn.flash_fwd_launch(np, *[np.zeros((1, 4, 129), np.float32)] * 3)
    q = np.zeros((1, 2, 4, 8), np.float32)
    for kv in (q[:, :1], q[..., :4]):       # a grouped-query k, v not repeated; another hs
        with pytest.raises(ValueError, match="keys and values"):
            ckn.flash_fwd_launch(np, q, kv, kv)          # the kernel would read past them
    short = q[:, :, :3]                     # review 44 F6: keys shorter than the sequence
    with pytest.raises(ValueError, match="of another length than the queries"):
        ckn.flash_bwd_launches(np, q, q, short, short, q, q[..., 0])
    with pytest.raises(ValueError, match="add into contiguous dq, dk, dv"):
        ckn.flash_piece_bwd_launches(np, q, q, q, q, q[..., 0], q[..., 0],
                                     (q, q, q[..., ::2, :]), (0, 0, 4), (0, 0, 2))
    with pytest.raises(ValueError, match="outside"):
        ckn.flash_piece_bwd_launches(np, q, q, q, q, q[..., 0], q[..., 0], (q, q, q),
                                     (1, 0, 4), (0, 0, 2))


def test_dropout_args_step_is_the_counter_itself():
    """A plan's step is the keys' counter array (read when the kernel runs) and the lag: 1
    for a forward drawn again after the keys moved on."""
    site = _site()
    site.keys.next_step()
    attn = flash.AttnDropout(0.1, site, (2, 3, 37, 37))
    site.keys.next_step()
    drop = attn.kernel_args(np)
    q = rand("float32", 2, 3, 37, 8)
    plan, (y, lse) = ckn.flash_fwd_launch(np, q, q, q, drop)
    plans, _ = ckn.flash_bwd_launches(np, q, q, q, q, y, lse, drop)
    for p in [plan] + plans[1:]:
        assert p.args[-6] is drop[4][0] and p.args[-5] == 1 and p.args[-7] == 37


BROKEN = {   # name -> (old, new, occurrence) in the flash kernels' text
    "flash_fwd stops one key tile early": ("c0 < c_end; c0 += FT", "c0 + FT < c_end; c0 += FT",
                                           0),
    "flash_fwd mask off by one": ("c0 + c > q_start + r0 + r", "c0 + c >= q_start + r0 + r", 0),
    "flash_bwd_dkdv skips the diagonal tile": ("r0 = r_first > 0 ? r_first : 0;",
                                               "r0 = (r_first > 0 ? r_first : 0) + BT;", 0),
    "flash_bwd_dq stops one key tile early": ("c0 < c_end; c0 += BT", "c0 + BT < c_end; c0 += BT",
                                              0),
}
BARRIERS = FLASH.count("__syncthreads();")
for n in range(BARRIERS):
    BROKEN[f"barrier #{n} dropped"] = ("__syncthreads();", "", n)


@pytest.mark.parametrize("name", BROKEN)
def test_broken_flash_kernel_fails(name):
    """Each defect fails in at least one thread order; "barrier #n dropped" for every
    __syncthreads of the four kernels: none is superfluous, and none can go unnoticed."""
    old, new, n = BROKEN[name]
    src = cs.source("float32", "flash").replace(FLASH, nth_replaced(FLASH, old, new, n))
    failed = failing_orders(functools.partial(check_flash, "float32", (2, 37, 8)), src)
    assert failed, f"{name}: the broken kernel passed in both orders"


BROKEN_DROPOUT = {   # name -> (old, new, occurrence) in the flash kernels' text
    "flash_fwd sums the dropped p": (
        "sum += p;                // l sums the undropped p; acc takes p Z (dropout)",
        "", 0),
    "flash_bwd's dv from the undropped p": ("pv *= z;", "", 0),
    "dropout ignores the rank's first head": ("((h0 + bh % nh) * dT + i)", "((bh % nh) * dT + i)",
                                              0),
    "dropout reads batch row 0 for every row": ("drows[bh / nh], dstep", "drows[0], dstep", 0),
    "flash_bwd's ds without Z": ("pv * (dp * z - D[i])", "pv * (dp - D[i])", 0),
    "flash_fwd's step from the counter's next slot": ("dcount[0] - dlag", "dcount[1] - dlag",
                                                      0),
    "flash_bwd_dkdv ignores the lag": ("dcount[0] - dlag", "dcount[0]", 1),
    "flash_bwd_dq adds the lag": ("dcount[0] - dlag", "dcount[0] + dlag", 2),
}


@pytest.mark.parametrize("name", BROKEN_DROPOUT)
def test_broken_flash_dropout_fails(name):
    old, new, n = BROKEN_DROPOUT[name]
    src = cs.source("float32", "flash").replace(FLASH, nth_replaced(FLASH, old, new, n))
    if name == "flash_fwd sums the dropped p":
        src = src.replace("                s[r][c] = p;\n", "                s[r][c] = p;\n"
                          "                sum += p;\n")
        assert src.count("sum += p;") == 1                             # moved, not dropped
    failed = failing_orders(functools.partial(check_flash_dropout, "float32", (2, 3, 21, 8)),
                            src)
    assert failed, f"{name}: the broken kernel passed in both orders"


def test_flash_kernels_are_off_by_default_and_never_take_numpy(monkeypatch):
    """MINIDIST_CUDA_NEW_KERNELS is "0" unless set; numpy arrays never reach a kernel."""
    a = np.zeros((1, 2, 4, 8), np.float32)
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    assert not ckn.use_new(a, a, a) and not flash.kernels_ok(a, a, a)
    assert ckn.flash_ok(a) and not ckn.flash_ok(np.zeros((1, 129)))
    assert not ckn.flash_ok(np.zeros((65536, 1, 1)))


def test_nvcc_compiles_the_flash_kernels_within_48k_of_shared_memory(tmp_path):
    """Where a CUDA toolkit is installed (no GPU needed): every dtype compiles for sm_90 and
    ptxas reports each kernel's static shared memory under the 48 KiB a block gets by
    default."""
    import shutil
    import subprocess
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on PATH")
    for dtype in DTYPES:
        src = tmp_path / f"{dtype}.cu"
        src.write_text(cs.source(dtype, "flash"))
        out = subprocess.run([nvcc, "-arch=sm_90", "--std=c++14", "-cubin", "-Xptxas", "-v",
                              str(src), "-o", str(tmp_path / f"{dtype}.cubin")], check=True,
                             capture_output=True, text=True, timeout=300)
        smem = [int(n) for n in re.findall(r"(\d+) bytes smem", out.stderr)]
        assert len(smem) == 3 and max(smem) <= 48 * 1024, (dtype, out.stderr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvcc_ptx_takes_the_planned_widths(dtype, tmp_path):
    """Where a CUDA toolkit is installed (no GPU needed), as test_cuda_kernels.py's test for
    the fused kernels: the PTX parameter list of every flash kernel has the widths each plan
    (whole sequence and ring pieces, with and without dropout) hands it (pointers .u64,
    float .f32, double .f64, long long .u64, int .u32)."""
    text = cuda_cpu.nvcc_ptx(cs.source(dtype, "flash"), tmp_path)
    for key, plan in flash_plans(dtype).items():
        assert cuda_cpu.ptx_params(text, plan.name) == cuda_cpu.planned_widths(plan), key


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_kernels_on_a_gpu_equal_flash_py(device, dtype, monkeypatch):
    """For the GPU session that confirms them: tiled_attention on cupy arrays with the
    kernels on, against flash.py in float64 on the CPU
    (python -m pytest -m gpu --device cuda tests/test_cuda_flash_cpu.py)."""
    if device != "cuda":
        pytest.skip("needs --device cuda")
    import cupy
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    q, k, v, g = (rand(dtype, 2, 3, 77, 64, seed=s) for s in range(4))
    ts = [Tensor(cupy.asarray(a), requires_grad=True) for a in (q, k, v)]
    y = flash.tiled_attention(*ts)
    (y * Tensor(cupy.asarray(g))).sum().backward()
    y_want, _, grads_want = reference(q, k, v, g)
    for name, a, b in zip(("y", "dq", "dk", "dv"), [y.data] + [t.grad for t in ts],
                          [y_want] + grads_want):
        close(cupy.asnumpy(a), b, dtype, name)


@pytest.mark.gpu
def test_flash_kernels_with_dropout_on_a_gpu_equal_flash_py(device, monkeypatch):
    """For the GPU session: tiled_attention with dropout 0.3 on cupy arrays, kernels on,
    against flash.py's xp code in float64 on the CPU with the same keyed site
    (python -m pytest -m gpu --device cuda tests/test_cuda_flash_cpu.py)."""
    if device != "cuda":
        pytest.skip("needs --device cuda")
    import cupy
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    q, k, v, g = (rand("float32", 2, 3, 77, 64, seed=s) for s in range(4))
    site = _site()
    got = [Tensor(cupy.asarray(a), requires_grad=True) for a in (q, k, v)]
    want = [Tensor(f64(a), requires_grad=True) for a in (q, k, v)]
    with site.keys.rows_of([5, 2]):
        y = flash.tiled_attention(*got, 64, 0.3, site)
        (y * Tensor(cupy.asarray(g))).sum().backward()
        y_want = flash.tiled_attention(*want, 5, 0.3, site)
        (y_want * Tensor(f64(g))).sum().backward()
    close(cupy.asnumpy(y.data), y_want.data, "float32", "y")
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        close(cupy.asnumpy(a.grad), b.grad, "float32", name)
