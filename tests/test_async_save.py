"""--async-save (minidist/train/saves.py, minidist/strategy/saving.py): a save costs the step
the host copies of what each rank writes; a thread writes the files while training goes on;
the checkpoint is committed once every rank's are written. Proven here: the same files as a
save in the step, in one process and under mpiexec (DDP, ZeRO-3, TP 2 x DP 2 with DDP and
with ZeRO-1, PP 2); a resume from them continues bit for bit; no save lost at the end or at
SIGTERM / Ctrl-C; a write that fails on a thread (a file size limit set on every rank mid-run,
a file in the way) is one error line and exit 2 on every rank, `latest` unchanged; so is a
rank 1 file rank 0 does not see whole at commit (tests/scripts/commit_unseen.py); the flag
refused where it does nothing.

    mpiexec -n 2 python examples/train_gpt.py --zero 3 --save ck --save-every 2 --async-save
"""
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.strategy import checkpoint, checkpoint_dirs, saving
from minidist.strategy.base import SingleProcess
from minidist.strategy.checkpoint import CheckpointError
from mpirun import (ROOT, device_flags, logged_losses, mpi_env, mpiexec, rank_pids,
                    run_job, train_tiny)

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-every", "0", "--eval-iters", "1", "--sample", "0",
        "--log-every", "1"]
CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16)


def _train(ranks, flags, corpus, tmp_path, device, timeout=240):
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), *map(str, flags), *device_flags(device)]
    out = run_job(cmd, timeout=timeout)      # a timeout kills the job's process group
    assert "Traceback" not in out.stderr, (out.stdout[-3000:], out.stderr[-3000:])
    return out.stdout


def _contents(folder):
    """What a checkpoint folder holds, for comparing two: each manifest's step and its files'
    bytes and sha256 but state.json's (its "extra" records the flags: --async-save, --save),
    and state.json without "extra"."""
    out = {}
    for root, _, names in sorted(os.walk(folder)):
        if "manifest.json" not in names:
            continue
        where = os.path.relpath(root, folder)
        with open(os.path.join(root, "manifest.json")) as f:
            manifest = json.load(f)
        with open(os.path.join(root, "state.json")) as f:
            record = {k: v for k, v in json.load(f).items() if k != "extra"}
        files = {n: e for n, e in manifest["files"].items() if n != "state.json"}
        out[where] = (manifest["step"], files, record)
    return out


# ---- in one process: the plan's copies, a failing write -----------------------------------------

def _trained():
    model = GPT(CONFIG, seed=0)
    opt = AdamW(model.named_parameters(), lr=1e-2)
    x = np.random.default_rng(0).integers(0, 16, (2, 8))
    for _ in range(2):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _zero_one_rank(stage):
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.zero.strategy import ZeroDataParallel
    from minidist.train.args import train_parser
    strategy = ZeroDataParallel(ProcessGroup(MPI.COMM_WORLD, "ring", name="z"), stage)
    model = strategy.build_model(CONFIG, 0, "float32")
    opt = strategy.build_optimizer(model, train_parser().parse_args(["--lr", "1e-2"]))
    x = np.random.default_rng(0).integers(0, 16, (2, 8))
    strategy.forward_backward(model, x, x, 1.0, False)      # one step: AdamW's moments
    strategy.sync_grads(model)
    opt.step()
    strategy.after_step()
    return strategy, model, opt


@pytest.mark.parametrize("layout", ["one process", "zero 1", "zero 3"])
def test_a_plan_holds_copies_that_the_next_step_does_not_change(tmp_path, layout):
    """save_plan's arrays are the plan's own: the parameters, moments and ZeRO's shards
    changed in place after the plan (as the next optimizer step does while the thread
    writes) leave the written checkpoint as it was at the plan."""
    if layout == "one process":
        strategy, (model, opt) = SingleProcess(), _trained()
        live = [p.data for p in model.parameters()] + list(opt.state_arrays())
    else:
        strategy, model, opt = _zero_one_rank(int(layout[-1]))
        live = [u.param_shard for u in opt.engine.units] + list(opt.state_arrays())
    before = checkpoint.load(strategy.save(str(tmp_path / "now"), model, opt, 2, {}, {}))
    plan = strategy.save_plan(model, opt, 2, {}, {})
    save = saving.begin(str(tmp_path / "later"), 2, plan, strategy.job_group())
    for a in live:
        a += 1.0                                    # the next step, before the write
    save.write_in_background()
    save.commit()
    after = checkpoint.load(tmp_path / "later")
    for n, a in before[0].items():
        np.testing.assert_array_equal(after[0][n], a, err_msg=n)
    for n, s in before[1]["state"].items():
        for k, v in s.items():
            np.testing.assert_array_equal(after[1]["state"][n][k], v, err_msg=f"{n}/{k}")


def test_a_write_that_fails_on_the_thread_is_one_error_and_latest_stays(tmp_path):
    """A file in the way of the background write (a file where the plan's subfolder goes):
    commit raises the CheckpointError naming the --save directory, nothing is committed,
    the temporary folder is gone and `latest` still names the checkpoint before."""
    model, opt = _trained()
    d = str(tmp_path / "ck")
    first = checkpoint.save_checkpoint(d, model, opt, step=1)
    record = {"step": 2}
    plan = saving.SavePlan(files=[saving.arrays_file("part/model.safetensors",
                                                     {"w": np.zeros(3)}),
                                  saving.json_file("part/state.json", record)],
                           manifests=[saving.Manifest("part")])
    save = saving.begin(d, 2, plan)
    open(os.path.join(save.tmp, "part"), "w").close()        # in the way of the folder
    save.write_in_background()
    with pytest.raises(CheckpointError, match=f"saving {d} failed: .*part"):
        save.commit()
    assert checkpoint_dirs.resolve(d) == first and sorted(os.listdir(d)) == \
        ["latest", "step-00000001"]
    assert checkpoint.load(d)[2]["step"] == 1


@pytest.mark.mpi
@pytest.mark.parametrize("case,says", [
    ("unseen", r"rank 1: ck/\.tmp-[^,]*, made by world rank 0, is not there on this rank"),
    ("elsewhere", r"rank 1's shard-00001-of-00002\.safetensors is not in ck as world rank 0 "
                  r"sees it"),
    ("truncated", r"rank 1's shard-00001-of-00002\.safetensors is not in ck as world rank 0 "
                  r"sees it")], ids=["unseen", "elsewhere", "truncated"])
def test_a_save_folder_a_rank_does_not_see_is_an_error_not_a_checkpoint(case, says, tmp_path,
                                                                         mpi):
    """First-use walk 31: --save on a node's own disk (rank 1 "another node") printed "saved
    step 3", exit 0, and the resume found rank 1's shard missing: rank 1 had made the
    temporary folder on its own disk and written there. Now a rank that does not see rank
    0's temporary folder fails its write ("unseen"), and at every save rank 0 commits only
    files it sees whole (rank 1's shard in a folder of the same name on its own disk,
    "elsewhere"; cut short, "truncated"): otherwise one error line naming the rank and the
    file, exit 2, nothing committed, `latest` kept. Two real ranks, a committed step 1 first.
    By hand: mpiexec -n 2 python tests/scripts/commit_unseen.py --node-dirs A,B --case
    elsewhere"""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for n in nodes:
        n.mkdir()
    out = mpi(2, "tests/scripts/commit_unseen.py", "--node-dirs", ",".join(map(str, nodes)),
              "--case", case, timeout=120, check=False)
    assert out.returncode == 2 and "committed step 1" in out.stdout, (out.stdout, out.stderr)
    assert "step 2 committed" not in out.stdout and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("error: ") == 1, out.stderr
    assert re.search(r"^error: saving ck failed: " + says + "; --save must be a folder every "
                     r"rank sees", out.stderr, re.M), out.stderr
    ck = nodes[0] / "ck"
    assert checkpoint_dirs.resolve(str(ck)) == str(ck / "step-00000001")
    assert sorted(os.listdir(ck)) == ["latest", "step-00000001"]     # no temporary left


@pytest.mark.mpi
def test_a_save_folder_not_shared_is_one_error_under_a_short_timeout(tmp_path, mpi):
    """The test above ("elsewhere") under a 1 s collective timeout: rank 0 looks for rank 1's
    shard for VISIBLE_WITHIN_S (3 s) before it says so, while rank 1 waited in commit's
    timed broadcast: the job aborted ("world ranks that did not arrive: [0]"), exit 1,
    beside the error line. The ranks now wait for rank 0's part untimed (Save.commit). By
    hand: MINIDIST_COMM_TIMEOUT=1 mpiexec -n 2 python tests/scripts/commit_unseen.py
    --node-dirs A,B --case elsewhere"""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for n in nodes:
        n.mkdir()
    out = mpi(2, "tests/scripts/commit_unseen.py", "--node-dirs", ",".join(map(str, nodes)),
              "--case", "elsewhere", timeout=120, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=1))
    assert out.returncode == 2 and "aborting" not in out.stderr, (out.stdout, out.stderr)
    assert out.stderr.count("error: saving ck failed: rank 1's") == 1, out.stderr


# ---- whole runs: the same files, the same numbers after a resume ------------------------------

LAYOUTS = [(1, []), (2, []), (2, ["--zero", "3"]), (4, ["--tp", "2", "--dp", "2"]),
           (4, ["--tp", "2", "--dp", "2", "--zero", "1"]), (2, ["--pp", "2"])]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,layout", LAYOUTS,
                         ids=[f"{r} rank(s) {' '.join(f) or 'plain'}" for r, f in LAYOUTS])
def test_async_checkpoints_are_the_saves_in_the_step_and_resume_bit_for_bit(
        ranks, layout, corpus, tmp_path, device):
    """By hand: mpiexec -n 2 python examples/train_gpt.py --zero 3 --steps 6 --save-every 2
    --save ck --async-save (and without --async-save into another folder): every folder holds
    the same files (sha256 of the model's, the optimizer's or the shards, and state.json but
    the flags it records), the last step committed before the run ends; resumed from the
    async step 2 the losses are the straight run's, bit for bit."""
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    common = [*layout, "--steps", "6", "--save-every", "2", "--keep", "3"]
    _train(ranks, [*common, "--save", sync], corpus, tmp_path, device)
    log = tmp_path / "straight.jsonl"
    out = _train(ranks, [*common, "--save", asyn, "--async-save", "--log-json", log], corpus,
                 tmp_path, device)
    for step in (2, 4, 6):
        assert f"saved step {step} to {asyn}/step-{step:08d}" in out, out[-3000:]
    assert "their files written on a thread: --async-save" in out
    assert checkpoint_dirs.read_latest(asyn) == "step-00000006"
    assert not [n for n in os.listdir(asyn) if n.startswith(".")]
    for step in (2, 4, 6):
        name = f"step-{step:08d}"
        held = _contents(asyn / name)
        assert held and all(files for _, files, _ in held.values()), held
        assert held == _contents(sync / name), name
    resumed = tmp_path / "resumed.jsonl"
    _train(ranks, [*layout, "--steps", "6", "--resume", asyn / "step-00000002", "--save",
                   tmp_path / "again", "--log-json", resumed, "--async-save"],
           corpus, tmp_path, device)
    assert logged_losses(resumed) == logged_losses(log)[2:]


# ---- signals and the end of a run -------------------------------------------------------------

def _start(ranks, flags, corpus, tmp_path, device):
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), "--steps", "100000", *map(str, flags),
           *device_flags(device)]
    return subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_until(job, ready, timeout=90):
    deadline = time.time() + timeout
    while not ready():
        assert time.time() < deadline and job.poll() is None, job.communicate()
        time.sleep(0.05)


SIGNALS = [(signal.SIGTERM, 2, 75), (signal.SIGINT, 1, 130)]


@pytest.mark.mpi
@pytest.mark.parametrize("signum,ranks,status", SIGNALS,
                         ids=[f"{s.name}, {r} rank(s)" for s, r, _ in SIGNALS])
def test_a_signal_commits_the_save_in_flight_then_saves_its_step(signum, ranks, status,
                                                                 corpus, tmp_path, device):
    """By hand: mpiexec -n 2 python examples/train_gpt.py --save ck --save-every 1
    --async-save ..., then kill -TERM the job (or Ctrl-C): the save in flight is committed,
    the step the ranks stop at is saved and named, exit 75 (130), nothing left half-done."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    job = _start(ranks, ["--save", ck, "--save-every", "1", "--keep", "1000", "--async-save",
                         "--log-json", log], corpus, tmp_path, device)
    try:
        _wait_until(job, lambda: log.exists() and len(log.read_text().splitlines()) >= 4)
        os.killpg(job.pid, signum)
        out, err = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == status and "Traceback" not in err, (out[-2000:], err[-2000:])
    step = len(log.read_text().splitlines())              # steps done, all logged
    line = [s for s in out.splitlines() if f"after step {step}: saved to" in s]
    assert len(line) == 1 and f"{ck}/step-{step:08d}" in line[0], out[-2000:]
    assert checkpoint_dirs.read_latest(ck) == f"step-{step:08d}"
    assert checkpoint_dirs.numbered(ck) == [f"step-{s:08d}" for s in range(1, step + 1)]
    assert not [n for n in os.listdir(ck) if n.startswith(".")]
    assert checkpoint.load(ck)[2]["step"] == step


WRITE_FAILS = [(1, [], "every rank"), (2, [], "every rank"), (2, ["--zero", "2"], "one rank")]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,layout,limited", WRITE_FAILS,
                         ids=[f"{r} rank(s) {' '.join(f) or 'plain'}, {w}"
                              for r, f, w in WRITE_FAILS])
def test_a_write_that_fails_mid_run_stops_every_rank_with_one_line(ranks, layout, limited,
                                                                   corpus, tmp_path, device):
    """A disk that fills up mid-run: once a first checkpoint is committed, the file size
    limit of every rank (under ZeRO-2 of one: its shard alone fails) is set below a
    checkpoint file's size (prlimit; Python ignores SIGXFSZ, so a write past it is OSError
    EFBIG on the writer thread). The next commit stops every rank at the same step: one
    `error: saving ck failed: ...` line, exit 2, no traceback, no hang; `latest` still names
    a complete checkpoint, and no temporary folder is left."""
    ck = tmp_path / "ck"
    job = _start(ranks, [*layout, "--save", ck, "--save-every", "3", "--async-save"], corpus,
                 tmp_path, device)
    try:
        _wait_until(job, lambda: checkpoint_dirs.read_latest(ck) is not None)
        pids = rank_pids(job)
        assert sorted(pids) == list(range(ranks)), pids
        for rank in range(ranks) if limited == "every rank" else [ranks - 1]:
            resource.prlimit(pids[rank], resource.RLIMIT_FSIZE, (4096, 4096))
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 2, (job.returncode, out[-2000:], err[-2000:])
    assert "Traceback" not in err and err.count("\n") == 1, err[-2000:]
    assert err.startswith(f"error: saving {ck} failed: ") and "File too large" in err, err
    kept = checkpoint.load(ck)[2]["step"]
    assert kept % 3 == 0 and f"saved step {kept} to {ck}" in out
    # first-use walk 27: the line said neither which step failed nor what is still there
    assert err.endswith(f" (step {kept + 3}); {ck} keeps step {kept} "
                        f"({ck}/step-{kept:08d})\n"), err
    assert not [n for n in os.listdir(ck) if n.startswith(".tmp")], os.listdir(ck)


# ---- the flag -----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,says", [
    (["--async-save"], "error: --async-save: sets whether checkpoints are written on a thread "
     "while training goes on, which this run does not use (add --save DIR, or leave "
     "--async-save out)"),
    (["--async-save", "--eval-only", "--resume", "{ck}"], "error: --async-save: sets whether "
     "checkpoints are written on a thread while training goes on, which this run does not "
     "use (drop --eval-only to train, or leave --async-save out)")])
def test_the_flag_is_refused_where_it_does_nothing(flags, says, corpus, tmp_path):
    """By hand: python examples/train_gpt.py --async-save (no --save); ... --resume ck
    --eval-only --async-save (nothing is saved)."""
    ck = tmp_path / "ck"
    if "{ck}" in flags:
        assert train_tiny("--data", corpus, "--save", ck).returncode == 0
    out = subprocess.run([sys.executable, "examples/train_gpt.py", "--data", corpus,
                          *[f.format(ck=ck) for f in flags]], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == says + "\n", out.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("held_s", [3, None], ids=["held 3 s", "stopped for good"])
def test_a_save_longer_than_the_collective_timeout_is_no_hang(held_s, corpus, tmp_path,
                                                              device):
    """    mpiexec -n 2 python examples/train_gpt.py --save ck --save-every 2 --comm-timeout 1
    with rank 0 held (SIGSTOP) while it writes step 2: under DDP rank 0 writes the whole
    model, and rank 1 waited for it in a watched collective, so a save longer than
    --comm-timeout aborted the job in every save, blaming "different collectives"
    (first-use walk 37; at the default 600 s, a big model on a slow file system). The
    ranks now wait for each other's files untimed (saving.Save.commit): held 3 s, the run
    ends well. Stopped for good (a node that hung mid-save), rank 0's watchdog answers
    nothing: rank 1 waited for ever (2026-11-29's chaos campaign); now the job ends once the
    silence has lasted 10 s (the timeout, at least 10 s), naming rank 0, and `latest` is
    still not a half-written step."""
    ck = tmp_path / "ck"
    job = _start(2, ["--n-layer", "4", "--n-embd", "256", "--steps", "4", "--save", ck,
                     "--save-every", "2", "--comm-timeout", "1"], corpus, tmp_path, device)
    try:
        def writing():             # a file in the save's temporary folder: begin is over
            return ck.exists() and any(f.is_file() for p in ck.glob(".tmp-*")
                                       for f in p.rglob("*"))
        deadline = time.time() + 90
        while not writing():
            assert time.time() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.002)
        rank0 = rank_pids(job)[0]
        os.kill(rank0, signal.SIGSTOP)
        if held_s is not None:
            time.sleep(held_s)
            os.kill(rank0, signal.SIGCONT)
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    if held_s is not None:
        assert job.returncode == 0, (job.returncode, out[-2000:], err[-2000:])
        assert f"saved step 2 to {ck}" in out and f"saved step 4 to {ck}" in out, out
        return
    assert job.returncode != 0 and "saved step 2" not in out, (job.returncode, out, err)
    assert err.count("world rank 0 answered nothing for 10 s: stopped or hung") == 1, err
    assert not (ck / "latest").exists()


@pytest.mark.mpi
def test_a_rank_late_to_a_save_is_waited_for_untimed(mpi, tmp_path):
    """Rank 0 copies what it writes before the save begins (under DDP: the whole model and
    its optimizer), while rank 1 has nothing to copy and waited for it in begin's
    broadcast_object, a watched collective: a 42.7M-parameter model on 4 ranks under
    --comm-timeout 1 aborted a healthy job there (a review, 2026-11-29). Held 3 s at each of
    two saves under a 1 s timeout, rank 0 is now waited for (saving.begin). By hand:
    MINIDIST_COMM_TIMEOUT=1 mpiexec -n 2 python tests/scripts/save_late.py --save ck"""
    ck = tmp_path / "ck"
    out = mpi(2, "tests/scripts/save_late.py", "--save", ck, timeout=90,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=1))
    assert f"saved step 2 to {ck}" in out.stdout, out.stdout + out.stderr
    assert checkpoint_dirs.read_latest(ck) == "step-00000002"
