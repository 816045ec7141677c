"""Context parallelism (ring attention, minidist/cp/): the split of the sequence, the causal
work per rank, the ring simulated in one process against plain tiled attention, the layouts
a recompute restores, the mesh's cp axis, the refusals, and the exactness runs (also with
--ckpt-activations) under mpiexec (tests/scripts/cp_check.py).
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
from minidist.train.args import train_parser
from minidist.train.cli import UsageError
from minidist.train.strategy import check_layout
from mpirun import ROOT, tagged_json


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


def test_a_masked_tile_of_the_ring_backward_keeps_a_bfloat16_score_out_of_float64(
        monkeypatch):
    """attend_block_backward's xp path masks a tile with xp.where(later, -inf, s). numpy
    promotes a bfloat16 s to float64 beside the Python float (CuPy's where, which has no
    bfloat16 loop, to float32), and that tile's softmax and products then ran in float64.
    Today s comes out float32 (`q_i * scale`: a Python float promotes bfloat16 on numpy and
    CuPy alike), so the products are made bfloat16 here, as a bfloat16 GEMM's would be:
    the masked tile must keep s's dtype, p = exp(s - lse) being float32 (lse is)."""
    from minidist.cp import ring
    bf16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    q, k, v, g = (a.astype(bf16) for a in _qkv(T=8) + [_qkv(T=8, seed=1)[0]])
    y, lse = partial_attention(q, k, v, 0, 0, 4)                 # bfloat16, float32
    D = (g.astype(np.float32) * y.astype(np.float32)).sum(axis=-1)
    seen, real = set(), ring._mm

    def bf16_gemm(a, b, out=None):
        seen.update((a.dtype, b.dtype))
        return real(a, b).astype(bf16)
    monkeypatch.setattr(ring, "_mm", bf16_gemm)
    dq, dkv = np.zeros_like(q), np.zeros((2,) + k.shape, bf16)
    attend_block_backward(g, q, [(0, 8)], np.stack([k, v]), [(0, 8)], lse, D, dq, dkv, 4)
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


def _flags(*extra):
    return train_parser().parse_args(["--block-size", "16", "--batch-size", "4", *extra])


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


def _check_recompute_is_bitwise(rows):
    """A "+ckpt" run ends where the same run without recompute ends, to the last bit."""
    by_name = {r["run"]: r for r in rows}
    pairs = [(r, by_name[r["run"].removesuffix("+ckpt")]) for r in rows
             if r["run"].endswith("+ckpt")]
    assert pairs
    for ckpt, plain in pairs:
        assert ckpt["losses"] == plain["losses"], (ckpt, plain)
        assert ckpt["param_diff"] == plain["param_diff"], (ckpt, plain)


def _check_memory(row, n):
    """Activations per cp rank = 1/n of one process's, without and with recompute, and
    recompute keeps less."""
    assert abs(row["ratio"] - 1 / n) < 1e-3 and abs(row["ratio_ckpt"] - 1 / n) < 1e-3
    assert row["per_rank_ckpt"] < row["per_rank"] / 2


def test_cp2_is_exact_and_sends_the_formula(mpi):
    """cp 2, zig-zag and naive, also with --ckpt-activations (the ring forward recomputed
    inside backward), against one process without recompute in float64 (and bit-identical
    to the same run without it); bytes; activations.

        mpiexec -n 2 python tests/scripts/cp_check.py --runs cp2,cp2+naive,cp2+ckpt,...
    """
    runs = ["cp2", "cp2+naive", "cp2+ckpt", "cp2+naive+ckpt"]
    out = mpi(2, "tests/scripts/cp_check.py", "--runs", ",".join(runs), timeout=180)
    rows = tagged_json(out, "RESULT")
    _check_exact(rows, runs)
    _check_recompute_is_bitwise(rows)
    _check_memory(tagged_json(out, "MEMORY")[0], 2)


def _check_exact(rows, runs):
    """Every run present, equal to one process (NaN fails: each difference compared alone),
    the cp bytes = the formula."""
    assert [r["run"] for r in rows] == runs
    for r in rows:
        assert all(r[k] < 1e-10 for k in ("loss_diff", "norm_diff", "param_diff")), r
        assert r["bytes_sent"] == r["theory_sent"]
        assert r.get("tp_sent") == r.get("tp_theory_sent"), r       # cp x tp: the tp group


def _check_reloads(rows, runs, ranks):
    """The --resume-runs rows: the checkpoint holds one process's parameters and Adam
    moments (1e-10), loads bitwise into the same layout, ZeRO-1 and tp 2 without cp, and
    the resumed step logs the run's own next loss (asserted in the script)."""
    reloads = [r["reload"] for r in rows if r["run"] in runs]
    assert len(reloads) == len(runs)
    for r in reloads:
        assert r["param_diff"] < 1e-10 and r["adam_diff"] < 1e-10, r
        assert [r["same"], r["zero1"], r[f"tp2xdp{ranks // 2}+zero3"]] == ["bitwise"] * 3
        assert math.isfinite(r["next_loss"])


def test_cp4_and_compositions_are_exact(mpi):
    """cp 4, cp 2 x dp 2 (DDP, ZeRO-1/2/3, grad-accum; ZeRO-3 and ZeRO-2 + grad-accum with
    hybrid sharding, each dp replica's cp ranks one sharded replica), cp 2 x tp 2, both
    splits, and with ZeRO-1/2/3 over dp x cp (cp x tp x ZeRO-3 and cp x tp x SP x ZeRO-2
    hybrid too: --zero-shard 1, each cp rank a replica) (the ZeRO-3 runs' sharded
    checkpoints saved and loaded back); and
    with --ckpt-activations ("+ckpt") cp 4, cp 2 x dp 2 (DDP, ZeRO-1/2, ZeRO-3 with
    grad-accum), cp 2 x tp 2 (both splits; ZeRO-3), each bit-identical to the same run
    without it; cp 2 x tp 2 with --sequence-parallel ("+sp": SP_RUNS). Bytes on the cp and
    tp groups = their formulas; the activation ledger of cp x tp without and with SP.

        mpiexec -n 4 python tests/scripts/cp_check.py --runs cp4,cp4+naive,cp2xdp2,... \
            --resume-runs cp2xtp2+zero3,cp2xtp2+sp+zero3,cp2xtp2+zero3+shard1
    """
    runs = ["cp4", "cp4+naive", "cp2xdp2", "cp2xdp2+naive+accum", "cp2xdp2+zero1",
            "cp2xdp2+zero2", "cp2xdp2+zero3", "cp2xdp2+zero3+accum", "cp2xdp2+zero3+shard2",
            "cp2xdp2+zero2+shard2+accum", "cp2xtp2", "cp2xtp2+naive",
            "cp2xtp2+zero1", "cp2xtp2+zero2+naive", "cp2xtp2+zero3",
            "cp4+ckpt", "cp2xdp2+ckpt", "cp2xdp2+zero1+ckpt", "cp2xdp2+zero2+ckpt",
            "cp2xdp2+zero3+accum+ckpt", "cp2xtp2+ckpt", "cp2xtp2+naive+ckpt",
            "cp2xtp2+zero3+ckpt", "cp2xtp2+zero3+shard1", "cp2xtp2+sp+zero2+shard1", *SP_RUNS]
    resumed = ["cp2xtp2+zero3", "cp2xtp2+sp+zero3", "cp2xtp2+zero3+shard1"]
    out = mpi(4, "tests/scripts/cp_check.py", "--runs", ",".join(runs), "--resume-runs",
              ",".join(resumed), timeout=240)
    rows = tagged_json(out, "RESULT")
    _check_exact(rows, runs)
    _check_reloads(rows, resumed, 4)
    assert tagged_json(out, "MESH")[0]["cp_group_of_0"] == [0, 1]
    _check_recompute_is_bitwise(rows)
    _check_memory(tagged_json(out, "MEMORY")[0], 4)
    _check_sp_memory(tagged_json(out, "MEMORY_SP")[0], 2)


# cp 2 x tp 2 with sequence parallelism: both splits, DDP and ZeRO-1/2/3 over dp x cp, and
# with --ckpt-activations (bitwise its twin without)
SP_RUNS = ["cp2xtp2+sp", "cp2xtp2+sp+naive", "cp2xtp2+sp+zero1", "cp2xtp2+sp+zero2+naive",
           "cp2xtp2+sp+zero3", "cp2xtp2+sp+ckpt", "cp2xtp2+sp+zero3+ckpt"]


def _check_sp_memory(row, tp):
    """The activation ledger of a cp x tp rank: sequence parallelism keeps less, without
    and with recompute; every (B, Tl, C) buffer the graph keeps without it is, with it, a
    (B, Tl/tp, C) one (the residual stream split by tp again)."""
    for plain, sp in (("cp2xtp2", "cp2xtp2+sp"), ("cp2xtp2+ckpt", "cp2xtp2+sp+ckpt")):
        a, b = row[plain], row[sp]
        assert b["per_rank"] < a["per_rank"] and a["split"] == 0, row
        assert a["whole"] == tp * b["split"] and b["whole"] == 0 < b["split"], row


@pytest.mark.slow
def test_cp2_tp2_dp2_zero_on_8_ranks_is_exact_and_resumes(mpi):
    """cp 2 x tp 2 x dp 2 with ZeRO-1, ZeRO-2 and ZeRO-3 (+ grad-accum 2) over the 4 dp x cp
    ranks of each tp part, and with --sequence-parallel (DDP; ZeRO-3 + grad-accum 2), = one
    process; the ZeRO-3 runs' checkpoints load back bitwise (same layout, ZeRO-1, tp 2 x
    dp 4 without cp) and resume:

        mpiexec -n 8 python tests/scripts/cp_check.py --runs cp2xtp2xdp2+zero1,\
cp2xtp2xdp2+zero2,cp2xtp2xdp2+zero3+accum,cp2xtp2xdp2+sp,cp2xtp2xdp2+sp+zero3+accum \
            --resume-runs cp2xtp2xdp2+zero3+accum,cp2xtp2xdp2+sp+zero3+accum
    """
    runs = ["cp2xtp2xdp2+zero1", "cp2xtp2xdp2+zero2", "cp2xtp2xdp2+zero3+accum",
            "cp2xtp2xdp2+sp", "cp2xtp2xdp2+sp+zero3+accum"]
    resumed = ["cp2xtp2xdp2+zero3+accum", "cp2xtp2xdp2+sp+zero3+accum"]
    out = mpi(8, "tests/scripts/cp_check.py", "--runs", ",".join(runs), "--resume-runs",
              ",".join(resumed), timeout=300)
    rows = tagged_json(out, "RESULT")
    _check_exact(rows, runs)
    _check_reloads(rows, resumed, 8)


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


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--lr", "1e-2", "--eval-iters", "2", "--log-every", "1",
        "--steps", "3", "--eval-every", "0", "--dtype", "float64", "--sample", "20"]


def _losses(path):
    import json
    return [r.get("loss", r.get("val_loss")) for r in map(json.loads, open(path))]


def _sample(stdout):
    assert stdout.count("---- sample ----") == 1, stdout            # printed by rank 0 alone
    return stdout.split("---- sample ----\n")[1].split("\n----------------")[0]


@pytest.mark.mpi
def test_train_gpt_cp2_matches_one_process_and_resumes_on_one(corpus, tmp_path, mpi):
    """train_gpt.py --cp 2 logs one process's losses, val loss and sample (float64); its
    checkpoint (DDP's: the replicated model, from rank 0) resumes on one process:

        python examples/train_gpt.py --data CORPUS --dtype float64 ... --log-json one.jsonl
        mpiexec -n 2 python examples/train_gpt.py --cp 2 ... --save ck
    """
    import subprocess
    import sys
    from mpirun import device_flags, mpi_env
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache"]
    one, cp = tmp_path / "one.jsonl", tmp_path / "cp.jsonl"
    ref = subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common),
                          "--log-json", str(one), *device_flags(mpi.device)], cwd=ROOT,
                         env=mpi_env(), text=True, capture_output=True, check=True).stdout
    out = mpi(2, "examples/train_gpt.py", *common, "--cp", "2", "--log-json", cp,
              "--save", tmp_path / "ck", timeout=120).stdout
    assert "context parallel: cp 2" in out and "MiB sent per rank per step on the cp" in out
    assert np.allclose(_losses(cp), _losses(one), rtol=0, atol=1e-10)
    assert _sample(out) == _sample(ref)
    back = tmp_path / "back.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), "--resume",
                    str(tmp_path / "ck"), "--log-json", str(back), *device_flags(mpi.device)],
                   cwd=ROOT, env=mpi_env(), text=True, capture_output=True, check=True)
    assert abs(_losses(back)[-1] - _losses(one)[-1]) <= 1e-10


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("sp", [[], ["--sequence-parallel"]])
def test_train_gpt_cp2_tp2_zero3_matches_one_process_and_resumes(corpus, tmp_path, mpi, sp):
    """train_gpt.py --cp 2 --tp 2 --zero 3 (also with --sequence-parallel) logs one
    process's losses (float64); stopped at step 2 and resumed from its checkpoint (one ZeRO
    folder per tp rank, sharded over the dp x cp ranks) it logs the uninterrupted run's, bit
    for bit, also resumed as cp 2 x tp 2 with ZeRO-1 (another stage: ZeRO reshards):

        mpiexec -n 4 python examples/train_gpt.py --cp 2 --tp 2 --zero 3 ... --stop-at 2 --save ck
        mpiexec -n 4 python examples/train_gpt.py --cp 2 --tp 2 --zero 3 ... --resume ck
    """
    import subprocess
    import sys
    from mpirun import device_flags, mpi_env
    common = [*TINY, "--sample", "0", "--data", corpus, "--cache-dir", tmp_path / "cache"]
    layout = ["--cp", "2", "--tp", "2", "--zero", "3", *sp]
    one, straight = tmp_path / "one.jsonl", tmp_path / "straight.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), "--log-json",
                    str(one), *device_flags(mpi.device)], cwd=ROOT, env=mpi_env(), text=True,
                   capture_output=True, check=True)
    out = mpi(4, "examples/train_gpt.py", *common, *layout, "--log-json", straight,
              timeout=120).stdout
    assert "context parallel: cp 2 x dp 1 x tp 2" in out and "ZeRO stage 3 over 2 ranks" in out
    assert f"sequence parallel {'on' if sp else 'off'}" in out
    assert np.allclose(_losses(straight), _losses(one), rtol=0, atol=1e-10)
    mpi(4, "examples/train_gpt.py", *common, *layout, "--save", tmp_path / "ck", "--stop-at",
        "2", timeout=120)
    for stage in ("3", "1"):
        back = tmp_path / f"back{stage}.jsonl"
        mpi(4, "examples/train_gpt.py", *common, *layout, "--zero", stage, "--resume",
            tmp_path / "ck", "--log-json", back, timeout=120)
        assert _losses(back) == _losses(straight)[2:], stage


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
    """RingSelfAttention's own backward (the ring's tiles, the log-sum-exp, the dq and dkv
    sent home) against central differences, float64: one rank holding a zig-zag sequence
    of two pieces, tiles of 2 positions (review 38: only compared with tiled attention)."""
    from mpi4py import MPI
    from minidist.autograd.gradcheck import gradcheck
    from minidist.comm import ProcessGroup
    from minidist.cp.ring import RingSelfAttention
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank cp")
    ring = RingContext(group, split="zigzag", block=2)
    ring.restore([layout(8, 1, 0, "zigzag")])            # (what RingContext.part sets)
    assert len(ring.layouts[0]) == 2                      # two pieces: both tile orders
    qkv = Tensor(np.random.default_rng(3).standard_normal((2, 8, 12)), requires_grad=True)
    gradcheck(lambda t: RingSelfAttention.apply(t, 2, ring, 0.0, None), [qkv],
              name="RingSelfAttention")
    site = DropoutSite(DropoutKeys(5), "transformer.h.0.attn.attn_dropout")   # keyed masks:
    gradcheck(lambda t: RingSelfAttention.apply(t, 2, ring, 0.25, site), [qkv],   # the same
              name="RingSelfAttention with dropout")                          # every call


# ---- Ulysses attention (--cp-attention ulysses, minidist/cp/ulysses.py) ----------------------

def test_ulysses_exchange_gradcheck_on_one_rank():
    """On one rank the all-to-all keeps everything: HeadsForTokens and TokensForHeads are the
    reorder alone (a zig-zag order), and their backward passes a float64 gradcheck."""
    from mpi4py import MPI
    from minidist.autograd.gradcheck import gradcheck
    from minidist.comm import ProcessGroup
    from minidist.cp.ulysses import HeadsForTokens, TokensForHeads
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank cp")
    order = np.array([0, 1, 6, 7, 2, 3, 4, 5])                     # a zig-zag rank order
    x = Tensor(np.random.default_rng(4).standard_normal((2, 8, 6)), requires_grad=True)
    gradcheck(lambda t: HeadsForTokens.apply(t, group, order, 3), [x], name="HeadsForTokens")
    gradcheck(lambda t: TokensForHeads.apply(t, group, order, 1), [x], name="TokensForHeads")
    assert np.array_equal(HeadsForTokens.apply(x, group, order, 3).data[:, order], x.data)


def test_ulysses_bytes_formula_against_the_ring():
    """8S(N-1)/N per layer and micro-batch (12S(N-1)/N with recompute) against the ring's
    (6N-4)S: half the ring's at N = 2, and Ulysses' falls with N where the ring's grows."""
    from minidist.cp.ulysses import ulysses_bytes
    assert ulysses_bytes(12, 2) == 48 and ulysses_bytes(12, 4) == 72
    assert ulysses_bytes(12, 4, recompute=True) == 108
    assert ulysses_bytes(12, 2) * 2 == ring_bytes(12, 2)
    S0 = 4096                                                    # one sequence's B T C bytes
    ring = [ring_bytes(S0 // n, n) for n in (2, 4, 8)]
    ulysses = [ulysses_bytes(S0 // n, n) for n in (2, 4, 8)]
    assert ring == sorted(ring) and ulysses == sorted(ulysses, reverse=True)


@pytest.mark.parametrize("extra,words", [
    (["--cp", "4", "--n-head", "2", "--n-embd", "16"],
     "--cp-attention ulysses gives each of the --cp 4 ranks whole heads: --n-head 2 = 2 "
     "heads do not divide by --cp 4"),
    (["--cp", "4", "--tp", "2", "--n-head", "4"],
     "--n-head 4 / --tp 2 = 2 heads do not divide by --cp 4")])
def test_ulysses_refuses_heads_that_do_not_divide(extra, words):
    args = _flags("--cp-attention", "ulysses", *extra)
    problems = cp_problems(args)
    assert len(problems) == 1 and words in problems[0], problems
    args.cp_attention = "ring"
    assert cp_problems(args) == []                               # the ring takes any heads


def test_cp_attention_without_cp_is_refused():
    from minidist.train.idle_flags import check_idle_flags
    with pytest.raises(UsageError, match=r"^--cp-attention ulysses: sets how context "
                       r"parallelism computes attention, which this run does not use \(add "
                       r"--cp 2 or more"):
        check_idle_flags(_flags("--cp-attention", "ulysses"))
    check_idle_flags(_flags("--cp-attention", "ring"))           # the default: no complaint


def _check_ulysses_rows(out, runs):
    """The RING row (Ulysses' attention = the ring's on the same input) and every run exact,
    its cp bytes = ulysses_bytes, its summary naming the attention."""
    assert max(tagged_json(out, "RING")[0].values()) < 1e-12
    rows = tagged_json(out, "RESULT")
    _check_exact(rows, runs)
    assert all("ulysses attention" in r["summary"] for r in rows)
    return rows


@pytest.mark.mpi
def test_ulysses_cp2_is_exact_and_sends_the_formula(mpi):
    """--cp 2 --cp-attention ulysses, float64, 3 steps against one process: zig-zag and
    naive, dropout 0.1, --ckpt-activations (the all-to-alls redone inside backward), tiled
    local attention, grad-accum; cp bytes = 8S(N-1)/N per layer (12S(N-1)/N with recompute):

        mpiexec -n 2 python tests/scripts/ulysses_check.py --runs u2,u2+naive,u2+drop,...
    """
    runs = ["u2", "u2+naive", "u2+drop", "u2+ckpt", "u2+naive+drop+ckpt", "u2+tiled+drop",
            "u2+accum"]
    out = mpi(2, "tests/scripts/ulysses_check.py", "--runs", ",".join(runs), timeout=180)
    rows = _check_ulysses_rows(out, runs)
    by = {r["run"]: r for r in rows}
    assert by["u2+ckpt"]["losses"] == by["u2"]["losses"]              # recompute: bitwise
    assert by["u2+ckpt"]["bytes_sent"] == 1.5 * by["u2"]["bytes_sent"]
    assert by["u2+drop"]["losses"] != by["u2"]["losses"]              # dropout acted


@pytest.mark.mpi
def test_ulysses_cp4_and_compositions_are_exact(mpi):
    """On 4 ranks: cp 4 (naive with dropout; tiled with recompute), cp 2 x dp 2 (DDP, ZeRO-1,
    ZeRO-2 with dropout, ZeRO-3 with grad-accum and recompute), cp 2 x tp 2 (naive with
    dropout; --sequence-parallel, also naive with dropout, and with dropout and recompute;
    ZeRO-3, its sharded checkpoint loaded back into the same layout, ZeRO-1 and tp 2 x dp 2
    without cp, and the next step's loss the same bit for bit):

        mpiexec -n 4 python tests/scripts/ulysses_check.py --runs u4,u4+naive+drop,... \
            --resume-runs u2xtp2+zero3
    """
    runs = ["u4", "u4+naive+drop", "u4+tiled+ckpt", "u2xdp2", "u2xdp2+zero1",
            "u2xdp2+zero2+drop", "u2xdp2+zero3+accum+ckpt", "u2xtp2+naive+drop", "u2xtp2+sp",
            "u2xtp2+sp+naive+drop", "u2xtp2+sp+drop+ckpt", "u2xtp2+zero3"]
    out = mpi(4, "tests/scripts/ulysses_check.py", "--runs", ",".join(runs), "--resume-runs",
              "u2xtp2+zero3", timeout=240)
    rows = _check_ulysses_rows(out, runs)
    reload = rows[-1]["reload"]
    assert reload["param_diff"] < 1e-10 and reload["adam_diff"] < 1e-10
    assert [reload["same"], reload["zero1"], reload["tp2xdp2+zero3"]] == ["bitwise"] * 3


@pytest.mark.mpi
def test_train_gpt_ulysses_matches_one_process_and_resumes_with_the_ring(corpus, tmp_path,
                                                                        mpi):
    """train_gpt.py --cp 2 --cp-attention ulysses logs one process's losses, val loss and
    sample (float64) and says which attention ran; stopped at step 2, its checkpoint (nothing
    of the attention in it) resumes under the ring, and on one process, to the same losses:

        python examples/train_gpt.py --data CORPUS --dtype float64 ... --log-json one.jsonl
        mpiexec -n 2 python examples/train_gpt.py --cp 2 --cp-attention ulysses ... \
            --stop-at 2 --save ck
        mpiexec -n 2 python examples/train_gpt.py --cp 2 ... --resume ck
    """
    import subprocess
    import sys
    from mpirun import device_flags, mpi_env
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache"]
    one, cp = tmp_path / "one.jsonl", tmp_path / "cp.jsonl"

    def single(*flags):
        return subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common),
                               *map(str, flags), *device_flags(mpi.device)], cwd=ROOT,
                              env=mpi_env(), text=True, capture_output=True, check=True).stdout
    ref = single("--log-json", one)
    ulysses = ["--cp", "2", "--cp-attention", "ulysses"]
    out = mpi(2, "examples/train_gpt.py", *common, *ulysses, "--log-json", cp,
              timeout=120).stdout
    assert "context parallel over 2 ranks (zigzag, ulysses attention)" in out
    assert "Ulysses attention: an all-to-all per layer to 1 of the 2 heads over" in out
    assert np.allclose(_losses(cp), _losses(one), rtol=0, atol=1e-10)
    assert _sample(out) == _sample(ref)
    mpi(2, "examples/train_gpt.py", *common, *ulysses, "--save", tmp_path / "ck", "--stop-at",
        "2", timeout=120)
    ring, alone = tmp_path / "ring.jsonl", tmp_path / "alone.jsonl"
    mpi(2, "examples/train_gpt.py", *common, "--cp", "2", "--resume", tmp_path / "ck",
        "--log-json", ring, timeout=120)
    single("--resume", tmp_path / "ck", "--log-json", alone)
    for back in (ring, alone):
        assert len(_losses(back)) == 2                          # step 2 and the val loss
        assert np.allclose(_losses(back), _losses(one)[2:], rtol=0, atol=1e-10)


@pytest.mark.mpi
@pytest.mark.parametrize("model,layout_flags", [
    (["--dropout", "0.1"], ["--cp", "2", "--pp", "2", "--schedule", "gpipe",
                            "--ckpt-activations"]),
    (["--dropout", "0.1"], ["--cp", "2", "--pp", "2", "--schedule", "zb-h1"]),
    (["--moe-experts", "4"], ["--cp", "2", "--ep", "2"])], ids=["pp-gpipe-ckpt", "pp-zbh1",
                                                              "moe-ep"])
def test_train_gpt_ulysses_in_pipeline_stages_and_with_experts(corpus, tmp_path, mpi, model,
                                                                layout_flags):
    """Ulysses needs nothing of its own inside pipeline stages (each micro-batch runs in the
    context's part, the all-to-alls in its blocks) or with MoE layers (they route over the
    whole sequence by the context's positions, as under the ring): 4 ranks, float64, one
    process's losses (the same `model` flags: dropout 0.1, or 4 experts):

        mpiexec -n 4 python examples/train_gpt.py --cp 2 --pp 2 --cp-attention ulysses ...
    """
    import subprocess
    import sys
    from mpirun import device_flags, mpi_env
    common = [*TINY, "--sample", "0", "--data", corpus, "--cache-dir", tmp_path / "cache",
              *model]
    one, mine = tmp_path / "one.jsonl", tmp_path / "mine.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common),
                    "--log-json", str(one), *device_flags(mpi.device)], cwd=ROOT,
                   env=mpi_env(), text=True, capture_output=True, check=True)
    out = mpi(4, "examples/train_gpt.py", *common, *layout_flags, "--cp-attention", "ulysses",
              "--log-json", mine, timeout=120).stdout
    assert "ulysses attention" in out
    assert np.allclose(_losses(mine), _losses(one), rtol=0, atol=1e-10)


@pytest.mark.mpi
def test_ulysses_heads_not_dividing_is_one_error_line(mpi):
    """mpiexec -n 2 python examples/train_gpt.py --cp 2 --cp-attention ulysses --n-head 3
    --n-embd 48"""
    out = mpi(2, "examples/train_gpt.py", "--cp", "2", "--cp-attention", "ulysses",
              "--n-head", "3", "--n-embd", "48", timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: context parallelism: ")
    assert out.stderr.count("heads do not divide by --cp 2") == 1


def test_cp_attention_flag_offers_what_the_context_runs():
    """--cp-attention's choices (minidist/train/args.py keeps them literal: it is imported
    before numpy is) are RingContext's ATTENTIONS, which the planner's search also tries."""
    from minidist.cp.context import ATTENTIONS
    from minidist.train.search import CP_ATTENTIONS
    assert ATTENTIONS == CP_ATTENTIONS
    assert "--cp-attention {" + ",".join(ATTENTIONS) + "}" in train_parser().format_help()
