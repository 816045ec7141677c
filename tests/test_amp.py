"""Mixed precision (minidist/train/amp.py): the loss scaler's skip/grow logic under injected
overflows, the master-weight optimizer (skips leave everything untouched, an overflow on
another rank skips here too, the 2+2+12 bytes per parameter the ledger sees), the CPU float16
matmul, and --amp training: within 2% of float32 after 30 steps, checkpointing changing no
number under amp with gradient accumulation, and a bit-identical resume."""
import json
import re

import numpy as np
import pytest

from minidist.backend import matmul
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.train.amp import MixedPrecision, half_dtype
from minidist.train.loss_scale import LossScaler
from minidist.train.args import train_parser
from minidist.train.loop import train
from minidist.strategy.memory import ledger

# A config that learns well below the unigram entropy within 30 steps.
SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
         "--batch-size", "8", "--lr", "1e-2", "--eval-iters", "4", "--sample", "0",
         "--log-every", "10", "--device", "cpu", "--eval-every", "0"]


# ---- the loss scaler -------------------------------------------------------------------------

def test_overflow_skips_and_halves_the_scale():
    s = LossScaler(init_scale=1024, growth_interval=3)
    assert s.update(False) and s.good_steps == 1
    assert not s.update(True)
    assert s.scale == 512 and s.good_steps == 0 and s.skipped == 1


def test_scale_grows_after_a_streak_and_an_overflow_restarts_it():
    s = LossScaler(init_scale=8, growth_interval=3)
    verdicts = [s.update(f) for f in (False, False, True, False, False, False, False)]
    assert verdicts == [True, True, False, True, True, True, True]
    assert s.scale == 8                  # 8 -> 4 at the overflow -> 8 after 3 clean steps
    assert s.good_steps == 1 and s.skipped == 1


def test_fixed_scale_still_skips():
    s = LossScaler(init_scale=1.0, growth_interval=None)
    assert not s.update(True) and s.scale == 1.0
    assert all(s.update(False) for _ in range(5)) and s.scale == 1.0


def test_endless_overflows_are_an_error_not_a_silent_stall():
    s = LossScaler(max_skips_in_a_row=4)
    for _ in range(3):
        s.update(True)
    with pytest.raises(FloatingPointError, match="4 steps in a row"):
        s.update(True)


def test_scaler_state_round_trips():
    s = LossScaler(init_scale=64, growth_interval=2)
    for f in (False, True, False):
        s.update(f)
    t = LossScaler()
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert (t.scale, t.good_steps, t.skipped) == (32, 1, 1)


# ---- the master-weight optimizer -------------------------------------------------------------

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)


def _amp_model(scale=1024.0):
    amp = MixedPrecision(LossScaler(init_scale=scale, growth_interval=2))
    model = amp.cast_model(GPT(CFG, seed=0))
    opt = amp.optimizer(model.named_parameters(), lambda named: AdamW(named, lr=1e-2))
    return amp, model, opt


def _backward(amp, model, seed=0):
    x = np.random.default_rng(seed).integers(0, CFG.vocab_size, (4, CFG.block_size))
    _, loss = model(x, x)
    amp.backward(loss)
    return loss


def _snapshot(model, opt):
    return ([p.data.copy() for p in model.parameters()], [m.data.copy() for m in opt.master],
            {k: dict(v) for k, v in opt.inner.state.items()})


@pytest.mark.cpu_only("float16 loss scaling: on CuPy --amp picks bfloat16, scale fixed at 1")
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_injected_overflow_skips_the_step_and_leaves_everything_untouched(bad):
    amp, model, opt = _amp_model()
    _backward(amp, model)
    model.transformer.h[1].mlp.c_fc.weight.grad[3, 5] = bad          # one poisoned element
    before = _snapshot(model, opt)
    norm = opt.clip_grad_norm(1.0)
    assert not np.isfinite(norm)
    assert opt.step() is False
    after = _snapshot(model, opt)
    assert all(np.array_equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(np.array_equal(a, b) for a, b in zip(before[1], after[1]))
    assert after[2] == {} and amp.scaler.scale == 512.0
    opt.zero_grad()
    _backward(amp, model, seed=1)                                     # a clean step updates
    assert np.isfinite(opt.clip_grad_norm(1.0)) and opt.step() is True
    assert not np.array_equal(before[1][0], opt.master[0].data)
    assert all(s["step"] == 1 for s in opt.inner.state.values())


@pytest.mark.cpu_only("float16 loss scaling: on CuPy --amp picks bfloat16, scale fixed at 1")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_injected_overflow_skips_zeros_step_and_leaves_its_shards_untouched(stage):
    """The same under ZeRO (ShardedAdamW over a one-rank engine): an inf in one gradient
    shard skips the step, every shard, m, v and master unchanged, the scale halved; the next
    clean step updates. Mutation testing (2026-11-29) found a ZeRO that never skipped caught
    only through EP's runs (tests/test_ep_exact.py)."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.zero.engine import zero_engine
    from minidist.zero.optim import ShardedAdamW
    amp = MixedPrecision(LossScaler(init_scale=1024.0, growth_interval=2))
    model = amp.cast_model(GPT(CFG, seed=0))
    engine = zero_engine(model, ProcessGroup(MPI.COMM_SELF, name="dp"), stage)
    opt = ShardedAdamW(engine, lr=1e-2, amp=amp)
    _backward(amp, model)
    engine.sync_grads()
    engine.units[1].grad_shard[5] = np.inf                            # one poisoned element
    before = {k: v.copy() for k, v in opt.shard_arrays().items()}
    assert not np.isfinite(opt.clip_grad_norm(1.0))
    assert opt.step() is False and amp.scaler.scale == 512.0
    after = opt.shard_arrays()
    assert after.keys() == before.keys()
    assert all(np.array_equal(after[k], before[k]) for k in before)
    engine.after_step()
    opt.zero_grad()
    _backward(amp, model, seed=1)                                     # a clean step updates
    engine.sync_grads()
    assert np.isfinite(opt.clip_grad_norm(1.0)) and opt.step() is True
    assert not np.array_equal(opt.shard_arrays()["h.1/param"], before["h.1/param"])


def test_an_overflow_on_another_rank_skips_here_too():
    """Another rank's inf arrives through the norm's sum over ranks (the strategy's
    reduce_sum_sq, stood for here by the function clip_grad_norm takes): this rank, whose
    gradients are finite, skips. On real ranks: tests/scripts/ep_check.py's --amp runs put
    an inf in one expert's gradient on one rank, and every rank skips that step
    (tests/test_ep_exact.py::check_amp_row)."""
    amp, model, opt = _amp_model()
    _backward(amp, model)
    assert np.isinf(opt.clip_grad_norm(1.0, lambda local: local + np.inf))
    assert opt.step() is False


@pytest.mark.cpu_only("float16 policy: on CuPy --amp picks bfloat16 (tests/test_bfloat16.py)")
def test_unscaled_norm_matches_float32_and_the_step_lands_in_float16():
    amp, model, opt = _amp_model()
    _backward(amp, model)
    ref = GPT(CFG, seed=0)
    x = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, CFG.block_size))
    ref(x, x)[1].backward()
    ref_norm = AdamW(ref.named_parameters()).clip_grad_norm(None)
    assert abs(opt.clip_grad_norm(None) / ref_norm - 1) < 1e-2
    assert opt.step()
    for p, m in zip(model.parameters(), opt.master):
        assert p.dtype == np.float16 and m.dtype == np.float32
        np.testing.assert_array_equal(p.data, m.data.astype(np.float16))


def test_the_masters_decay_what_the_float32_model_decays():
    """AdamW over the float32 masters splits its groups as over the float32 model: biases,
    layer norms and the embeddings (decay=False on their Parameters) get weight decay 0."""
    amp, model, opt = _amp_model()
    ref = AdamW(GPT(CFG, seed=0).named_parameters(), lr=1e-2)
    decayed = [(g["weight_decay"], sorted(g["names"])) for g in opt.param_groups]
    assert decayed == [(g["weight_decay"], sorted(g["names"])) for g in ref.param_groups]
    assert len(decayed) == 2 and decayed[1][0] == 0.0 and "transformer.h.0.ln_1.bias" in \
        decayed[1][1] and "transformer.wte.weight" in decayed[1][1]


def test_backward_must_start_from_the_scaled_loss():
    amp, model, opt = _amp_model()
    x = np.zeros((2, CFG.block_size), np.int64)
    model(x, x)[1].backward()                                          # forgot the scale
    with pytest.raises(RuntimeError, match="scaled loss"):
        opt.clip_grad_norm(1.0)


def test_ledger_counts_2_2_12_bytes_per_parameter():
    amp, model, opt = _amp_model()
    _backward(amp, model)
    opt.clip_grad_norm(1.0)
    assert opt.step()
    n = model.num_parameters()
    row = ledger(model.parameters(), opt)
    assert (row["params"], row["grads"], row["optimizer"]) == (2 * n, 2 * n, 12 * n)


@pytest.mark.cpu_only("numpy's emulated float16 matmul; CuPy runs a real 16-bit GEMM")
def test_cpu_float16_matmul_is_the_float32_product_rounded():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 7)).astype(np.float16)
    b = rng.standard_normal((3, 7, 4)).astype(np.float16)
    out = matmul(a, b)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, (a.astype(np.float32) @ b.astype(np.float32))
                                  .astype(np.float16))


def test_amp_refuses_a_float64_model():
    with pytest.raises(ValueError, match="float32 model"):
        MixedPrecision().cast_model(GPT(CFG, dtype="float64"))


def test_bfloat16_where_the_array_module_cannot_is_float16_or_a_clear_error():
    """CuPy 13 has no bfloat16 arrays (CuPy 14 has, given ml_dtypes and NumPy >= 2.1.2): the
    default policy falls back to float16 there; bfloat16 asked for by name says why at once.
    pick_half_dtype takes what half_dtype learns from the array library as plain values (on
    numpy or not; the probe's phrase for CuPy 13's TypeError, or None)."""
    from minidist.train.amp import bfloat16, bfloat16_problem, bfloat16_reason, pick_half_dtype
    cupy13 = bfloat16_reason(TypeError("Unsupported dtype bfloat16"))
    assert pick_half_dtype(None, False, cupy13) == np.float16
    assert pick_half_dtype("float16", False, cupy13) == np.float16
    with pytest.raises(RuntimeError, match=r"bfloat16 asked for, but this CuPy cannot compute "
                                           r"with it \(TypeError: .*CuPy >= 14"):
        pick_half_dtype("bfloat16", False, cupy13)
    assert pick_half_dtype(None, False, None) == pick_half_dtype("bfloat16", False, None) == \
        bfloat16()                                          # a CuPy that computes with it
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        pick_half_dtype("float32", False, None)
    assert half_dtype(np) == np.float16 and half_dtype(np, "bfloat16") == bfloat16()
    assert bfloat16_problem(np) is None                     # the real probe, on numpy


def test_the_log_says_why_a_gpu_run_computes_in_float16():
    """--amp on a CuPy without bfloat16 (CuPy 13) falls back to float16, and the log said
    only "float16 compute": the --amp line now ends saying why not bfloat16 (the probe's
    error and what bfloat16 needs), and says nothing where the device could have (no
    problem) or float16 was asked for on a GPU that has bfloat16."""
    from minidist.train.amp import bfloat16_reason, device_note
    cupy13 = bfloat16_reason(TypeError("Unsupported dtype bfloat16"))
    assert device_note("cuda", "float16", cupy13) == (
        "; not bfloat16: this CuPy cannot compute with it (TypeError: Unsupported dtype "
        "bfloat16); it needs CuPy >= 14, ml_dtypes and NumPy >= 2.1.2")
    assert device_note("cuda", "float16", None) == device_note("cuda", "bfloat16", None) == ""
    assert "numpy has no 16-bit BLAS" in device_note("cpu", "float16", None)
    mp = MixedPrecision(dtype="float16")                    # the real line, here on the CPU
    mp.cast_model(GPT(CFG, dtype="float32"))
    line = mp.describe()
    assert "float16 compute" in line, line
    assert line.endswith("gradients are skipped" + device_note("cpu", "float16", None)), line


# ---- training ----------------------------------------------------------------------------

def _train(corpus, tmp, *flags):
    log = tmp / f"log{len(list(tmp.glob('log*')))}.jsonl"
    args = train_parser().parse_args(SMALL + ["--data", corpus, "--cache-dir",
                                              str(tmp / "cache"), "--log-json", str(log),
                                              *flags])
    train(args)
    rows = [json.loads(line) for line in open(log)]
    return rows[:-1], rows[-1]


@pytest.mark.cpu_only("trains with --device cpu (float16 on numpy); on a GPU: "
                     "test_amp_trains_on_cuda and tests/gpu_acceptance.sh")
def test_amp_within_2_percent_of_float32_after_30_steps(corpus, tmp_path, capsys):
    rows32, final32 = _train(corpus, tmp_path, "--steps", "30")
    rows16, final16 = _train(corpus, tmp_path, "--steps", "30", "--amp")
    assert "mixed precision: float16 compute" in capsys.readouterr().out
    assert final32["val_loss"] < 0.85 * final32["unigram_entropy"]         # it learned
    assert abs(final16["val_loss"] / final32["val_loss"] - 1) < 0.02
    late32 = np.mean([r["loss"] for r in rows32[-5:]])
    late16 = np.mean([r["loss"] for r in rows16[-5:]])
    assert abs(late16 / late32 - 1) < 0.02
    m32, m16 = rows32[-1]["mem"], rows16[-1]["mem"]
    assert m16["params"] * 2 == m32["params"] and m16["optimizer"] == 3 * m32["optimizer"] / 2


@pytest.mark.cpu_only("trains with --device cpu (SMALL)")
def test_amp_with_checkpointing_and_grad_accum_changes_no_number(corpus, tmp_path):
    rows, _ = _train(corpus, tmp_path, "--steps", "4", "--amp", "--grad-accum", "2",
                     "--dropout", "0.1")
    rows_c, _ = _train(corpus, tmp_path, "--steps", "4", "--amp", "--grad-accum", "2",
                       "--dropout", "0.1", "--ckpt-activations")
    assert [r["loss"] for r in rows] == [r["loss"] for r in rows_c]
    assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in rows_c]
    assert rows_c[-1]["mem"]["activations"] < 0.6 * rows[-1]["mem"]["activations"]


@pytest.mark.cpu_only("trains with --device cpu (SMALL)")
def test_amp_resume_is_bit_identical(corpus, tmp_path):
    common = ["--steps", "6", "--amp"]
    straight, _ = _train(corpus, tmp_path, *common)
    _train(corpus, tmp_path, *common, "--save", str(tmp_path / "ck"), "--stop-at", "3")
    resumed, _ = _train(corpus, tmp_path, *common, "--resume", str(tmp_path / "ck"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]


@pytest.mark.cpu_only("trains with --device cpu (SMALL)")
def test_a_resume_takes_the_16_bit_type_and_names_another_amp_dtype(corpus, tmp_path, capsys):
    """A bfloat16 --amp checkpoint resumed with --amp alone computes in bfloat16 (not this
    device's default, float16 on numpy, which the checkpoint's dtype refused); resumed with
    --amp-dtype float16 it is refused naming that flag, and a float32 one with --amp naming
    --amp (it was "checkpoint config mismatch ... MasterWeightOptimizer here")."""
    from minidist.train.cli import UsageError, check_flags
    ck = str(tmp_path / "ck")
    _train(corpus, tmp_path, "--steps", "4", "--amp", "--amp-dtype", "bfloat16", "--save", ck,
           "--stop-at", "2")
    refused = train_parser().parse_args(["--amp", "--amp-dtype", "float16", "--resume", ck])
    with pytest.raises(UsageError, match=r"^--amp-dtype float16: --resume .* was trained "
                                         r"with --amp in bfloat16; leave --amp-dtype out$"):
        check_flags(refused)
    taken = train_parser().parse_args(["--amp", "--resume", ck])
    check_flags(taken)
    assert taken.amp_dtype == "bfloat16"
    capsys.readouterr()
    rows, _ = _train(corpus, tmp_path, "--steps", "4", "--amp", "--amp-dtype", "bfloat16",
                     "--resume", ck)
    full = str(tmp_path / "full")                      # and a float32 one: --amp by name
    _train(corpus, tmp_path, "--steps", "4", "--save", full, "--stop-at", "2")
    with pytest.raises(UsageError, match=r"^--amp: --resume .* was trained in float32, "
                                         r"without --amp; leave --amp out"):
        check_flags(train_parser().parse_args(["--amp", "--resume", full]))
    assert "mixed precision: bfloat16 compute" in capsys.readouterr().out
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)


@pytest.mark.gpu
def test_amp_trains_on_cuda(corpus, tmp_path, capsys):
    """python -m pytest -m gpu --device cuda tests/test_amp.py: bfloat16 if CuPy takes
    ml_dtypes' bfloat16, float16 otherwise; real 16-bit GEMMs."""
    rows, final = _train(corpus, tmp_path, "--steps", "10", "--amp", "--device", "cuda")
    assert "float32 master weights" in capsys.readouterr().out
    assert np.isfinite(final["val_loss"]) and rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.cpu_only("float16 loss scaling: on CuPy --amp picks bfloat16, scale fixed at 1")
def test_fifty_overflowing_steps_in_a_row_stop_the_run(corpus, tmp_path):
    """End to end: a run resumed with a loss scale of 2^1000 (written through the checkpoint
    API, so it verifies) overflows every backward while its loss stays finite; the scaler
    halves the scale 50 times (still 2^950, still inf in float32) and the run stops with
    Diverged at step 51 (the 50th step of the resumed run)."""
    from minidist.strategy import checkpoint
    from minidist.train.loss_scale import SCALER_KEY
    from minidist.train.loop import Diverged
    _train(corpus, tmp_path, "--steps", "60", "--amp", "--save", str(tmp_path / "ck"),
           "--stop-at", "1")
    params, state, meta = checkpoint.load(str(tmp_path / "ck"))
    assert state["state"][SCALER_KEY]["scale"] == 2.0 ** 12
    state["state"][SCALER_KEY]["scale"] = 2.0 ** 1000
    checkpoint.save(str(tmp_path / "huge"), params, state, meta)
    scale = re.escape(f"(loss scale now {2.0 ** 950:g})")           # 9.51691e+285
    with pytest.raises(Diverged, match=r"step 51: 50 steps in a row had inf/nan gradients "
                                       + scale + r".*nothing saved"):
        _train(corpus, tmp_path, "--steps", "60", "--amp", "--resume", str(tmp_path / "huge"))


def test_the_ranks_agree_on_the_16_bit_type_or_are_refused():
    """Without --amp-dtype each rank's device picks its 16-bit type (half_dtype: bfloat16 on
    a GPU whose CuPy computes with it, float16 elsewhere); make_strategy agrees on it over
    the world, and a job whose devices differ (CPU and GPU ranks under --device auto) is one
    error naming the ranks: their 16-bit gradients would have been summed bit pattern
    against bit pattern, silently. (The collective itself runs in every multi-rank --amp
    test: tests/test_ep_exact.py, tests/test_pp_zero.py, ...)"""
    from minidist.train.cli import UsageError
    from minidist.train.strategy import agreed_half_dtype, amp_dtype
    assert agreed_half_dtype(["float16"] * 4) == "float16"
    with pytest.raises(UsageError, match=r"--amp: the ranks chose different 16-bit types "
                       r"\(bfloat16 on ranks 0, 2; float16 on rank 1: their devices differ, "
                       r"or MINIDIST_AMP_DTYPE is set on some\): give --amp-dtype float16"):
        agreed_half_dtype(["bfloat16", "float16", "bfloat16"])
    given = train_parser().parse_args(["--amp", "--amp-dtype", "bfloat16"])
    assert amp_dtype(given, None) == "bfloat16"           # as given: nothing to agree on
