"""Auxiliary-loss-free load balancing (`--moe-bias-rate`, minidist/nn/moe_bias.py): the bias
picks the experts, not their weights (by hand, through the layer); capacity drops follow the
biased choice; the update b += gamma sign(mean - load) by hand; the counts cover each
micro-batch once (recompute and evaluation add nothing); on a tiny model the biases lower the
max / mean load against gamma 0; every layout (ep, dp x ep, ep x cp, ep x tp + SP, pp, ZeRO-3
x ep, --grad-accum) = one process in float64: losses, parameters, biases and the loads
counted; a checkpoint resumes bit for bit, in another layout, and from before the biases
(they start at 0); a resume takes, or changes and notes, the rate; the flag is refused where
it does nothing.

Run: python -m pytest -q tests/test_moe_bias.py   (the slow layouts: -m slow)
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist import backend
from minidist.autograd import Tensor, no_grad
from minidist.autograd import fused as F
from minidist.nn import GPT, GPTConfig
from minidist.nn.block import MLP
from minidist.nn.moe import MoE, route
from minidist.nn.moe_bias import RouterBias, global_loads, imbalance
from minidist.strategy import checkpoint
from minidist.train.gather import router_bias, run_flags
from mpirun import ROOT, mpi_env, train_tiny



def config(**kw):
    return GPTConfig(**{**dict(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=16,
                               moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0), **kw})


def test_the_bias_picks_the_experts_worked_by_hand():
    """Two tokens, 3 experts, top-1: both prefer expert 0 (0.5 > 0.3, 0.4 > 0.35); a bias of
    +0.15 on expert 1 turns token 1 (0.35 + 0.15 = 0.5 > 0.4), not token 0 (0.45 < 0.5)."""
    probs = np.array([[0.5, 0.3, 0.2], [0.4, 0.35, 0.25]])
    assert route(probs, 1, 2, 2).expert.tolist() == [0, 0]
    r = route(probs, 1, 2, 2, bias=np.array([0.0, 0.15, 0.0]))
    assert list(zip(r.token, r.expert)) == [(0, 0), (1, 1)]
    assert r.chosen.tolist() == [[1, 1, 0]]


def test_capacity_drops_in_the_order_of_the_biased_choice():
    """T 3, E 2, cap 1: unbiased, tokens 0 and 1 pick expert 0 (token 1 dropped), token 2
    expert 1; with -0.25 on expert 0 all three pick expert 1, which keeps token 0 (GShard's
    token order) and drops 1 and 2; `chosen` counts the biased choices before dropping."""
    probs = np.array([[0.6, 0.4], [0.55, 0.45], [0.3, 0.7]])
    r = route(probs, 1, 1, 3)
    assert list(zip(r.token, r.expert)) == [(0, 0), (2, 1)] and r.dropped == 1
    r = route(probs, 1, 1, 3, bias=np.array([-0.25, 0.0]))
    assert list(zip(r.token, r.expert)) == [(0, 1)] and r.dropped == 2
    assert r.chosen.tolist() == [[0, 3]]


def test_the_layer_weights_its_experts_by_the_unbiased_probabilities():
    """The layer with a bias (top-1, no dropping): each token runs argmax(probs + b), and its
    output is probs[n, e] (not probs + b) x expert e's MLP on it, computed here by hand."""
    layer = MoE(config(moe_top_k=1, moe_capacity_factor=0.0), MLP, dtype="float64")
    layer.bias = np.array([0.0, 0.3, -0.3, 0.0])
    x = np.random.default_rng(0).standard_normal((2, 5, 8))
    with no_grad():
        out = backend.to_host(layer(Tensor(x)).data).reshape(10, 8)
        w = backend.to_host(layer.router.weight.data)
        probs = backend.to_host(F.softmax(Tensor(x.reshape(10, 8) @ w), axis=-1).data)
        picked = np.argmax(probs + layer.bias, axis=1)
        assert (picked != np.argmax(probs, axis=1)).any()        # the bias changed a choice
        for n, e in enumerate(picked):
            expert = getattr(layer.experts, str(e))
            y = backend.to_host(expert(Tensor(x.reshape(10, 8)[n:n + 1])).data)[0]    # (C,)
            np.testing.assert_allclose(out[n], probs[n, e] * y, rtol=0, atol=1e-14)


def test_the_update_worked_by_hand():
    """Blocks 1 and 3 of 4 (--moe-every 2): loads [5, 1, 3, 3] (mean 3) move b by gamma x
    [-1, +1, 0, 0]; an even block does not move; a layer's row is a view (it sees the
    update); state_dict round-trips exactly; {} (a checkpoint from before) is all 0."""
    bias = RouterBias(config(n_layer=4, moe_every=2))
    assert bias.blocks == [1, 3] and bias.table.shape == (2, 4)
    row = bias.row(1)
    bias.update(np.array([[5.0, 1, 3, 3], [2, 2, 2, 2]]), 0.1)
    bias.update(np.array([[4.0, 0, 0, 0], [0, 0, 0, 8]]), 0.1)
    np.testing.assert_array_equal(bias.table, [[-0.2, 0.2, 0.1, 0.1], [0.1, 0.1, 0.1, -0.1]])
    assert row is not None and np.shares_memory(row, bias.table) and row[1] == 0.2
    again = RouterBias(config(n_layer=4, moe_every=2))
    again.load_state_dict(json.loads(json.dumps(bias.state_dict())))
    np.testing.assert_array_equal(again.table, bias.table)
    again.load_state_dict({})
    assert not again.table.any() and RouterBias(config(moe_experts=0)).state_dict() == {}
    assert imbalance(np.array([[2.0, 2, 2, 2], [8, 0, 0, 0]])) == [1.0, 4.0]


def test_each_micro_batch_counts_once():
    """A GPT's MoE layers count each training forward's choices once: with --ckpt-activations
    (whose recompute routes again inside backward) as without; an evaluation adds nothing;
    every block counts B T k assignments; global_loads takes the counts (zeroed after)."""
    x = np.random.default_rng(1).integers(0, 16, (3, 8))
    loads = []
    for ckpt in (False, True):
        model = GPT(config(), seed=2, dtype="float64").set_checkpointing(ckpt)
        model(x, x)[1].backward()
        model(x[:1], x[:1])[1].backward()                        # a second micro-batch
        model.eval()
        with no_grad():
            model(x, x)
        loads.append(global_loads(model))
        assert not global_loads(model).any()
    np.testing.assert_array_equal(loads[0], loads[1])
    assert loads[0].sum(axis=1).tolist() == [4 * 8 * 2] * 2


def _imbalance(tmp_path, corpus, rate):
    """The max / mean load of the last 30 of 60 steps of a tiny one-process run (gamma rate,
    no auxiliary loss), from its --log-json's evaluation row."""
    log = str(tmp_path / f"r{rate}.jsonl")
    run = train_tiny("--steps", "60", "--eval-every", "30", "--n-embd", "32", "--block-size",
                     "32", "--batch-size", "8", "--moe-experts", "4", "--moe-aux-loss-coef",
                     "0", "--moe-bias-rate", str(rate), "--data", corpus, "--cache-dir",
                     str(tmp_path / "c"), "--log-json", log, "--threads", "1")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in open(log)]
    last = [r for r in rows if "moe_imbalance" in r][-1]
    assert last["moe_steps"] == 30 and sum(last["moe_loads"][0]) == 30 * 8 * 32
    return last["moe_imbalance"][0], run.stdout


def test_the_biases_even_out_the_load(tmp_path, corpus):
    """    python examples/train_gpt.py --moe-experts 4 --moe-aux-loss-coef 0 --moe-bias-rate 0.01
    On a tiny model without the auxiliary loss the router piles tokens onto some experts
    (max / mean about 2.9 over steps 31-60); gamma 0.01 brings it well down (about 1.4). The
    eval line says so, with the biases' range."""
    off, _ = _imbalance(tmp_path, corpus, 0)
    on, out = _imbalance(tmp_path, corpus, 0.01)
    assert on < 0.8 * off, (on, off)
    assert "MoE load max/mean" in out and "router biases -" in out


LAYOUT = {"--moe-experts": 4, "--moe-bias-rate": 0.01, "--moe-aux-loss-coef": 0.0}


def _check(sweep, ranks, flags, resume=False):
    """A sweep layout against one process (losses, norms, val loss, parameters, biases), and
    the loads the final evaluation reports = one process's (3 steps of 8 x 16 tokens x k)."""
    ok, errs, run = sweep.check(ranks, {**LAYOUT, **flags}, resume)
    assert ok, (errs, run["stderr"][-2000:])
    ref, _ = sweep.reference({**LAYOUT, **flags})
    loads = [r["moe_loads"] for r in run["rows"] if "moe_loads" in r]
    assert loads == [r["moe_loads"] for r in ref["rows"] if "moe_loads" in r]
    k = flags.get("--moe-top-k", 1)
    assert all(sum(block) == 3 * 8 * 16 * k for block in loads[-1]), loads
    return errs, run


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, flags", [
    (2, {"--ep": 2}),
    (4, {"--ep": 2, "--dp": 2, "--zero": 1}),
    (4, {"--ep": 2, "--cp": 2, "--moe-top-k": 2}),
    (4, {"--ep": 2, "--tp": 2, "--sequence-parallel": True}),
    (2, {"--pp": 2, "--moe-every": 2, "--micro-batches": 4}),
    (2, {"--ep": 2, "--zero": 3, "--grad-accum": 2, "--ckpt-activations": True}),
], ids=["ep2", "ep2-dp2-zero1-resumed", "ep2-cp2-top2", "ep2-tp2-sp", "pp2", "ep2-zero3-accum2"])
def test_every_layout_trains_one_process_numbers(sweep, ranks, flags):
    """float64, gamma 0.01 (it moves the routing from step 2 on), no auxiliary loss: each
    step's loss and gradient norm, the val loss, every parameter within 1e-10 of one process,
    the biases and the loads counted equal; dp 2 x ep 2 also stopped after step 2 and resumed
    bit for bit (the biases too)."""
    errs, _ = _check(sweep, ranks, flags, resume=ranks == 4 and "--dp" in flags)
    assert errs.get("resumed", "same") == "same"
    ref, _ = sweep.reference({**LAYOUT, **flags})
    assert any(any(b) for b in ref["biases"].values())
    plain, _ = sweep.reference({**LAYOUT, **flags, "--moe-bias-rate": 0.0})
    assert plain["losses"][-1] != ref["losses"][-1]       # the biases did change the routing


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("ranks, flags", [
    (4, {"--ep": 2, "--pp": 2, "--ckpt-activations": True, "--zero": 2}),
    (4, {"--ep": 2, "--cp": 2, "--cp-split": "naive", "--dropout": 0.1, "--zero": 3}),
    (4, {"--tp": 2, "--dp": 2, "--moe-every": 2, "--grad-accum": 2}),
    (8, {"--ep": 2, "--pp": 2, "--tp": 2, "--sequence-parallel": True}),
    (8, {"--ep": 4, "--dp": 2, "--zero": 3, "--zero-shard": 2, "--moe-top-k": 2}),
], ids=["ep2-pp2-ckpt-zero2", "ep2-cp2-naive-dropout-zero3", "tp2-dp2-accum2",
        "ep2-pp2-tp2-sp", "ep4-dp2-hybrid-zero3"])
def test_more_layouts_train_one_process_numbers(sweep, ranks, flags):
    """The same on layouts that compose more (8 ranks on 2 cores: slow), resumed bit for
    bit."""
    errs, _ = _check(sweep, ranks, {"--moe-experts": 8, **flags} if ranks == 8 else flags,
                     resume=True)
    assert errs["resumed"] == "same"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, flags, into", [
    (4, {"--ep": 2, "--dp": 2, "--zero": 2}, (1, {})),
    (2, {"--pp": 2, "--moe-every": 2}, (2, {"--ep": 2, "--zero": 3, "--moe-every": 2})),
    (1, {"--moe-every": 2}, (4, {"--ep": 2, "--cp": 2, "--moe-every": 2})),
], ids=["ep2-dp2-zero2-to-one", "pp2-to-ep2-zero3", "one-to-ep2-cp2"])
def test_a_checkpoint_resumes_in_another_layout(sweep, ranks, flags, into):
    """Stopped after step 2, resumed in another layout: step 3 and the end (the biases too)
    = one process's; the biases of every block came through (a pipeline's rank 0 holds the
    other stage's)."""
    ok, errs = sweep.check_resharded(ranks, {**LAYOUT, **flags}, (into[0],
                                                                {**LAYOUT, **into[1]}))
    assert ok, errs
    saved = router_bias(os.path.join(sweep.workdir, f"stop{sweep.runs}"))
    assert len(saved) == (2 if "--moe-every" in flags else 4) and any(
        any(b) for b in saved.values())


def test_resume_takes_the_rate_and_notes_a_change(tmp_path, corpus):
    """A --resume without --moe-bias-rate takes the checkpoint's (the biases keep moving); a
    given one is the run's and the "resumed from" line notes it; 0 freezes the biases, which
    still route (DeepSeek-V3's last tokens), examples/sample.py's too. The flag is refused
    without --moe-experts, when negative, and under --eval-only."""
    ck = str(tmp_path / "ck")
    common = ("--moe-experts", "4", "--data", corpus, "--cache-dir", str(tmp_path / "c"))
    first = train_tiny(*common, "--moe-bias-rate", "0.01", "--save", ck)
    assert first.returncode == 0, first.stderr
    saved = router_bias(ck)
    again = train_tiny("--steps", "2", "--resume", ck, "--save", ck, "--data", corpus)
    assert again.returncode == 0 and "note:" not in again.stdout, again.stderr
    moved = router_bias(ck)
    assert moved != saved and all(abs(v) <= 0.02 + 1e-12 for b in moved.values() for v in b)
    frozen = train_tiny("--steps", "3", "--resume", ck, "--save", ck, "--data", corpus,
                        "--moe-bias-rate", "0")
    assert frozen.returncode == 0, frozen.stderr
    assert "(note: moe_bias_rate" in frozen.stdout and router_bias(ck) == moved
    sampled = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "sample.py"),
                              "--resume", ck, "--tokens", "4"], cwd=ROOT, env=mpi_env(),
                             capture_output=True, text=True, timeout=120)
    assert sampled.returncode == 0, sampled.stderr              # routes by the biases
    alone = train_tiny("--moe-bias-rate", "0.001")
    assert alone.returncode == 2 and alone.stderr == (
        "error: --moe-bias-rate 0.001: only used with --moe-experts (add --moe-experts E, 2 "
        "or more, or leave --moe-bias-rate out)\n")
    negative = train_tiny("--moe-experts", "2", "--moe-bias-rate", "-1")
    assert negative.returncode == 2 and negative.stderr.startswith(
        "error: --moe-bias-rate -1.0: must not be negative")
    evaluated = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"),
                                "--resume", ck, "--eval-only", "--moe-bias-rate", "0.01"],
                               cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                               timeout=120)
    assert evaluated.returncode == 2 and evaluated.stderr.startswith(
        "error: --moe-bias-rate 0.01: sets how fast the MoE routers' biases move, which this "
        "run does not use (drop --eval-only to train")


def test_a_checkpoint_from_before_the_biases_resumes_them_at_zero(tmp_path, corpus):
    """The same checkpoint written without "moe_bias" in its meta's "rng" (as before the
    flag): it resumes, the biases start at 0, so after one step at gamma 0.01 each is 0 or
    +-0.01."""
    ck, old = str(tmp_path / "ck"), str(tmp_path / "old")
    first = train_tiny("--moe-experts", "4", "--moe-bias-rate", "0.01", "--steps", "8",
                       "--save", ck, "--data", corpus, "--cache-dir", str(tmp_path / "c"))
    assert first.returncode == 0, first.stderr
    params, opt_state, meta = checkpoint.load(ck)
    assert any(any(abs(v) > 0.015 for v in b) for b in meta["rng"]["moe_bias"].values())
    del meta["rng"]["moe_bias"]
    checkpoint.save(old, params, opt_state, meta)
    assert router_bias(old) == {}
    again = train_tiny("--steps", "9", "--resume", old, "--save", old, "--data", corpus)
    assert again.returncode == 0, again.stderr
    assert all(abs(v) in (0.0, 0.01) for b in router_bias(old).values() for v in b)


def test_bench_step_moves_the_biases_as_training_does():
    """examples/bench_step.py times the step training takes: with --moe-bias-rate its step
    updates the router biases (one process's global loads), without it they stay 0."""
    def bench(*flags):
        return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "bench_step.py"),
                               "--device", "cpu", "--n-layer", "2", "--n-head", "2",
                               "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
                               "--steps", "1", "--warmup", "1", "--threads", "1",
                               "--moe-experts", "4", "--moe-top-k", "2", *flags], cwd=ROOT,
                              env=mpi_env(), capture_output=True, text=True, timeout=120)
    moved = bench("--moe-bias-rate", "0.01")
    assert moved.returncode == 0, moved.stderr
    lo, hi = json.loads(moved.stdout)["moe_bias"]
    assert lo <= -0.01 and hi >= 0.01 and max(-lo, hi) <= 0.02 + 1e-12   # two steps of 0.01
    still = bench()
    assert still.returncode == 0 and json.loads(still.stdout)["moe_bias"] == [0.0, 0.0]


def test_a_run_from_a_checkpoint_takes_its_biases(tmp_path, corpus):
    """--init-from an MoE checkpoint (minidist/train/init_from.py): its experts and its
    routers' biases, so it routes as the checkpoint does: --eval-only reports the val loss
    of `--resume ck --eval-only`, which zero biases would not."""
    ck = str(tmp_path / "ck")
    data = ("--data", corpus, "--cache-dir", str(tmp_path / "c"), "--dtype", "float64")
    first = train_tiny("--moe-experts", "4", "--moe-bias-rate", "0.05", "--steps", "6",
                       "--save", ck, *data)
    assert first.returncode == 0, first.stderr
    assert any(v for b in router_bias(ck).values() for v in b)
    evaluated = ("--eval-only", "--sample", "0", "--batch-size", "2", "--eval-iters", "1",
                 "--seed", "0", *data)
    said = [subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"),
                            how, ck, *evaluated], cwd=ROOT, env=mpi_env(), capture_output=True,
                           text=True, timeout=120) for how in ("--resume", "--init-from")]
    losses = [line for s in said for line in s.stdout.splitlines()
              if line.startswith("val loss")]
    assert len(losses) == 2 and losses[0] == losses[1], [s.stderr for s in said]
    # and its rate, so they keep moving (walk 36: frozen at 0 without a word)
    tuned = train_tiny("--init-from", ck, "--save", str(tmp_path / "ft"), *data)
    assert tuned.returncode == 0, tuned.stderr
    assert run_flags(str(tmp_path / "ft"))["moe_bias_rate"] == 0.05
