"""A randomized fault-injection campaign: examples/train_gpt.py under mpiexec, one fault at a
random moment (start-up, a step, a save, its commit, an --async-save write), then what must
hold every time on a cluster where a node can die at any instant:

    (a) the job ends, within --comm-timeout and a margin (no hang, no rank left running)
    (b) --save holds only numbered checkpoints that verify, `latest` names one of them, and
        otherwise only what a resume ignores or cleans (.tmp-*, .latest.tmp-*, .lock)
    (c) --resume auto to the same final step exits 0, logs exactly the losses, grad norms and
        learning rates of a run never interrupted (float64: resume is bit-exact), and saves
        exactly its parameters and optimizer state; it leaves no temporary behind

    python tests/scripts/chaos.py --trials 40 --seed 1 --work /tmp/chaos_w
    python tests/scripts/chaos.py --trials 4 --layouts one,ddp2 --json out.json

The faults: SIGKILL of one rank (any rank, a node dying), SIGKILL of mpiexec itself (its
ranks must not train on unwatched), SIGTERM or SIGUSR1 to the job's process group (a
scheduler's preemption: save, exit 75) or to one rank alone. Each trial's seed, delay and
fault are printed, so a violation reruns as `--seed S --trials 1 --first T`. References (the
uninterrupted run of each layout) are made once per layout and shared by its variants
(--async-save, --keep 2), which must match them bit for bit too. tests/test_chaos.py runs a
small campaign (marked slow); the README's Reliability table cites what a larger one ran.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from minidist.strategy import best_checkpoint, checkpoint, checkpoint_dirs  # noqa: E402
from tests.mpirun import family, mpi_env, mpiexec, rank_pids  # noqa: E402

MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
         "--batch-size", "4", "--eval-iters", "1", "--eval-every", "10", "--sample", "0",
         "--dtype", "float64", "--seed", "7"]
LAYOUTS = {                      # name: (processes, flags)
    "one": (1, []),
    "ddp2": (2, []),
    "ddp4": (4, []),
    "zero1": (2, ["--zero", "1"]),
    "zero3": (2, ["--zero", "3"]),
    "tp2dp2": (4, ["--tp", "2", "--dp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "ep2": (2, ["--ep", "2", "--moe-experts", "2"]),
}
VARIANTS = {"plain": [], "async": ["--async-save"], "keep2": ["--keep", "2"],
            "async-keep2": ["--async-save", "--keep", "2"],
            "best-keep2": ["--keep-best", "--keep", "2"]}
FAULTS = ("kill-rank", "kill-rank", "kill-rank", "kill-launcher", "term-job", "usr1-job",
          "term-rank", "stop-rank")
SIGNALS = {"kill-rank": signal.SIGKILL, "term-rank": signal.SIGTERM,
           "stop-rank": signal.SIGSTOP}                  # (stop: a node that hangs)
ALLOWED_LEFT = ("latest", "best", checkpoint_dirs.LOCK)   # besides step-* and temporaries
COMPARED = ("loss", "grad_norm", "lr", "val_loss")
DEVICE = "cpu"                   # every rank's --device (main: --device)


def command(nprocs, flags, save, log, steps, timeout, extra=()):
    return [mpiexec(), "-n", str(nprocs), sys.executable,
            os.path.join(ROOT, "examples", "train_gpt.py"), *MODEL, *flags,
            "--steps", str(steps), "--save", save, "--save-every", "2", "--log-json", log,
            *(["--comm-timeout", str(timeout)] if nprocs > 1 else []), *extra,
            "--device", DEVICE]


def start(cmd, out):
    with open(out, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def alive(pids):
    """The processes of `pids` still running (zombies count as gone)."""
    left = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.add(pid)
        except OSError:
            pass
    return left


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def in_save(save):
    """Whether a save into `save` is under way (its .tmp- folder, or the pointer's, there)."""
    try:
        return any(n.startswith((".tmp-", ".latest.tmp-")) and not n.endswith("-probe")
                   for n in os.listdir(save))
    except OSError:
        return False


def owners(names):
    """What /proc says of the processes temporaries' names carry: a stray one's evidence."""
    said = {}
    for name in names:
        pid = name.split("-")[2] if name.startswith(".tmp-") else name.rsplit("-", 1)[-1]
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                said[pid] = stat.rsplit(")", 1)[1].split()[0] + " " + \
                    f.read().replace(b"\0", b" ").decode(errors="replace")[:80]
        except (OSError, IndexError):
            said[pid] = "gone"
    return said


def rows(log):
    if not os.path.exists(log):
        return {}
    with open(log) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def state(save):
    """(params, optimizer state, step) of --save's latest checkpoint, verified."""
    params, opt, meta = checkpoint.load(save)
    return params, opt, meta["step"]


def same_state(a, b):
    """Where two load() results differ, or None when bit for bit the same."""
    import numpy as np
    pa, oa, sa = a
    pb, ob, sb = b
    if sa != sb:
        return f"step {sa} != {sb}"
    if sorted(pa) != sorted(pb):
        return "parameter names differ"
    for n in pa:
        if not np.array_equal(np.asarray(pa[n]), np.asarray(pb[n])):
            return f"parameter {n} differs"
    for n, st in oa["state"].items():
        for k, v in st.items():
            w = ob["state"].get(n, {}).get(k)
            if not np.array_equal(np.asarray(v), np.asarray(w)):
                return f"optimizer {n}/{k} differs"
    return None


def inspect(save):
    """(b): the problems of the --save folder after a fault (a list), and its latest step."""
    if not os.path.isdir(save):
        return [], None
    problems = []
    for name in os.listdir(save):
        path = os.path.join(save, name)
        if checkpoint_dirs.step_of(name) is not None and os.path.isdir(path):
            try:
                checkpoint.verify(path)
            except (checkpoint_dirs.CheckpointError, OSError, ValueError) as e:
                problems.append(f"{name} does not verify: {e}")
        elif name not in ALLOWED_LEFT and not name.startswith((".tmp-", ".latest.tmp-")):
            problems.append(f"unexpected {name}")
    latest = None
    try:
        if checkpoint_dirs.has_checkpoint(save):
            folder = checkpoint_dirs.resolve(save)
            latest = checkpoint_dirs.step_of(folder)
            checkpoint.verify(folder)
    except (checkpoint_dirs.CheckpointError, OSError, ValueError) as e:
        problems.append(f"latest: {e}")
    best = best_checkpoint.read(save)            # --keep-best: what it names verifies
    if best is not None:
        try:
            checkpoint.verify(os.path.join(save, best[0]))
        except (checkpoint_dirs.CheckpointError, OSError, ValueError) as e:
            problems.append(f"best: {e}")
    return problems, latest


def reference(layout, work, steps, timeout):
    """The uninterrupted run of `layout`: (rows, final state, seconds it took)."""
    d = os.path.join(work, f"ref-{layout}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    nprocs, flags = LAYOUTS[layout]
    t = time.monotonic()
    job = start(command(nprocs, flags, os.path.join(d, "ck"), os.path.join(d, "log.json"),
                        steps, timeout), os.path.join(d, "out.txt"))
    rc = job.wait(timeout=timeout + 300)
    if rc != 0:
        raise SystemExit(f"reference {layout} failed, exit {rc}: see {d}/out.txt")
    return (rows(os.path.join(d, "log.json")), state(os.path.join(d, "ck")),
            time.monotonic() - t)


def trial(n, rng, layout, variant, fault, ref, work, steps, timeout):
    """One trial: a run, a fault after a random delay, checks (a), (b), (c). Its record."""
    d = os.path.join(work, f"trial-{n}")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    nprocs, flags = LAYOUTS[layout]
    flags = flags + VARIANTS[variant]
    if fault == "stop-rank" and nprocs == 1:      # nothing watches a lone stopped process
        fault = "kill-rank"
    save, bound = os.path.join(d, "ck"), timeout + 60
    ref_rows, ref_state, ref_s = ref
    when = rng.choice(("any", "save"))
    delay = round(rng.uniform(0.0, 0.9 * ref_s) if when == "any" else rng.uniform(0, 0.05), 3)
    skip = rng.randint(1, 6) if when == "save" else 0    # in the skip-th save (of 12)
    rec = {"trial": n, "layout": layout, "variant": variant, "fault": fault, "when": when,
           "save": skip, "delay": delay, "violations": []}
    bad = rec["violations"]
    job = start(command(nprocs, flags, save, os.path.join(d, "log.json"), steps, timeout),
                os.path.join(d, "out.txt"))
    for k in range(skip):             # into the skip-th save: its temporary folder there
        while job.poll() is None and not in_save(save):
            time.sleep(0.002)
        while k < skip - 1 and job.poll() is None and in_save(save):     # (that one ends)
            time.sleep(0.002)
    time.sleep(delay)
    seen = family(job.pid)
    target = None
    if fault in SIGNALS:
        pids = rank_pids(job)
        while not pids and job.poll() is None:            # ranks not started yet
            time.sleep(0.02)
            pids = rank_pids(job)
        if pids:
            rank = rng.choice(sorted(pids))
            target = pids[rank]
            rec["rank"] = rank
    elif fault == "kill-launcher":
        target = job.pid
    seen |= family(job.pid)
    if job.poll() is not None:
        rec["missed"] = True                              # it ended before the fault
    else:
        try:
            if fault in ("term-job", "usr1-job"):
                os.killpg(job.pid, signal.SIGTERM if fault == "term-job" else signal.SIGUSR1)
            elif target is not None:
                os.kill(target, SIGNALS.get(fault, signal.SIGKILL))
        except ProcessLookupError:
            rec["missed"] = True
    t = time.monotonic()                                  # (a) the job ends, all of it
    try:
        rec["rc"] = job.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        bad.append(f"hang: mpiexec still running after {bound} s")
        os.killpg(job.pid, signal.SIGKILL)
        rec["rc"] = job.wait()
    left = alive(seen | family(job.pid))
    while left and time.monotonic() - t < bound:
        time.sleep(0.1)
        left = alive(left)
    if left:
        bad.append(f"hang: processes {sorted(left)} still running {bound} s after the fault")
        kill_all(left)
    rec["ended_s"] = round(time.monotonic() - t, 2)
    if fault in ("term-job", "usr1-job") and rec["rc"] not in (75, 0) and not rec.get("missed"):
        bad.append(f"a preemption signal ended the job with exit {rec['rc']}, not 75")
    rec["cut"] = sorted(n for n in os.listdir(save) if n.startswith(".") and "tmp-" in n) \
        if os.path.isdir(save) else []                    # what a save cut short left
    problems, rec["latest"] = inspect(save)                # (b)
    bad += problems
    log2 = os.path.join(d, "resumed.json")                # (c) resume to the end
    again = subprocess.run(command(nprocs, flags, save, log2, steps, timeout,
                                   ("--resume", "auto")), cwd=ROOT, env=mpi_env(),
                           capture_output=True, text=True, timeout=bound + 300)
    with open(os.path.join(d, "resumed.txt"), "w") as f:
        f.write(again.stdout + again.stderr)
    if again.returncode != 0:
        bad.append(f"the resume exited {again.returncode}: "
                   f"{(again.stdout + again.stderr).strip().splitlines()[-1:]}")
        return rec
    got = rows(log2)
    for step, row in got.items():
        for k in COMPARED:
            if row.get(k) != ref_rows.get(step, {}).get(k):
                bad.append(f"step {step} {k}: {row.get(k)!r} != reference "
                           f"{ref_rows.get(step, {}).get(k)!r}")
    start_step = (rec["latest"] or 0)
    if sorted(got) != list(range(start_step, steps)):
        bad.append(f"the resume logged steps {sorted(got)[:3]}..., not {start_step}..{steps - 1}")
    diff = same_state(state(save), ref_state)
    if diff:
        bad.append(f"final checkpoint: {diff}")
    stray = [x for x in os.listdir(save) if x.startswith(".")]
    if stray:
        bad.append(f"left after the resume: {stray} (their processes: {owners(stray)})")
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--first", type=int, default=0, help="the first trial's number")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--faults", default=",".join(sorted(set(FAULTS))))
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--comm-timeout", type=int, default=15)
    p.add_argument("--work", default="chaos_work")
    p.add_argument("--json", help="write the trials' records here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the ranks' device")
    a = p.parse_args()
    global DEVICE
    DEVICE = a.device
    layouts, variants = a.layouts.split(","), a.variants.split(",")
    faults = [f for f in FAULTS if f in a.faults.split(",")]
    os.makedirs(a.work, exist_ok=True)
    refs, records = {}, []
    for n in range(a.first, a.first + a.trials):
        rng = random.Random(a.seed * 100003 + n)          # each trial reruns alone
        layout, variant, fault = rng.choice(layouts), rng.choice(variants), rng.choice(faults)
        if layout not in refs:
            refs[layout] = reference(layout, a.work, a.steps, a.comm_timeout)
        rec = trial(n, rng, layout, variant, fault, refs[layout], a.work, a.steps,
                    a.comm_timeout)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    bad = [r for r in records if r["violations"]]
    print(f"{len(records)} trials, {len(bad)} with violations, "
          f"{sum(bool(r.get('missed')) for r in records)} missed (the run ended first)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
