"""Muon (`--optimizer muon`, minidist/optim/muon.py): Newton-Schulz against the SVD it
approximates; a step worked by hand (Muon for a block's matrix, AdamW for its bias); which
parameters Muon takes; which rank runs each matrix's NS (ZeRO's, TP's, by hand), and under
TP (and TP x ZeRO) each tp rank its share of them, once each (counted); every layout (tp
and ZeRO gather a matrix's update whole) = one process, resumed bit for bit and resumed in
another layout; ZeRO's and TP's extra bytes = their formulas; a resumed run takes the
checkpoint's optimizer; the flags refused where they do nothing.

Run: python -m pytest -q tests/test_muon.py
"""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from minidist import backend
from minidist.nn import GPT, GPTConfig
from minidist.nn.module import Parameter
from minidist.optim import AdamW
from minidist.optim.muon import (Muon, balance, block_of, newton_schulz, ns_flops,
                                 packed_flops, takes_muon, tp_owners)
from minidist.train.args import train_parser
from mpirun import ROOT, mpi_env, train_tiny, within


TRAIN = os.path.join(ROOT, "examples", "train_gpt.py")
A, B, C = 3.4445, -4.7750, 2.0315          # Jordan et al.'s quintic


def by_the_svd(u, steps=5):
    """NS(u) as its definition says it acts: u = P diag(s) Q^T, each s / ||u||_F taken
    through p(x) = A x + B x^3 + C x^5 `steps` times, the singular vectors kept."""
    p, s, qt = np.linalg.svd(u, full_matrices=False)
    x = s / (np.linalg.norm(u) + 1e-7)
    for _ in range(steps):
        x = A * x + B * x ** 3 + C * x ** 5
    return p @ np.diag(x) @ qt


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8), (1, 5)])
def test_newton_schulz_takes_each_singular_value_through_the_quintic(xp, shape):
    """float64: NS(u) = P diag(p^5(s / ||u||_F)) Q^T to 1e-13, wide, tall (run transposed)
    or square; for a random matrix every singular value lands in [0.68, 1.2] (about
    orthogonal, not exactly: the quintic trades convergence for 5 steps); a stack is each
    matrix's NS. (On the --device's arrays: a GPU session checks cupy's.)"""
    u = np.random.default_rng(0).standard_normal(shape)
    o = newton_schulz(xp.asarray(u))
    assert o.shape == u.shape and o.dtype == u.dtype
    o = backend.to_host(o)
    np.testing.assert_allclose(o, by_the_svd(u), rtol=0, atol=1e-13)
    s = np.linalg.svd(o, compute_uv=False)
    assert s.min() > 0.68 and s.max() < 1.2, s
    v = xp.asarray(np.random.default_rng(1).standard_normal(shape))
    stack = newton_schulz(xp.stack([xp.asarray(u), -xp.asarray(u), v]))
    np.testing.assert_array_equal(backend.to_host(stack),
                                  np.stack([o, -o, backend.to_host(newton_schulz(v))]))


def test_a_step_worked_by_hand(xp):
    """Two steps of Muon on a block's matrix W (3 x 5) and its bias b, with lr, wd, mu:
        W <- W (1 - lr wd); M <- mu M + G; U <- G + mu M; W <- W - lr 0.2 sqrt(5) NS(U)
    (NS by the SVD), and b moved as AdamW moves it (no decay: a bias)."""
    rng = np.random.default_rng(1)
    w0, b0 = rng.standard_normal((3, 5)), rng.standard_normal(5)
    g1, g2 = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    gb1, gb2 = rng.standard_normal(5), rng.standard_normal(5)
    lr, wd, mu = 0.02, 0.1, 0.9
    w, b = Parameter(xp.asarray(w0)), Parameter(xp.asarray(b0), decay=False)
    opt = Muon([("transformer.h.0.mlp.c_fc.weight", w), ("transformer.h.0.mlp.c_fc.bias", b)],
               lr=lr, weight_decay=wd, momentum=mu)
    ref_b = Parameter(xp.asarray(b0), decay=False)
    ref = AdamW([("bias", ref_b)], lr=lr, weight_decay=wd)
    assert [g["names"] for g in opt.param_groups] == [
        ["transformer.h.0.mlp.c_fc.weight"], [], ["transformer.h.0.mlp.c_fc.bias"]]
    want, m = w0.copy(), np.zeros((3, 5))
    for g, gb in ((g1, gb1), (g2, gb2)):
        w.grad, b.grad, ref_b.grad = xp.asarray(g), xp.asarray(gb), xp.asarray(gb)
        opt.step()
        ref.step()
        want = want * (1 - lr * wd)
        m = mu * m + g
        want = want - lr * 0.2 * math.sqrt(5) * by_the_svd(g + mu * m)
        np.testing.assert_allclose(backend.to_host(w.data), want, rtol=0, atol=1e-13)
        np.testing.assert_array_equal(backend.to_host(b.data), backend.to_host(ref_b.data))
    assert set(opt.state["transformer.h.0.mlp.c_fc.weight"]) == {"step", "exp_avg"}
    np.testing.assert_allclose(backend.to_host(opt.state["transformer.h.0.mlp.c_fc.weight"][
        "exp_avg"]), m, rtol=0, atol=1e-15)


def test_packed_weights_are_orthogonalised_matrix_by_matrix(xp):
    """A Llama block with grouped-query attention (4 q heads, 2 k/v heads of 4): c_attn
    (16, 32) packs q (16 wide), k and v (8 each), the SwiGLU c_fc [gate | up]; each is its
    own matrix, with its own scale 0.2 sqrt(max(A, B)), as separate weights would be. One
    step (no momentum, no decay: U = G) moves each block of c_attn by -lr x that, by the
    SVD; c_proj (one matrix) as before."""
    from minidist.strategy.base import matrix_views
    c = GPTConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=16, block_size=8, vocab_size=16,
                  arch="llama", bias=False)
    model = GPT(c, dtype="float64")
    views = matrix_views(model)
    F = c.ffn_size
    assert views["packed"] == {"transformer.h.0.attn.c_attn.weight": (16, 8, 8),
                               "transformer.h.0.mlp.c_fc.weight": (F, F)}
    params = dict(model.named_parameters())
    before = {n: backend.to_host(p.data).copy() for n, p in params.items()}
    rng = np.random.default_rng(3)
    grads = {n: rng.standard_normal(p.shape) for n, p in params.items()}
    for n, p in params.items():
        p.grad = xp.asarray(grads[n])
    lr = 0.01
    opt = Muon(model.named_parameters(), lr=lr, weight_decay=0.0, momentum=0.0, **views)
    opt.step()

    def step_of(g, widths):
        out, lo = [], 0
        for w in widths:
            part = g[:, lo:lo + w]
            out.append(0.2 * math.sqrt(max(part.shape)) * by_the_svd(part))
            lo += w
        return -lr * np.concatenate(out, axis=1)
    for name, widths in [("attn.c_attn.weight", (16, 8, 8)), ("mlp.c_fc.weight", (F, F)),
                         ("attn.c_proj.weight", (16,))]:
        name = "transformer.h.0." + name
        moved = backend.to_host(params[name].data) - before[name]
        np.testing.assert_allclose(moved, step_of(grads[name], widths), rtol=0, atol=1e-13)
    whole = step_of(grads["transformer.h.0.attn.c_attn.weight"], (32,))
    assert np.abs(whole - step_of(grads["transformer.h.0.attn.c_attn.weight"],
                                  (16, 8, 8))).max() > 1e-3       # and that is not the same


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    """GPT-2 with MoE and a shared expert: attention, MLP, router, every expert's and the
    shared expert's matrices are Muon's; wte, wpe, norms and biases AdamW's."""
    c = GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16, moe_experts=2,
                  moe_shared=1)
    model = GPT(c, dtype="float64")
    opt = Muon(model.named_parameters())
    muon = set(opt.param_groups[0]["names"])
    assert muon == {n for n, p in model.named_parameters() if p.ndim == 2 and ".h." in n}
    assert {n.split(".h.0.")[-1] for n in muon} == {
        "attn.c_attn.weight", "attn.c_proj.weight", "mlp.router.weight",
        "mlp.experts.0.c_fc.weight", "mlp.experts.0.c_proj.weight",
        "mlp.experts.1.c_fc.weight", "mlp.experts.1.c_proj.weight",
        "mlp.shared_expert.c_fc.weight", "mlp.shared_expert.c_proj.weight"}
    assert not takes_muon("transformer.wte.weight", (16, 8), False)
    assert not takes_muon("lm_head.weight", (16, 8), True)       # the head: AdamW's


def test_zero_gives_each_matrix_to_one_rank_worked_by_hand():
    """muon.balance, the costliest first to the least busy rank (ties: the first in the
    turned order): a GPT-2 block of C 4 (NS FLOPs c_attn 4 x 12 4480, c_proj 1920, c_fc and
    the MLP's c_proj 5760 each) over 2 ranks: c_fc 0, c_proj 1, c_attn 0, c_proj 1 (10240
    against 7680); the next unit's order turned by one; over 3: 5760, 5760, 4480 + 1920."""
    costs = [ns_flops(s) for s in ((4, 12), (4, 4), (4, 16), (16, 4))]
    assert costs == [4480, 1920, 5760, 5760]
    assert balance(costs, 2) == [0, 1, 0, 1]
    assert balance(costs, 2, first=1) == [1, 0, 1, 0]
    assert balance(costs, 3) == [2, 2, 0, 1]
    assert balance(costs, 8) == [2, 3, 0, 1]          # more ranks than matrices: one each


def test_tp_gives_each_split_matrix_to_one_rank_worked_by_hand():
    """muon.tp_owners, one block's tp-split matrices by NS FLOPs of the whole matrix (a
    GPT-2 block of C 4: c_attn 4 x 12 packing q, k, v 3 x 1920 = 5760, c_proj 1920, c_fc
    and the MLP's c_proj 5760 each), the costliest first to the least busy tp rank (ties in
    block order, ranks from the block's `first`): block 0 over 2 ranks c_attn 0, c_fc 1,
    the MLP's c_proj 0, c_proj 1 (11520 against 7680); block 1 turns the order, 1 0 0 1, so
    two blocks even out (19200 each, half of one process's); over 4 ranks one each, block 5
    starting at rank 1. block_of reads the block from the name."""
    shapes, widths = [(4, 12), (4, 4), (4, 16), (16, 4)], [(4, 4, 4), None, None, None]
    assert [packed_flops(s, w) for s, w in zip(shapes, widths)] == [5760, 1920, 5760, 5760]
    assert tp_owners(shapes, widths, 2, block=0) == [0, 1, 1, 0]
    assert tp_owners(shapes, widths, 2, block=1) == [1, 0, 0, 1]
    assert tp_owners(shapes, widths, 4, block=0) == [0, 3, 1, 2]
    assert tp_owners(shapes, widths, 4, block=5) == [1, 0, 2, 3]
    assert block_of("transformer.h.5.attn.c_attn.weight") == 5
    assert block_of("transformer.h.12.mlp.experts.3.c_fc.weight") == 12


def _results(out):
    """muon_tp_check.py's RESULT lines: {run: result}."""
    return {r["run"]: r for r in (json.loads(line.split(" ", 1)[1])
                                  for line in out.splitlines() if line.startswith("RESULT"))}


@pytest.mark.mpi
def test_tp_runs_each_split_matrixs_newton_schulz_on_one_rank(mpi):
    """    mpiexec -n 2 python tests/scripts/muon_tp_check.py
    --tp 2 --optimizer muon, and --tp 2 --zero 1 (ShardedMuon, dp 1), train one process's
    numbers (float64: losses, gradient norms, every parameter to 1e-12) and share the NS
    (each rank's ns_flops_run): GPT-2, whose Muon matrices tp all splits, each rank exactly
    half of one process's FLOPs (the owners turn per block, under ZeRO per unit); MoE with a
    shared expert, whose router and routed experts are whole on both tp ranks and run NS on
    both: each rank those and half the rest. Under ZeRO the same split as without: a unit's
    matrices are all dp rank 0's, and tp_owners shares them over tp as Muon's blocks."""
    out = mpi(2, "tests/scripts/muon_tp_check.py", timeout=240).stdout
    results = _results(out)
    assert set(results) == {"gpt2", "moe", "gpt2-zero1", "moe-zero1"}, out
    for r in results.values():
        assert within(r, 1e-12), r
        assert r["params_compared"] > 20, r
    for name in ("gpt2", "gpt2-zero1"):
        gpt2 = results[name]
        # 3 steps x 2 blocks x 10 NS of 16 x 16 each (5 x 6 x 16^3 FLOPs): q, k, v, c_proj
        # one each, c_fc and the MLP's c_proj (16 x 64: 5 x (4 x 16^2 x 64 + 2 x 16^3)) three
        assert gpt2["ns_flops_one"] == 3 * 2 * 10 * 5 * 6 * 16 ** 3
        assert gpt2["ns_flops"] == [gpt2["ns_flops_one"] // 2] * 2, name
    config = GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=8, vocab_size=32,
                       moe_experts=2, moe_top_k=1, moe_shared=1)
    both = 3 * sum(ns_flops(p.shape) for n, p in GPT(config).named_parameters()
                   if p.ndim == 2 and (".mlp.router." in n or ".mlp.experts." in n))
    for name in ("moe", "moe-zero1"):
        moe = results[name]
        assert moe["ns_flops"] == [both + (moe["ns_flops_one"] - both) // 2] * 2, (both, moe)


@pytest.mark.mpi
def test_tp_x_zero_runs_each_owned_matrixs_newton_schulz_on_one_tp_rank(mpi):
    """    mpiexec -n 4 python tests/scripts/muon_tp_check.py --runs gpt2-zero1
    --tp 2 --dp 2 --zero 1 = one process (1e-12), and each matrix's NS runs once: on one
    rank of the shard group (unit_owners, over dp), then on one of its tp peers
    (ShardedMuon.tp_owners). In units of a 16 x 16 NS (c_attn 3, c_proj 1, c_fc and the
    MLP's c_proj 3 each; unit k = block k - 1 turns both orders by k, the root unit 0):
    block 0 (k 1, dp ranks in order 1, 0): c_attn dp 1, c_fc dp 0, the MLP's c_proj dp 1
    (a tie), c_proj dp 0; over tp (order 1, 0) dp 1's c_attn tp 1, the MLP's c_proj tp 0,
    dp 0's c_fc tp 1, c_proj tp 0. Block 1 (k 2, orders 0, 1): c_attn dp 0 -> tp 0, the
    MLP's c_proj dp 0 -> tp 1, c_fc dp 1 -> tp 0, c_proj dp 1 -> tp 1. World ranks (tp
    fastest) (dp 0, tp 0) 1 + 3, (0, 1) 3 + 3, (1, 0) 3 + 3, (1, 1) 3 + 1: 4, 6, 6, 4 of one
    process's 20 a step, summing to it (before, each tp peer ran its dp rank's whole 10)."""
    out = mpi(4, "tests/scripts/muon_tp_check.py", "--runs", "gpt2-zero1", timeout=240).stdout
    r = _results(out)["gpt2-zero1"]
    assert within(r, 1e-12), r
    unit = 3 * 5 * 6 * 16 ** 3                  # 3 steps of one 16 x 16 NS
    assert r["ns_flops_one"] == 20 * unit
    assert r["ns_flops"] == [4 * unit, 6 * unit, 6 * unit, 4 * unit], r
    assert sum(r["ns_flops"]) == r["ns_flops_one"]


M = {"--optimizer": "muon"}


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, flags", [
    (2, {"--zero": 3}),
    (2, {"--tp": 2, "--sequence-parallel": True}),
    (2, {"--pp": 2, "--micro-batches": 2}),
    (2, {"--cp": 2}),
    (2, {"--ep": 2, "--moe-experts": 4, "--moe-shared": 1}),
    (2, {"--arch": "llama", "--n-head": 4, "--n-kv-head": 2, "--tp": 2, "--zero": 1}),
    (2, {"--zero": 1, "--amp": True}),
    (2, {"--tp": 2, "--amp": True, "--moe-experts": 2}),
    (4, {"--tp": 2, "--zero": 2}),
    (4, {"--zero": 3, "--zero-shard": 2, "--muon-momentum": 0.9, "--muon-ns-steps": 4}),
    (4, {"--ep": 2, "--tp": 2, "--zero": 1, "--moe-experts": 4}),
    (4, {"--pp": 2, "--zero": 1, "--micro-batches": 2, "--overlap-param-gather": True}),
], ids=["zero3", "tp2-sp", "pp2", "cp2", "ep2-shared", "llama-gqa-tp2-zero1", "zero1-amp",
        "tp2-amp-moe", "tp2-zero2", "zero3-hybrid-mu0.9-ns4", "ep2-tp2-zero1",
        "pp2-zero1-overlap"])
def test_every_layout_trains_one_process_numbers(sweep, ranks, flags):
    """Each step's loss and gradient norm, the val loss and every parameter within 1e-10 of
    one process in float64 (--amp: the sweep's float16 tolerance); the 4-rank ones also
    stopped after step 2 and resumed bit for bit. TP gathers a split matrix's update whole
    and each rank keeps its shard of NS's; ZeRO all-gathers each unit's update."""
    ok, errs, run = sweep.check(ranks, {**M, **flags}, resume=ranks == 4)
    assert ok, (errs, run["stderr"][-2000:])


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, flags, into", [
    (4, {"--tp": 2, "--zero": 3}, (1, {})),
    (1, {}, (2, {"--zero": 1})),
    (2, {"--ep": 2, "--zero": 2, "--moe-experts": 4}, (1, {"--moe-experts": 4})),
], ids=["tp2-zero3-to-one", "one-to-zero1", "ep2-zero2-to-one"])
def test_a_checkpoint_resumes_in_another_layout(sweep, ranks, flags, into):
    """Stopped after step 2, resumed in another layout: step 3 and the end = one process's
    (Muon's momentum carried across: ZeRO's flat exp_avg, one process's per matrix)."""
    ok, errs = sweep.check_resharded(ranks, {**M, **flags}, (into[0], {**M, **into[1]}))
    assert ok, errs


@pytest.mark.mpi
def test_zero_sends_its_bytes_and_the_updates_collectives(mpi, corpus, tmp_path):
    """    mpiexec -n 2 python examples/train_gpt.py --zero 1 --optimizer muon
    The summary's measured bytes per step = ZeRO-1's 2(N-1)/N Psi + Muon's all-gather of
    the block units' updates and the reduce-scatter of their owners' steps, (N-1)/N of their
    padded bytes each (ShardedMuon.update_bytes). Under --tp 2, with or without --zero 1,
    the same two collectives per split matrix, over tp: (tp-1)/tp of its update each way,
    in the tp summary (ZeRO's shard group of 1 rank sends nothing)."""
    out = mpi(2, "examples/train_gpt.py", "--zero", "1", "--optimizer", "muon", "--n-layer",
              "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4", "--steps", "2",
              "--eval-iters", "1", "--sample", "0", "--data", corpus, "--cache-dir",
              str(tmp_path / "c"), timeout=120).stdout
    sent, ddp, muon = map(float, re.search(
        r"\((\S+) x; DDP sends 2\(N-1\)/N = (\S+) x, Muon's update all-gather and "
        r"reduce-scatter (\S+) x more",
        out).groups())
    # a block, C = 32: 2 norms 4C, c_attn 3C^2 + 3C, c_proj C^2 + C, c_fc 4C^2 + 4C,
    # mlp.c_proj 4C^2 + C: 12,704, even (no padding); psi = 2 blocks + the root (wte 256 C,
    # wpe 16 C, ln_f 2C: 8,768) = 34,176; each of the two collectives sends (N-1)/N = half
    # of the 2 x 12,704 block elements
    assert muon == pytest.approx(2 * 0.5 * 25408 / 34176, abs=0.005)
    assert sent == pytest.approx(ddp + muon, abs=0.011)
    assert "optimizer: Muon for the blocks' 8 matrices (24,576 parameters" in out
    # --tp 2: each rank sends its half of every split matrix's update (a ring all-gather of 2
    # sends its own chunk: 12 C^2 / 2 = 6,144 float32 values a block, 24,576 B), and the
    # reduce-scatter of the owners' steps as much again (a ring of 2 sends the other's
    # chunk): 2 blocks x 2 x 24,576 B after the gradient sync (with the clip's 8-byte norm);
    # --zero 1 as much (ShardedMuon's tp owners; 0.047 MiB when each tp rank ran every NS)
    for zero in ([], ["--zero", "1"]):
        tp = mpi(2, "examples/train_gpt.py", "--tp", "2", *zero, "--optimizer", "muon",
                 "--n-layer", "2", "--n-embd", "32", "--block-size", "16", "--batch-size",
                 "4", "--steps", "2", "--eval-iters", "1", "--sample", "0", "--data", corpus,
                 "--cache-dir", str(tmp_path / "c"), timeout=120).stdout
        after = float(re.search(r"and (\S+) MiB in the optimizer's step \(Muon's",
                                tp).group(1))
        assert after == pytest.approx(2 * 2 * 24576 / 2**20, abs=0.0006), zero


def test_a_resumed_run_takes_its_optimizer_and_refuses_another(tmp_path):
    """A --resume without --optimizer continues with the checkpoint's (its momentum and
    Newton-Schulz steps too); another optimizer is refused by name, so is --muon-* alone."""
    muon, adamw = str(tmp_path / "muon"), str(tmp_path / "adamw")
    first = train_tiny("--optimizer", "muon", "--muon-ns-steps", "3", "--save", muon)
    assert first.returncode == 0, first.stderr
    again = train_tiny("--steps", "2", "--resume", muon, "--save", muon)
    assert again.returncode == 0, again.stderr
    assert "optimizer: Muon for the blocks' 4 matrices" in again.stdout
    assert "3 Newton-Schulz steps" in again.stdout
    evaluated = subprocess.run([sys.executable, TRAIN, "--resume", muon, "--eval-only",
                                "--sample", "0"], cwd=ROOT, env=mpi_env(),
                               capture_output=True, text=True, timeout=120)
    assert evaluated.returncode == 0, evaluated.stderr
    other = train_tiny("--steps", "3", "--resume", muon, "--optimizer", "adamw")
    assert other.returncode == 2 and other.stderr == (
        f"error: --optimizer adamw: --resume {muon}/step-00000002 was trained with muon, "
        "whose state it holds; leave --optimizer out (a resumed run takes its optimizer "
        f"from the checkpoint), or start a new run from its weights: --init-from "
        f"{muon}/step-00000002 --optimizer adamw (step 0, a fresh optimizer; --save a new "
        "folder)\n")
    # the advice runs (it sent the user through an export: first-use walk, session 35)
    assert train_tiny("--steps", "2", "--init-from", f"{muon}/step-00000002", "--optimizer",
                      "adamw").returncode == 0
    assert train_tiny("--save", adamw).returncode == 0
    into = train_tiny("--steps", "2", "--resume", adamw, "--optimizer", "muon")
    assert into.returncode == 2 and "was trained with adamw" in into.stderr
    alone = train_tiny("--muon-momentum", "0.9")
    assert alone.returncode == 2 and alone.stderr == (
        "error: --muon-momentum 0.9: sets Muon's momentum, which this run does not use (add "
        "--optimizer muon, or leave --muon-momentum out)\n")
    bad = train_tiny("--optimizer", "muon", "--muon-momentum", "1")
    assert bad.returncode == 2 and "--muon-momentum 1.0: a decay in [0, 1)" in bad.stderr


def _muon_shares(n_layer, n_embd, block_size, n_head):
    """(the blocks' share of the parameters, Muon's matrix elements) of a byte-level GPT."""
    model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                          block_size=block_size, vocab_size=256), seed=0)
    named = list(model.named_parameters())
    blocks = sum(p.size for name, p in named if name.startswith("transformer.h."))
    matrices = sum(p.size for name, p in named if takes_muon(name, p.shape, p.decay))
    return blocks / sum(p.size for _, p in named), matrices


def test_the_chapters_figures_are_the_main_jobs_model():
    """minidist/optim/README.md's figures for train_gpt.py's default model (bytes: vocabulary
    256) and for the bytes test's (--n-layer 2 --n-embd 32 --block-size 16), from the models'
    parameters: on 2 ranks Muon's all-gather and reduce-scatter under ZeRO-1 each send half
    of the block units (the blocks' share of the parameters in all), and under --tp 2 each
    rank's half of every split matrix in float32 each way; c_attn's Newton-Schulz as one
    C x 3C matrix against q, k and v (70 against 90 C^3). The commands beside them print the
    same (tests/test_muon.py::test_zero_sends_its_bytes_and_the_updates_collectives)."""
    args = train_parser().parse_args([])
    share, matrices = _muon_shares(args.n_layer, args.n_embd, args.block_size, args.n_head)
    small, small_matrices = _muon_shares(2, 32, 16, args.n_head)
    text = " ".join(open(f"{ROOT}/minidist/optim/README.md").read().split())
    mib = 4 / 2**20
    for said in [f"sends {1 + share:.2f} x the parameters' bytes a step, ZeRO-1's 1.00 x plus "
                 f"Muon's {share:.2f} x", f"the blocks are {share:.0%} of the parameters",
                 f"{1 + small:.2f} x = 1.00 + {small:.2f}",
                 f"{matrices * mib:.3f} MiB a step, each rank's half of the {matrices:,} matrix",
                 f"({small_matrices * mib:.3f} MiB for the test's model; "
                 f"{matrices * mib / 2:.3f} and {small_matrices * mib / 2:.3f} when",
                 "its NS costs 90 C^3 FLOPs instead of 70"]:
        assert said in text, said
    c = args.n_embd
    assert packed_flops((c, 3 * c)) == 70 * c**3
    assert packed_flops((c, 3 * c), (c, c, c)) == 90 * c**3
