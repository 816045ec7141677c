"""Context parallelism (ring attention, minidist/cp/) in one process: the split of the sequence,
the causal work per rank, the ring simulated in one process against plain tiled attention,
the layouts a recompute restores, the mesh's cp axis, the refusals, the walkthrough. The
exactness runs under mpiexec (tests/scripts/cp_check.py): tests/test_cp_exact.py; Ulysses:
tests/test_cp_ulysses.py.
"""
import math
import os

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite
from minidist.autograd.flash import AttnDropout, partial_attention, tiled_attention
from minidist.autograd.recompute import checkpoint
from minidist.comm.mesh import cp_coord, mesh_coords, mesh_rank
from minidist.cp.context import RingContext
from minidist.cp.ring import (attend_block, attend_block_backward, causal_tiles, layout,
                              positions, ring_bytes)
from minidist.cp.strategy import cp_problems
from minidist.train.cli import UsageError
from minidist.train.strategy import check_layout
from mpirun import ROOT
from tests.cp_cases import _flags


def test_zigzag_and_naive_layouts_cover_the_sequence_once():
    for split in ("zigzag", "naive"):
        for n in (1, 2, 4):
            allpos = np.concatenate([positions(16, n, r, split) for r in range(n)])
            assert sorted(allpos) == list(range(16))
    assert layout(16, 4, 1, "zigzag") == [(2, 2), (12, 2)]      # chunks 1 and 2N-1-1 = 6
    assert layout(16, 4, 3, "naive") == [(12, 4)]


def test_ring_bytes_formula():
    assert ring_bytes(1, 1) == 2                   # one rank: only the accumulator's hop home
    assert ring_bytes(10, 4) == (6 * 4 - 4) * 10
    assert ring_bytes(10, 4, recompute=True) == (8 * 4 - 6) * 10   # + the forward again


def test_the_recompute_runs_with_the_layouts_its_forward_had():
    """checkpoint(..., context=ring) saves the RingContext's layouts and sets them back for
    the rerun inside backward (after forward cleared them), then clears them again."""
    ring = RingContext(group=None, split="naive")
    seen = []

    def fn(h):
        seen.append(ring.snapshot())               # what the attention layers would read
        return h * 2.0
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    ring.restore([layout(8, 2, r, "naive") for r in range(2)])   # inside RingContext.forward
    y = checkpoint(fn, x, [], context=ring)
    ring.restore(None)                                           # forward has returned
    y.sum().backward()
    assert seen == [[[(0, 4)], [(4, 4)]]] * 2 and not ring.active
    assert np.array_equal(x.grad, np.full((2, 3), 2.0))


def test_naive_split_is_unbalanced_and_zigzag_is_not():
    naive, zigzag = causal_tiles(64, 4, "naive", 4), causal_tiles(64, 4, "zigzag", 4)
    assert sum(naive) == sum(zigzag) == 16 * 17 // 2            # the causal half of 16 x 16
    assert naive == sorted(naive) and naive[-1] > 3 * naive[0]   # rank 3 does the most
    assert max(zigzag) == min(zigzag)


def _qkv(T=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, 3, T, 4)) for _ in range(3)]   # (B, nh, T, hs) float64


def _dropout(p, q):
    """Attention dropout p over q's (B, nh, T, T) weights, keyed numbers; None for p 0."""
    site = DropoutSite(DropoutKeys(5), "transformer.h.0.attn.attn_dropout")
    return AttnDropout(p, site, q.shape[:-1] + q.shape[-2:-1]) if p else None


def _simulate(q, k, v, n, split, block, dropout=None):
    """One process playing n ranks: each rank's queries against every rank's block in ring
    order (the messages are just slices here). Returns y and lse in global order."""
    T = q.shape[-2]
    lays = [layout(T, n, r, split) for r in range(n)]
    y, lse = np.zeros_like(q), np.full(q.shape[:-1], -math.inf)
    for r in range(n):
        pos = positions(T, n, r, split)
        yr, lr = np.zeros_like(q[..., pos, :]), np.full(q.shape[:-1], -math.inf)[..., pos]
        for step in range(n):
            src = (r - step) % n
            sp = positions(T, n, src, split)
            attend_block(q[..., pos, :], lays[r], np.stack([k[..., sp, :], v[..., sp, :]]),
                         lays[src], yr, lr, block, dropout)
        y[..., pos, :], lse[..., pos] = yr, lr
    return y, lse


@pytest.mark.parametrize("n,split,block,p", [(2, "zigzag", 2, 0), (4, "zigzag", 2, 0),
                                             (4, "naive", 3, 0), (2, "naive", 8, 0),
                                             (4, "zigzag", 2, 0.3), (2, "naive", 3, 0.3)])
def test_simulated_ring_equals_tiled_attention(n, split, block, p):
    """With attention dropout p too: each tile's numbers found by global position."""
    q, k, v = _qkv()
    drop = _dropout(p, q)
    y, lse = _simulate(q, k, v, n, split, block, drop)
    y_ref, lse_ref = partial_attention(q, k, v, 0, 0, 4, dropout=drop)
    assert np.abs(y - y_ref).max() < 1e-12 and np.abs(lse - lse_ref).max() < 1e-12
    if p:
        assert np.abs(y - partial_attention(q, k, v, 0, 0, 4)[0]).max() > 1e-3


@pytest.mark.parametrize("n,split,p", [(2, "zigzag", 0), (4, "naive", 0), (4, "zigzag", 0.3)])
def test_simulated_ring_backward_equals_tiled_attention_gradients(n, split, p):
    q, k, v = _qkv(seed=1)
    g = np.random.default_rng(2).standard_normal(q.shape)
    tq, tk, tv = Tensor(q, requires_grad=True), Tensor(k, requires_grad=True), \
        Tensor(v, requires_grad=True)
    drop = _dropout(p, q)
    site = drop.site if drop else None
    (tiled_attention(tq, tk, tv, 4, p, site) * Tensor(g)).sum().backward()
    y, lse = _simulate(q, k, v, n, split, 2, drop)
    D = (g * y).sum(axis=-1)
    T = q.shape[-2]
    lays = [layout(T, n, r, split) for r in range(n)]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for r in range(n):                          # rank r's queries against every block
        pos = positions(T, n, r, split)
        dq_r = np.zeros_like(q[..., pos, :])
        for src in range(n):
            sp = positions(T, n, src, split)
            dkv = np.zeros((2,) + k[..., sp, :].shape)
            attend_block_backward(g[..., pos, :], q[..., pos, :], lays[r],
                                  np.stack([k[..., sp, :], v[..., sp, :]]), lays[src],
                                  lse[..., pos], D[..., pos], dq_r, dkv, 2, drop)
            dk[..., sp, :] += dkv[0]
            dv[..., sp, :] += dkv[1]
        dq[..., pos, :] = dq_r
    for got, want in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        assert np.abs(got - np.asarray(want)).max() < 1e-12


def test_a_masked_tile_of_the_ring_backward_keeps_a_bfloat16_score_out_of_float64():
    """attend_block_backward's xp path masks a tile with xp.where(later, -inf, s). numpy
    promotes a bfloat16 s to float64 beside the Python float (CuPy's where, which has no
    bfloat16 loop, to float32), and that tile's softmax and products then ran in float64.
    Today s comes out float32 (`q_i * scale`: a Python float promotes bfloat16 on numpy and
    CuPy alike), so the products are made bfloat16 here, as a bfloat16 GEMM's would be
    (attend_block_backward's matmul argument): the masked tile must keep s's dtype,
    p = exp(s - lse) being float32 (lse is)."""
    from minidist.backend import matmul
    bf16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    q, k, v, g = (a.astype(bf16) for a in _qkv(T=8) + [_qkv(T=8, seed=1)[0]])
    y, lse = partial_attention(q, k, v, 0, 0, 4)                 # bfloat16, float32
    D = (g.astype(np.float32) * y.astype(np.float32)).sum(axis=-1)
    seen = set()

    def bf16_gemm(a, b):
        seen.update((a.dtype, b.dtype))
        return matmul(a, b).astype(bf16)
    dq, dkv = np.zeros_like(q), np.zeros((2,) + k.shape, bf16)
    attend_block_backward(g, q, [(0, 8)], np.stack([k, v]), [(0, 8)], lse, D, dq, dkv, 4,
                          matmul=bf16_gemm)
    assert seen == {bf16, np.dtype(np.float32)}, seen


def test_mesh_cp_axis_order_and_inverse():
    # dp 2 x cp 2 x tp 2: tp fastest, then cp, then dp
    coords = [(mesh_coords(r, 2, 2, 1, cp=2), cp_coord(r, 2, 2)) for r in range(8)]
    assert [c for _, c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [d for (d, _, _), _ in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    for r, ((d, t, p), c) in enumerate(coords):
        assert mesh_rank(d, t, p, 2, 2, c, 2) == r
    assert [mesh_coords(r, 2, 2, 1) for r in range(4)] == \
        [mesh_coords(r, 2, 2, 1, cp=1) for r in range(4)]          # cp 1: the old order


@pytest.mark.parametrize("extra,words", [
    (["--cp", "4", "--block-size", "12"], "multiple of 8"),
    (["--cp", "4", "--block-size", "10", "--cp-split", "naive"], "multiple of 4"),
    (["--cp", "2", "--tp", "2", "--sequence-parallel", "--block-size", "6", "--cp-split",
      "naive"], "--block-size must be a multiple of cp x tp = 4")])
def test_refusals_name_the_flag(extra, words):
    problems = cp_problems(_flags(*extra))
    assert any(words in p for p in problems), problems


def test_sequence_parallel_is_no_longer_refused():
    args = _flags("--cp", "2", "--tp", "2", "--sequence-parallel")
    assert cp_problems(args) == [] and check_layout(args, 4) == (1, 1)


def test_ckpt_activations_is_no_longer_refused():
    assert cp_problems(_flags("--cp", "2", "--ckpt-activations")) == []
    assert cp_problems(_flags("--cp", "2", "--tp", "2", "--ckpt-activations")) == []


@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_zero_with_cp_and_tp_is_no_longer_refused(zero):
    args = _flags("--cp", "2", "--tp", "2", "--dp", "2", "--zero", zero)
    assert cp_problems(args) == []
    assert check_layout(args, 8) == (2, 1)                  # dp 2, one micro-batch


def test_cp_that_does_not_match_the_processes_is_a_usage_error():
    with pytest.raises(UsageError, match="context parallelism: --dp 1 x --cp 2"):
        check_layout(_flags("--cp", "2", "--dp", "1"), 3)


def test_walkthrough_prints_the_balance_and_an_exact_row():
    """python examples/ring_attention_walkthrough.py"""
    import subprocess
    import sys
    script = os.path.join(ROOT, "examples", "ring_attention_walkthrough.py")
    out = subprocess.run([sys.executable, script],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert "zigzag [9, 9, 9, 9]" in out and "naive  [3, 7, 11, 15]" in out
    assert "step 3: rank 0 holds kv1" in out
    assert float(out.rsplit("max |diff| = ", 1)[1].split()[0]) < 1e-12


@pytest.mark.mpi
def test_bad_cp_block_size_is_one_error_line(mpi):
    """mpiexec -n 2 python examples/train_gpt.py --cp 2 --block-size 18"""
    out = mpi(2, "examples/train_gpt.py", "--cp", "2", "--block-size", "18", timeout=60,
              check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: context parallelism: ")
    assert out.stderr.count("multiple of 4") == 1


@pytest.mark.parametrize("flags, says", [(["--row", "1000"], "--row 1000"),
                                         (["--row", "-1"], "--row -1"),
                                         (["--T", "6", "--ranks", "4"], "--T 6"),
                                         (["--ranks", "0"], "--ranks 0"),
                                         (["--T", "0"], "--T 0")])
def test_walkthrough_refuses_bad_input(flags, says):
    """python examples/ring_attention_walkthrough.py --row 1000 (and --row -1, --T 6
    --ranks 4, --ranks 0, --T 0): one `error:` line naming the flag, exit 2, no traceback."""
    import subprocess
    import sys
    script = os.path.join(ROOT, "examples", "ring_attention_walkthrough.py")
    out = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True,
                         timeout=60)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(errors) == 1 and f"error: {says}:" in errors[0], out.stderr


def test_walkthrough_default_row_fits_a_small_T():
    """python examples/ring_attention_walkthrough.py --T 12 --ranks 3: the default row (13)
    is past T, so it follows the last row, T - 1, exactly."""
    import subprocess
    import sys
    script = os.path.join(ROOT, "examples", "ring_attention_walkthrough.py")
    out = subprocess.run([sys.executable, script, "--T", "12", "--ranks", "3"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert "query row 11 lives on rank 0" in out
    assert float(out.rsplit("max |diff| = ", 1)[1].split()[0]) < 1e-12


def test_ring_self_attention_gradcheck_on_one_rank():
    """RingSelfAttention's own backward (the ring's tiles, the log-sum-exp, dq and dkv)
    against central differences, float64: one rank holding a zig-zag sequence of two pieces,
    tiles of 2 positions. One rank sends nothing anywhere: the dk and dv sent home across
    ranks are checked on 2 ranks by cp_check.py's ring_gradcheck
    (tests/test_cp_exact.py::test_cp2_is_exact_and_sends_the_formula)."""
    from mpi4py import MPI
    from minidist.autograd.gradcheck import gradcheck
    from minidist.comm import ProcessGroup
    from minidist.cp.ring import RingSelfAttention
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank cp")
    ring = RingContext(group, split="zigzag", block=2)
    ring.restore([layout(8, 1, 0, "zigzag")])            # (what RingContext.part sets)
    assert len(ring.layouts[0]) == 2                      # two pieces: both tile orders
    qkv = Tensor(np.random.default_rng(3).standard_normal((2, 8, 12)), requires_grad=True)
    gradcheck(lambda t: RingSelfAttention.apply(t, 2, ring, 0.0, None, None), [qkv],
              name="RingSelfAttention")
    site = DropoutSite(DropoutKeys(5), "transformer.h.0.attn.attn_dropout")   # keyed masks:
    gradcheck(lambda t: RingSelfAttention.apply(t, 2, ring, 0.25, site, None), [qkv],
              name="RingSelfAttention with dropout")          # the same every call
    gqa = Tensor(np.random.default_rng(4).standard_normal((2, 8, 16)), requires_grad=True)
    gradcheck(lambda t: RingSelfAttention.apply(t, 4, ring, 0.25, site, 2), [gqa],
              name="RingSelfAttention, 4 q heads, 2 kv heads, with dropout")


@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_the_ring_repeats_kv_heads_where_it_attends_as_repeat_kv_before_it(n_kv_head):
    """Grouped-query attention: the ring given the nkv k and v heads (which then travel
    unrepeated) = the ring given repeat_kv's nh of them (what it was handed before), y and
    the gradient of qkv (repeat_kv's backward sums the copies'); float64, one rank, dropout
    0.25 (keyed masks: the same in both), 4 q heads of size 2."""
    from mpi4py import MPI
    from minidist.autograd.llama_ops import repeat_kv
    from minidist.comm import ProcessGroup
    from minidist.cp.ring import RingSelfAttention
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank cp")
    ring = RingContext(group, split="zigzag", block=2)
    ring.restore([layout(8, 1, 0, "zigzag")])
    site = DropoutSite(DropoutKeys(5), "transformer.h.0.attn.attn_dropout")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 8, (4 + 2 * n_kv_head) * 2))
    g = rng.standard_normal((2, 8, 8))
    out = []
    for repeated in (False, True):
        qkv = Tensor(x.copy(), requires_grad=True)
        y = RingSelfAttention.apply(repeat_kv(qkv, 4, n_kv_head), 4, ring, 0.25, site, None) \
            if repeated else RingSelfAttention.apply(qkv, 4, ring, 0.25, site, n_kv_head)
        (y * Tensor(g)).sum().backward()
        out.append((y.data, qkv.grad))
    (y0, d0), (y1, d1) = out
    assert np.abs(y0 - y1).max() < 1e-14 and np.abs(d0 - d1).max() < 1e-14


def test_the_ring_holds_nothing_q_heads_wide_for_kv_heads():
    """Grouped-query attention in the xp code: ring_forward attends to the held block with
    the q heads grouped over it, and ring_backward adds each tile's dk, dv summed over the
    group into the kv-wide accumulator: no block repeated to nh heads, no nh-wide scratch.
    tracemalloc's peaks, one rank, B 2, 8 q heads, Tl 256, hs 32, float64 (a kv block of 2
    kv heads is 0.5 MiB, of 8 heads 2 MiB): with 2 kv heads backward's peak is below
    multi-head attention's by at least 2.5 x the 1.5 MiB each kv-wide array it makes (the
    next block, the accumulator and the next accumulator) saves: 6.61 MiB against 11.07
    (2026-11-30); before this change (a repeated block and an 8-head scratch each step)
    10.60, and forward's 6.19 MiB was above multi-head attention's 5.66 (now 4.20)."""
    import tracemalloc
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.cp.ring import ring_backward, ring_forward
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank cp")
    rng = np.random.default_rng(7)
    B, nh, Tl, hs = 2, 8, 256, 32
    q, g = rng.standard_normal((B, nh, Tl, hs)), rng.standard_normal((B, nh, Tl, hs))
    layouts, peaks = [layout(Tl, 1, 0)], {}
    for nkv in (2, 8):
        kv = rng.standard_normal((2, B, nkv, Tl, hs))
        tracemalloc.start()
        y, lse = ring_forward(group, layouts, q, kv, block=64)
        forward = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        ring_backward(group, layouts, g, q, kv, y, lse, block=64)
        peaks[nkv] = forward, tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    group.destroy()
    saved = 3 * (8 - 2) * 2 * B * Tl * hs * 8                    # 3 arrays of 6 heads fewer
    assert peaks[2][1] <= peaks[8][1] - 2.5 * saved / 3, peaks
    assert peaks[2][0] < peaks[8][0], peaks
