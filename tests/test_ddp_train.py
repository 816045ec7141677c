"""examples/train_gpt.py under mpiexec with data parallelism: a --dp the job does not have
refused on every rank, the main job's path end to end (--log-json, the DDP summary, a trace of
both ranks), a resume bit for bit, and the Quick start's default job (slow).

Each test's docstring gives the command to run it by hand.
"""
import json

import pytest

from mpirun import logged_losses


TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "8", "--lr", "1e-2", "--eval-iters", "2", "--sample", "0",
        "--log-every", "1", "--bucket-mb", "0.005"]


@pytest.mark.mpi
def test_bad_dp_is_refused_on_every_rank(mpi):
    """No collective is reached, so nothing hangs; one line says why (rank 0's), exit 2, no
    traceback:

        mpiexec -n 2 python examples/train_gpt.py --dp 3
    """
    out = mpi(2, "examples/train_gpt.py", "--dp", "3", timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("error: --dp 3 = 3 ranks, but this job has 2 MPI process") == 1


@pytest.mark.mpi
def test_train_gpt_under_mpiexec(corpus, tmp_path, mpi):
    """The main job's path end to end, small: 2 ranks, --log-json from rank 0 only with
    comm_bytes growing, a DDP summary line and a Chrome trace with both ranks:

        mpiexec -n 2 python examples/train_gpt.py --data CORPUS --steps 4 --trace t.json ...
    """
    log, path = tmp_path / "log.jsonl", tmp_path / "trace.json"
    out = mpi(2, "examples/train_gpt.py", *TINY, "--data", corpus, "--cache-dir",
              tmp_path / "cache", "--steps", "4", "--eval-every", "0", "--grad-accum", "2",
              "--log-json", log, "--trace", path, timeout=120)
    rows = [json.loads(line) for line in open(log)]
    assert [r["step"] for r in rows[:-1]] == [0, 1, 2, 3] and rows[-1]["final"]
    sent = [r["comm_bytes"] for r in rows[:-1]]
    assert sent[0] > 0 and all(b > a for a, b in zip(sent, sent[1:]))
    assert out.stdout.count("step     1/") == 1                  # rank 0 prints alone
    assert "DDP overlapped over 2 ranks" in out.stdout and "2 process(es)" in out.stdout
    pids = {e["pid"] for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"}
    assert pids == {0, 1}


@pytest.mark.mpi
@pytest.mark.slow
def test_ddp_resume_continues_bit_identically(corpus, tmp_path, mpi):
    """Rank 0 saves, every rank resumes; the resumed steps repeat the uninterrupted run's:

        mpiexec -n 2 python examples/train_gpt.py ... --stop-at 3 --save DIR; ... --resume DIR
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache", "--steps", "6",
              "--eval-every", "0"]
    straight, resumed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    mpi(2, "examples/train_gpt.py", *common, "--log-json", straight, timeout=120)
    mpi(2, "examples/train_gpt.py", *common, "--save", tmp_path / "ck", "--stop-at", "3",
        timeout=120)
    mpi(2, "examples/train_gpt.py", *common, "--resume", tmp_path / "ck", "--log-json",
        resumed, timeout=120)
    assert logged_losses(resumed)[:3] == logged_losses(straight)[3:6]


@pytest.mark.mpi
@pytest.mark.slow
def test_main_job_defaults_train(tmp_path, mpi):
    """The Quick start's main job with its default flags, cut to 60 steps: the loss falls.

        mpirun -n 4 python examples/train_gpt.py
    """
    log = tmp_path / "log.jsonl"
    mpi(4, "examples/train_gpt.py", "--steps", "60", "--eval-every", "0", "--log-json",
        log, "--sample", "0", timeout=600)
    rows = [row for row in map(json.loads, open(log)) if "loss" in row]
    assert len(rows) == 60 and rows[-1]["loss"] < rows[0]["loss"] - 1.0
