"""--amp --grad-dtype float32: what the 4-byte gradients cost and how a run with them resumes.

    memory       the ledger's 4 bytes of gradient per parameter equal the planner's, one
                 process and ZeRO-2 x 2; plan.py and plan_memory.py price them
    resume       bit for bit with the flag, one process and ZeRO-2 x 2
    refusals     --grad-dtype without --amp (train_gpt.py, bench_step.py, plan.py --fp32)

    python -m pytest -q tests/test_fp32_grads_memory.py
"""
import json
import subprocess
import sys

import pytest

from minidist.nn import GPTConfig
from minidist.train.amp import MixedPrecision
from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags
from minidist.train.loop import train
from minidist.train.planner import Layout, bill, layout_from_name, state_bytes
from minidist.train.run_bill import plan
from minidist.train.search import train_flags
from mpirun import ROOT


# ---- memory: the ledger and the planners -----------------------------------------------------

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
        "--batch-size", "8", "--eval-every", "0", "--eval-iters", "1", "--sample", "0",
        "--amp", "--grad-dtype", "float32", "--grad-accum", "2"]


def run_log(corpus, tmp, ranks, mpi, *flags):
    """The training rows of train_gpt.py with TINY + flags (--log-json), on `ranks`."""
    log = tmp / f"log{len(list(tmp.glob('log*')))}.jsonl"
    argv = TINY + ["--data", corpus, "--cache-dir", str(tmp / "cache"), "--log-json",
                   str(log), *flags]
    if ranks == 1:
        train(train_parser().parse_args(argv + ["--device", mpi.device]))
    else:
        mpi(ranks, "examples/train_gpt.py", *argv, timeout=180)
    return [json.loads(line) for line in open(log)][:-1]


def test_state_bytes_and_layout_names_price_4_byte_gradients():
    """2 + 4 + 12 bytes a parameter; ZeRO-2 shards the 4; the name says "fp32 grads" and
    reads back; a search row runs train_gpt.py with --grad-dtype float32."""
    assert state_bytes(True, True) == (2, 4, 12) and state_bytes(True) == (2, 2, 12)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    flat = bill(cfg, Layout(grad32=True), 16)["grads"]
    assert flat == 2 * bill(cfg, Layout(), 16)["grads"]
    assert bill(cfg, Layout(dp=4, zero=2, grad32=True), 16)["grads"] == 4 * -(-flat // 16)
    name = Layout(dp=8, zero=1, grad32=True).name()
    assert name == "ZeRO-1 (amp, fp32 grads)"
    assert layout_from_name(name, 8)["grad32"] is True
    rows = plan(cfg, 8, grad32=True)["rows"]
    assert [r["grad32"] for r in rows] == [r["amp"] for r in rows]     # fp32 rows: as is
    row = {**rows[1], "micro_batch": 1, "micro_batches": 1, "schedule": "1f1b"}
    assert train_flags(cfg, row)[-2:] == ["--grad-dtype", "float32"]


@pytest.mark.parametrize("ranks, flags, layout", [
    (1, [], Layout(grad32=True)),
    pytest.param(2, ["--zero", "2"], Layout(dp=2, zero=2, grad32=True),
                 marks=pytest.mark.mpi)])
def test_the_ledger_holds_4_bytes_of_gradient_as_the_planner_says(ranks, flags, layout,
                                                                  corpus, tmp_path, mpi):
    """e.g. mpiexec -n 2 python examples/train_gpt.py --zero 2 --amp --grad-dtype float32
    --grad-accum 2 --log-json L (TINY): L's "mem" params, grads, optimizer = planner.bill."""
    mem = run_log(corpus, tmp_path, ranks, mpi, "--steps", "2", *flags)[-1]["mem"]
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256)
    want = bill(cfg, layout, 16, 8 // (2 * layout.dp), formula="minidist")
    assert {k: mem[k] for k in ("params", "grads", "optimizer")} == \
        {k: want[k] for k in ("params", "grads", "optimizer")}


def example(script, *flags, check=True):
    """examples/<script> in a subprocess: the CompletedProcess."""
    return subprocess.run([sys.executable, f"examples/{script}", *flags], cwd=ROOT,
                          capture_output=True, text=True, check=check, timeout=600)


def test_plan_prices_and_runs_float32_gradients():
    """python examples/plan.py --params 1e9 --gpus 8 --seq 1024 --global-batch 64 --layout
    dp=8,zero=1,micro=1 --grad-dtype float32 --json: 4 bytes of gradient a parameter, and
    the command runs it;
    plan_memory.py's mixed-precision rows too."""
    def one(*flags):
        return json.loads(example("plan.py", "--params", "1e9", "--gpus", "8", "--seq", "1024",
                                  "--global-batch", "64", "--layout", "dp=8,zero=1,micro=1",
                                  "--json", *flags).stdout)
    plain, fp32 = one(), one("--grad-dtype", "float32")
    assert fp32["rows"][0]["mem"]["grads"] == 2 * plain["rows"][0]["mem"]["grads"]
    assert fp32["command"].endswith("--grad-dtype float32") and fp32["rows"][0]["grad32"]
    assert fp32["rows"][0]["layout"] == "ZeRO-1 (amp, fp32 grads, tiled)"
    rows = json.loads(example("plan_memory.py", "--params", "1e9", "--grad-dtype", "float32",
                              "--json").stdout)["rows"]
    assert all(r["grad32"] == r["amp"] and ("fp32 grads" in r["layout"]) == r["amp"]
               for r in rows)


# ---- resume, refusals --------------------------------------------------------------------------

@pytest.mark.parametrize("ranks, flags", [
    (1, []), pytest.param(2, ["--zero", "2"], marks=pytest.mark.mpi)])
def test_a_resume_with_float32_gradients_is_bit_identical(ranks, flags, corpus, tmp_path,
                                                          mpi):
    """mpiexec -n 2 python examples/train_gpt.py --zero 2 --amp --grad-dtype float32 ...
    --steps 4 (straight), --stop-at 2 --save DIR, then --resume DIR: the same losses.
    Checkpoints hold no gradient; the flag is the run's, taken from the checkpoint unless
    given (resume.py notes a change)."""
    common = ["--steps", "4", *flags]
    straight = run_log(corpus, tmp_path, ranks, mpi, *common)
    run_log(corpus, tmp_path, ranks, mpi, *common, "--stop-at", "2", "--save",
            str(tmp_path / "ck"))
    resumed = run_log(corpus, tmp_path, ranks, mpi, *common, "--resume", str(tmp_path / "ck"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight[2:]]
    if ranks == 1:       # the flag is the run's: a resume without it takes the checkpoint's
        bare = [f for f in TINY if f not in ("--amp", "--grad-dtype", "float32")]
        log = tmp_path / "bare.jsonl"
        subprocess.run([sys.executable, "examples/train_gpt.py", *bare, "--data", corpus,
                        "--cache-dir", str(tmp_path / "cache"), "--log-json", str(log),
                        *common, "--resume", str(tmp_path / "ck"), "--device", mpi.device],
                       cwd=ROOT, check=True, capture_output=True, timeout=120)
        rows = [json.loads(line) for line in open(log)]
        assert [r["loss"] for r in rows if "loss" in r] == [r["loss"] for r in straight[2:]]


def test_grad_dtype_is_refused_without_amp_in_one_line(tmp_path):
    """train_gpt.py (check_flags: before MPI), bench_step.py, plan.py with --fp32, and
    MixedPrecision itself."""
    args = train_parser().parse_args(["--grad-dtype", "float32", "--save", str(tmp_path)])
    with pytest.raises(UsageError) as e:
        check_flags(args)
    assert str(e.value) == ("--grad-dtype float32: only used with --amp (without it the "
                            "gradients are --dtype float32's; add --amp, or leave "
                            "--grad-dtype out)")
    out = example("bench_step.py", "--grad-dtype", "float32", "--steps", "1", "--device",
                  "cpu", check=False)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --grad-dtype float32: only used with --amp (add --amp, or leave --grad-dtype "
        "out)"), out.stderr
    out = example("plan.py", "--params", "1e9", "--fp32", "--grad-dtype", "float32",
                  check=False)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --grad-dtype float32: only with mixed precision, and --fp32 is given (its "
        "gradients are float32 already); leave --grad-dtype out"), out.stderr
    with pytest.raises(ValueError, match="--grad-dtype float16: give float32"):
        MixedPrecision(grad_dtype="float16")
