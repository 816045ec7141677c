"""What a user meets while examples/train_gpt.py runs, case by case. Table-driven: each row is a
case a user hit.

- Runs (RUNS): a --save holding a newer checkpoint is refused unless --resume / --overwrite;
  each save says `saved step N to DIR`; a diverged run stops with one line naming the step
  and saves nothing; log lines show step N/total, elapsed and ETA; the model line under TP
  and PP gives the whole model and this rank's share.
- Ctrl-C (CTRL_C): SIGINT to the job's process group (mpiexec forwards it to every rank)
  saves at the step boundary with --save, prints one line, exits 130; while the flags are
  read or the end's sample is written it is one line too.
"""
import ast
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from minidist.nn import GPTConfig
from minidist.nn.config import gpt_param_specs
from tests.mpirun import ROOT, device_flags, mpi_env, mpiexec, run_job


# ---- whole runs ------------------------------------------------------------------------------
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-every", "0", "--eval-iters", "1", "--sample", "0"]
_WHOLE = sum(math.prod(s) for s, _ in gpt_param_specs(GPTConfig(
    n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=256)).values())
# (case, ranks, runs before it, its flags, exit status, lines its output must hold, lines
# it must not). {ck}, {old}: --save folders; each run adds TINY, the corpus and --steps 3.
RUNS = [
    ("each save says where", 1, [], ["--save", "{ck}", "--save-every", "2"], 0,
     ["saved step 2 to {ck}/step-00000002", "saved step 3 to {ck}/step-00000003"], []),
    ("same --save again is refused", 1, [["--save", "{ck}"]], ["--save", "{ck}"], 2,
     ["error: --save {ck}: already holds a checkpoint (step 3: {ck}/step-00000003)",
      "It is a finished run: add --resume auto --steps N, N above 3, to train it further",
      "--overwrite"], ["step     1/3"]),
    ("same --save again after a stop is refused", 1, [["--save", "{ck}", "--stop-at", "2"]],
     ["--save", "{ck}"], 2, ["already holds a checkpoint (step 2: {ck}/step-00000002)",
                             "Add --resume auto to continue it"], ["finished run"]),
    ("same --save again is refused, DDP", 2, [["--save", "{ck}"]], ["--save", "{ck}"], 2,
     ["error: --save {ck}: already holds a checkpoint (step 3: {ck}/step-00000003)"], []),
    ("--overwrite replaces it", 1, [["--save", "{ck}"]],
     ["--save", "{ck}", "--overwrite", "--steps", "2"], 0, ["saved step 2 to {ck}"], []),
    ("--resume auto continues it", 1, [["--save", "{ck}", "--steps", "2"]],
     ["--save", "{ck}", "--resume", "auto"], 0,
     ["at step 2", "step     3/3", "saved step 3 to {ck}"], []),
    ("--resume auto on an empty --save says it starts fresh", 1, [],
     ["--save", "{ck}", "--resume", "auto"], 0,
     ["--resume auto: no checkpoint in {ck} yet: starting at step 0", "step     3/3"], []),
    ("--muon-* on an AdamW checkpoint names it", 1, [["--save", "{ck}", "--steps", "2"]],
     ["--resume", "{ck}", "--muon-momentum", "0.9"], 2,
     ["error: --muon-momentum 0.9: sets Muon's momentum, which this run does not use "
      "(--resume {ck}", "was trained with adamw, which a resumed run keeps"], []),
    ("--resume older, --save newer is refused", 1,
     [["--save", "{old}", "--steps", "1"], ["--save", "{ck}"]],
     ["--resume", "{old}", "--save", "{ck}"], 2,
     ["error: --save {ck}: holds step 3", "newer than step 1"], []),
    ("diverged: one line, nothing saved", 1, [],          # (exit 3: not a bad flag's 2)
     ["--lr", "1e30", "--grad-clip", "0", "--save", "{ck}", "--steps", "20"], 3,
     ["error: step 2: loss nan", "training diverged (--lr 1e+30 too high?)", "nothing saved"],
     ["saved step", "RuntimeWarning"]),
    ("diverged under ZeRO-2: every rank stops", 2, [],
     ["--lr", "1e30", "--grad-clip", "0", "--zero", "2", "--save", "{ck}", "--steps", "20"], 3,
     ["error: step 2: loss nan"], ["saved step"]),
    ("progress: step N/total, elapsed, ETA", 1, [], ["--log-every", "1"], 0,
     ["step     1/3 | loss", "step     3/3 | loss", "elapsed, ETA"], []),
    ("TP: the whole model and this rank's share", 2, [], ["--tp", "2"], 0,
     [f"model: {_WHOLE:,} parameters ("], []),
    ("PP: the whole model and this rank's share", 2, [], ["--pp", "2"], 0,
     [f"model: {_WHOLE:,} parameters ("], []),
    # dp rank 1 does not sample and asks for a signal as often: 17 tokens, two agreements
    # each (end_sample.SAMPLE_AGREE 16; one asked fewer there left rank 0 waiting for ever)
    ("the end's sample ends on a rank that does not sample", 2, [], ["--sample", "17"], 0,
     ["---- sample ----"], []),
]


def _train(ranks, flags, corpus, tmp_path):
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), "--steps", "3", *flags]
    return run_job(cmd, timeout=120, check=False)   # a timeout kills the process group


@pytest.mark.mpi
@pytest.mark.parametrize("case,ranks,before,flags,status,says,never", RUNS,
                         ids=[r[0] for r in RUNS])
def test_runs(case, ranks, before, flags, status, says, never, corpus, tmp_path, device):
    """Each row by hand: python examples/train_gpt.py FLAGS (after the runs before it)."""
    fill = {"ck": tmp_path / "ck", "old": tmp_path / "old"}
    for earlier in before:
        assert _train(1, [f.format(**fill) for f in earlier], corpus, tmp_path).returncode == 0
    saved = sorted(os.listdir(fill["ck"])) if os.path.isdir(fill["ck"]) else []
    out = _train(ranks, [f.format(**fill) for f in flags] + device_flags(device), corpus,
                 tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == status and "Traceback" not in text, text[-3000:]
    for line in says:
        assert line.format(**fill) in text, (line, text[-3000:])
    for line in never:
        assert line not in text, (line, text[-3000:])
    if status:     # one error line from rank 0, and --save holds what it held
        assert out.stderr.count("\n") == 1, out.stderr
        assert (sorted(os.listdir(fill["ck"])) if os.path.isdir(fill["ck"]) else []) == saved


# (ranks, with --save): Ctrl-C to the job's process group, as a terminal sends it
CTRL_C = [(1, True), (2, True), (2, False)]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,save", CTRL_C, ids=[f"{r} rank(s), save {s}" for r, s in CTRL_C])
def test_ctrl_c_saves_at_the_step_boundary(ranks, save, corpus, tmp_path, device):
    """By hand: mpiexec -n 2 python examples/train_gpt.py --save ck ..., then Ctrl-C."""
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), "--steps", "100000", "--log-every", "1",
           "--log-json", str(log), *(["--save", str(ck)] if save else []),
           *device_flags(device)]
    job = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert time.time() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.1)
        os.killpg(job.pid, signal.SIGINT)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err
    lines = [line for line in out.splitlines() if line.startswith("interrupted (Ctrl-C)")]
    assert len(lines) == 1, out[-2000:]
    step = len(log.read_text().splitlines())             # steps done, all logged
    if save:
        assert f"after step {step}: saved to {ck}/step-{step:08d}" in lines[0]
        assert f"--resume {ck}" in lines[0] and (ck / f"step-{step:08d}").is_dir()
    else:
        assert lines[0] == f"interrupted (Ctrl-C) after step {step}: nothing saved (no --save DIR)"


def test_ctrl_c_while_the_flags_are_read_is_one_line(capsys):
    """First-use walk 26: a Ctrl-C landing in `train_parser().parse_args()`, evaluated as
    run_main's argument between the import guard and run_main's own, was a traceback (2 in
    25 tries at 2.0-2.4 s). The entry points now hand run_main their parser, built and read
    inside its guard: the one interrupted line, exit 130."""
    from minidist.train.cli import run_main

    def interrupted_parser():
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as e:
        run_main(lambda args: None, parser=interrupted_parser)
    assert e.value.code == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C): stopped at once, nothing saved\n"
    for script in ("train_gpt", "sample", "export_gpt2", "train_tokenizer"):
        tree = ast.parse(open(os.path.join(ROOT, "examples", f"{script}.py")).read())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", None) == "run_main"]
        assert len(calls) == 1 and not calls[0].args[1:], script    # nothing parsed outside
        assert [k.arg for k in calls[0].keywords][:1] == ["parser"], script


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,flags,signum", [(1, (), signal.SIGINT),
                                                (2, ("--tp", "2"), signal.SIGINT),
                                                (2, ("--tp", "2"), signal.SIGTERM)])
def test_ctrl_c_during_the_sample_is_one_line_and_130(ranks, flags, signum, corpus, tmp_path):
    """First-use walk 26: the end's sample (--sample 400 by default, under --eval-only too)
    never looked at the flag a Ctrl-C sets, so it ran to its end and the run exited 0, the
    Ctrl-C lost. Now the ranks agree every 16 tokens whether a signal came, so one process
    and the ranks of a split model (here TP: the same tokens through its collectives) stop
    at the same token, and the run says so in one line, exit 130, its steps saved. A
    scheduler's SIGTERM the same, exit 0: the run is done (walk 37: it cut the sample
    without a word).

        python examples/train_gpt.py --save ck --sample 100000, then Ctrl-C as it samples
    """
    ck, out_path = tmp_path / "ck", tmp_path / "out.txt"
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    tokens = "100000"                 # minutes to sample whole: the cut is what ends it
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), "--steps", "2", "--save", str(ck),
           "--sample", tokens, *flags]
    with open(out_path, "w") as out:
        job = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=out,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.time() + 120
            while "sampling " not in out_path.read_text():
                assert time.time() < deadline and job.poll() is None, job.communicate()
                time.sleep(0.1)
            os.killpg(job.pid, signum)
            _, err = job.communicate(timeout=60)    # the cut ends it: whole, it took minutes
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    said = out_path.read_text()
    what, status = ("interrupted (Ctrl-C)", 130) if signum == signal.SIGINT else \
        ("preempted (SIGTERM)", 0)
    assert job.returncode == status and "Traceback" not in err, (said[-1500:], err)
    assert said.count(f"{what} during the sample") == 1, said[-1500:]
    assert f"the 2 steps are done and saved in {ck}" in said and (ck / "step-00000002").is_dir()
    sample = said.split("---- sample ----\n")[1].split("\n----------------")[0]
    assert len(sample) < 20000, len(sample)
