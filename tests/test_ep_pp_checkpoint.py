"""Checkpoints of expert parallelism inside pipelines (--ep with --pp) through
examples/train_gpt.py: one process's format (every stage's experts, from every ep rank,
gathered: minidist/ep/checkpoint.py inside minidist/pp/checkpoint.py), loaded on other
layouts, and a resume that repeats the straight run. The exactness of ep x pp checkpoints
against one process, step by step: the ep2xpp2...+ckpt runs of tests/scripts/ep_check.py in
tests/test_ep_exact.py."""
import subprocess
import sys

import pytest

from minidist.nn import GPTConfig
from minidist.nn.config import gpt_param_specs
from minidist.strategy import checkpoint
from mpirun import ROOT, device_flags, mpi_env
from tests.ep_cases import TINY, _rows


def _one_process(common, log, mpi, *flags):
    """examples/train_gpt.py on one process, logging to `log`."""
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), *flags,
                    "--log-json", str(log), *device_flags(mpi.device)], cwd=ROOT,
                   env=mpi_env(), text=True, capture_output=True, check=True, timeout=600)


EP_PP = ["--ep", "2", "--pp", "2", "--micro-batches", "2"]


@pytest.mark.mpi
def test_train_gpt_ep2_pp2_checkpoint_resumes_anywhere(corpus, tmp_path, mpi):
    """The checkpoint of --ep 2 --pp 2 after step 2 holds the whole model in one process's
    format (every stage's experts, both ep ranks' gathered) and finishes the run as one
    process's straight run does (float64, 1e-10) on one process, on --ep 2, and on --ep 2
    --pp 2 --zero 3:

        mpiexec -n 4 python examples/train_gpt.py --moe-experts 4 --ep 2 --pp 2 \
            --micro-batches 2 ... --stop-at 2 --save ck
        python examples/train_gpt.py ... --resume ck   (and mpiexec -n 2 ... --ep 2)
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache", "--sample", "0"]
    ck, one = tmp_path / "ck", tmp_path / "one.jsonl"
    _one_process(common, one, mpi)
    mpi(4, "examples/train_gpt.py", *common, *EP_PP, "--stop-at", "2", "--save", ck,
        timeout=120)
    params, opt_sd, meta = checkpoint.load(ck)                     # verified on load
    specs = gpt_param_specs(GPTConfig(**meta["config"]))
    assert list(params) == list(specs) and meta["step"] == 2 and meta["optimizer"] == "AdamW"
    assert set(opt_sd["state"]) == set(specs)      # every expert's AdamW moments too
    logs = {"one": tmp_path / "back.jsonl", "ep2": tmp_path / "ep2.jsonl",
            "ep2xpp2+zero3": tmp_path / "zero3.jsonl"}
    _one_process(common, logs["one"], mpi, "--resume", ck)
    mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--resume", ck, "--log-json",
        logs["ep2"], timeout=120)
    mpi(4, "examples/train_gpt.py", *common, *EP_PP, "--zero", "3", "--resume", ck,
        "--log-json", logs["ep2xpp2+zero3"], timeout=120)
    last = [r["loss"] for r in _rows(one) if "loss" in r][-1]
    for name, log in logs.items():
        losses = [r["loss"] for r in _rows(log) if "loss" in r]
        assert len(losses) == 1 and abs(losses[0] - last) < 1e-10, (name, losses, last)


@pytest.mark.mpi
def test_train_gpt_ep2_pp2_resume_with_dropout_repeats_the_straight_run(corpus, tmp_path,
                                                                        mpi):
    """--ep 2 --pp 2 --zero 1 with --dropout 0.1 (each stage's own stream, kept per stage in
    the checkpoint): saved after step 2 and resumed, the losses are the straight run's, bit
    for bit.

        mpiexec -n 4 python examples/train_gpt.py ... --ep 2 --pp 2 --dropout 0.1 --save ck
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache", "--sample", "0",
              *EP_PP, "--zero", "1", "--dropout", "0.1", "--steps", "4"]
    straight, resumed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    mpi(4, "examples/train_gpt.py", *common, "--log-json", straight, timeout=120)
    mpi(4, "examples/train_gpt.py", *common, "--stop-at", "2", "--save", tmp_path / "ck",
        timeout=120)
    mpi(4, "examples/train_gpt.py", *common, "--resume", tmp_path / "ck", "--log-json",
        resumed, timeout=120)
    a, b = ([r["loss"] for r in _rows(log) if "loss" in r] for log in (straight, resumed))
    assert len(a) == 4 and b == a[2:], (a, b)
