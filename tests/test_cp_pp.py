"""Context parallelism inside pipeline stages (--cp with --pp, minidist/pp/stage.py
sequence_part): the flags are accepted, every schedule trains one process's numbers
(tests/scripts/cp_pp_check.py), with dp, ZeRO and tp too, and train_gpt's checkpoints
resume.
"""
import subprocess
import sys

import numpy as np
import pytest

from minidist.cp.strategy import cp_problems
from minidist.strategy import checkpoint
from minidist.train.args import train_parser
from minidist.train.strategy import check_layout
from mpirun import ROOT, device_flags, logged_losses, mpi_env, tagged_json, within


def _flags(*extra):
    return train_parser().parse_args(["--block-size", "16", "--batch-size", "8", *extra])


def test_cp_with_pp_is_accepted_and_sized():
    """No refusal; 4 processes = cp 2 x pp 2 with dp 1 (every schedule, interleaving)."""
    for extra in ([], ["--schedule", "gpipe"], ["--schedule", "zb-h1"],
                  ["--pp-virtual", "2", "--micro-batches", "2"], ["--ckpt-activations"]):
        args = _flags("--cp", "2", "--pp", "2", *extra)
        assert cp_problems(args) == []
        assert check_layout(args, 4)[0] == 1
    assert check_layout(_flags("--cp", "2", "--pp", "2", "--tp", "2"), 8)[0] == 1


def _check(rows, runs):
    assert [r["run"] for r in rows] == runs
    for r in rows:
        assert within(r, 1e-10), r
        assert r["compared"] == r["ref_params"], r
        assert r["bytes_sent"] == r["theory_sent"] > 0, r


def test_cp2_x_pp2_every_schedule_equals_one_process(mpi):
    """cp 2 x pp 2, float64, 3 steps: 1F1B, GPipe, ZB-H1, interleaved 1F1B (2 chunks per
    rank), 1F1B and interleaved with --ckpt-activations, GPipe with the naive split, ZB-H1
    with --grad-accum 2: losses, norms and every
    parameter equal one process's to 1e-10; the bytes on each stage's cp group are the ring
    formula for its blocks; schedules and recompute bitwise equal; for the interleaved run,
    evaluation (on the ring) and sampling equal one process's, and its checkpoint is one
    process's model and resumes bitwise:

        mpiexec -n 4 python tests/scripts/cp_pp_check.py
    """
    out = mpi(4, "tests/scripts/cp_pp_check.py", timeout=180)
    runs = ["cp2xpp2-m2-1f1b", "cp2xpp2-m2-gpipe", "cp2xpp2-m2-zbh1", "cp2xpp2-m4-v2-1f1b",
            "cp2xpp2-m2-1f1b-ckpt", "cp2xpp2-m4-v2-1f1b-ckpt", "cp2xpp2-m4-gpipe-naive",
            "cp2xpp2-m2-ga2-zbh1"]
    rows = tagged_json(out)
    _check(rows, runs)
    files = rows[3]
    assert files["ckpt_diff"] < 1e-10 and files["eval_diff"] < 1e-10, files


@pytest.mark.slow
def test_cp2_x_pp2_with_dp2_zero_and_tp2(mpi):
    """8 ranks: cp 2 x pp 2 x dp 2 (ZeRO-1 1F1B, with the checkpoint, evaluation and
    sampling; ZeRO-3 GPipe with recompute) and cp 2 x pp 2 x tp 2 (ZB-H1, interleaved):

        mpiexec -n 8 python tests/scripts/cp_pp_check.py
    """
    out = mpi(8, "tests/scripts/cp_pp_check.py", timeout=400)
    runs = ["cp2xpp2xdp2-m2-1f1b-z1", "cp2xpp2xdp2-m2-gpipe-z3-ckpt", "cp2xpp2xtp2-m2-zbh1",
            "cp2xpp2xtp2-m4-v2-1f1b"]
    rows = tagged_json(out)
    _check(rows, runs)
    assert rows[0]["ckpt_diff"] < 1e-10 and rows[0]["eval_diff"] < 1e-10, rows[0]


@pytest.mark.slow
def test_cp2_x_pp2_x_tp2_with_zero(mpi):
    """8 ranks: cp 2 x pp 2 x tp 2 with ZeRO-1 (1F1B) and ZeRO-3 (GPipe) over each stage's
    dp x cp ranks (--zero with --cp and --tp, once refused), each with the checkpoint,
    evaluation and sampling:

        mpiexec -n 8 python tests/scripts/cp_pp_check.py --runs cp2xpp2xtp2-m2-1f1b-z1,\
cp2xpp2xtp2-m2-gpipe-z3 --files cp2xpp2xtp2-m2-1f1b-z1,cp2xpp2xtp2-m2-gpipe-z3
    """
    runs = ["cp2xpp2xtp2-m2-1f1b-z1", "cp2xpp2xtp2-m2-gpipe-z3"]
    out = mpi(8, "tests/scripts/cp_pp_check.py", "--runs", ",".join(runs), "--files",
              ",".join(runs), timeout=300)
    rows = tagged_json(out)
    _check(rows, runs)
    for r in rows:
        assert r["ckpt_diff"] < 1e-10 and r["eval_diff"] < 1e-10, r


@pytest.mark.slow
def test_cp2_x_pp2_x_tp2_with_sequence_parallelism(mpi):
    """8 ranks: cp 2 x pp 2 x tp 2 with --sequence-parallel (each stage's residual stream
    (B, T/cp/tp, C), the boundary sends too): 1F1B with the checkpoint, evaluation and
    sampling; ZB-H1; GPipe with the naive split and ZeRO-1; interleaved 1F1B with ZeRO-3
    and recompute:

        mpiexec -n 8 python tests/scripts/cp_pp_check.py --runs cp2xpp2xtp2-m2-1f1b-sp,\
cp2xpp2xtp2-m2-zbh1-sp,cp2xpp2xtp2-m2-gpipe-sp-naive-z1,cp2xpp2xtp2-m4-v2-1f1b-sp-z3-ckpt \
            --files cp2xpp2xtp2-m2-1f1b-sp
    """
    runs = ["cp2xpp2xtp2-m2-1f1b-sp", "cp2xpp2xtp2-m2-zbh1-sp",
            "cp2xpp2xtp2-m2-gpipe-sp-naive-z1", "cp2xpp2xtp2-m4-v2-1f1b-sp-z3-ckpt"]
    out = mpi(8, "tests/scripts/cp_pp_check.py", "--runs", ",".join(runs), "--files",
              runs[0], timeout=300)
    rows = tagged_json(out)
    _check(rows, runs)
    assert rows[0]["ckpt_diff"] < 1e-10 and rows[0]["eval_diff"] < 1e-10, rows[0]


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--lr", "1e-2", "--eval-iters", "2", "--log-every", "1",
        "--steps", "6", "--eval-every", "3", "--dtype", "float64", "--dropout", "0.1"]
CP_PP = ["--cp", "2", "--pp", "2", "--micro-batches", "2"]


def _sample(stdout):
    assert stdout.count("---- sample ----") == 1, stdout            # printed by rank 0 alone
    return stdout.split("---- sample ----\n")[1].split("\n----------------")[0]


def _vals(path):
    import json
    return [r["val_loss"] for r in map(json.loads, open(path)) if "val_loss" in r]


@pytest.mark.slow
@pytest.mark.mpi
def test_train_gpt_cp2_pp2_matches_one_process_and_resumes(corpus, tmp_path, mpi):
    """train_gpt.py --cp 2 --pp 2 --dropout 0.1 (float64) logs one process's losses, val
    losses and sample; a checkpoint saved at step 3 is one process's model, and a resume from
    it repeats the straight run's steps 4-6:

        python examples/train_gpt.py --data CORPUS --dtype float64 --dropout 0.1 ...
        mpiexec -n 4 python examples/train_gpt.py --cp 2 --pp 2 --micro-batches 2 ...
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache"]
    one, both = tmp_path / "one.jsonl", tmp_path / "both.jsonl"
    ref = subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common),
                          "--log-json", str(one), "--sample", "20",
                          *device_flags(mpi.device)], cwd=ROOT, env=mpi_env(), text=True,
                         capture_output=True, check=True, timeout=600).stdout
    out = mpi(4, "examples/train_gpt.py", *common, *CP_PP, "--log-json", both, "--sample",
              "20", timeout=180).stdout
    assert "x cp 2 (a ring over cp inside each stage)" in out, out
    assert np.allclose(logged_losses(both), logged_losses(one), rtol=0, atol=1e-10)
    assert np.allclose(_vals(both), _vals(one), rtol=0, atol=1e-10)
    assert _sample(out) == _sample(ref)
    resumed = tmp_path / "resumed.jsonl"
    mpi(4, "examples/train_gpt.py", *common, *CP_PP, "--save", tmp_path / "ck", "--stop-at",
        "3", "--sample", "0", timeout=180)
    mpi(4, "examples/train_gpt.py", *common, *CP_PP, "--resume", tmp_path / "ck",
        "--log-json", resumed, "--sample", "0", timeout=180)
    assert logged_losses(resumed)[:3] == logged_losses(both)[3:6]
    assert checkpoint.load(tmp_path / "ck")[2]["step"] == 3
