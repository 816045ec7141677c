"""A seeded fuzz of examples/train_gpt.py's command line: each trial a tiny run with a few
flags drawn at random from the parser's own table (minidist/train/args.py train_parser: every
flag, its type and choices), each given a usual value, an edge (0, -1, nan, inf, a value past
its range) or a wrong one (a word for a number, a missing file, a folder for a file), on one
process or under mpiexec on 2 or 4 ranks. What must hold for every draw (README "Bad input
gets a clear error"):

    (a) the job ends (within --limit seconds: no hang)
    (b) it trains (exit 0), or refuses with exactly one `error:` line on stderr, printed once
        whatever the rank count, exit 2, no traceback; or its loss diverges (--lr 1e30): one
        `error:` line saying so, exit 3

    python tests/scripts/fuzz_cli.py --trials 200 --seed 1 --work /tmp/fuzz_w --json fuzz.json
    python tests/scripts/fuzz_cli.py --seed 1 --first 17 --trials 1    # one trial again

Each trial's line (JSON) gives its seed, ranks, flags, exit status, what it found and the last
lines of its stderr when it broke (a), (b). Sizes are kept small (a layer count, a width, a
batch a tiny model can take), so a run that is allowed ends in seconds; a value far past what
a machine holds (--n-embd 10**9) is not drawn: that is a memory question, not a flag's.
tests/test_fuzz_cli.py runs a small campaign (marked slow); the README's Reliability table
cites what a larger one ran.
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

from minidist.train.args import train_parser  # noqa: E402
from tests.mpirun import mpi_env, mpiexec  # noqa: E402

BASE = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--steps", "2", "--eval-every", "2", "--eval-iters", "1",
        "--log-every", "1", "--sample", "0"]
SIZES = {         # (usual, edges) of the flags whose large values make a big or long run
    "--n-layer": ("1 2 3 4", "0 -1"), "--n-head": ("1 2 3 4", "0 -2 16 32"),
    "--n-embd": ("8 16 24 32", "0 -16 12 33"), "--block-size": ("8 16 32", "0 -1 1 15"),
    "--batch-size": ("1 2 4 8", "0 -1 3 16"), "--steps": ("1 2 3", "0 -1"),
    "--stop-at": ("1 2", "0 -1 5"), "--eval-iters": ("1 2", "0 -1"),
    "--sample": ("0 20", "-1 1"), "--attention-block": ("4 8 16 64", "0 -1 1 7"),
    "--ffn-hidden": ("32 48", "0 -1 7"), "--muon-ns-steps": ("1 3 5", "0 -1"),
    "--moe-experts": ("2 4", "0 -1 1 3"), "--moe-top-k": ("1 2", "0 -1 5"),
    "--moe-shared": ("1 2", "0 -1"), "--n-kv-head": ("1 2", "0 -1 3"),
    "--threads": ("1 2", "0 -1 64"), "--grad-accum": ("1 2 4", "0 -1 3 1000000"),
    "--micro-batches": ("1 2 4", "0 -1 3 1000000"), "--pp-virtual": ("1 2", "0 -1 3 1000"),
    "--dp": ("1 2 4", "0 -1 3 1000000000"), "--tp": ("1 2 4", "0 -1 3 1000000"),
    "--pp": ("1 2 4", "0 -1 3 1000000"), "--cp": ("1 2 4", "0 -1 3 1000000"),
    "--ep": ("1 2 4", "0 -1 3 1000000000"), "--zero-shard": ("1 2 4", "0 -1 3"),
}
INTS = ("1 2 3 4 100", "0 -1 -100 1000000 1000000000")
FLOATS = ("0 0.5 0.1 1e-3 1 2", "-1 nan inf -inf 1e30 1e-300")
WORDS = ["x", "", "1.5", "1e9", "0x10", " 2"]
SKIP = {"--help", "--traceback", "--device"}   # --device: picked below (no GPU here)


def paths(work):
    """Values for the flags that name files and folders: real ones, missing, the wrong kind."""
    corpus = os.path.join(work, "corpus.txt")
    empty = os.path.join(work, "empty.txt")
    folder = os.path.join(work, "folder")
    binary = os.path.join(work, "binary.bin")
    missing, missing_ck = os.path.join(work, "missing.txt"), os.path.join(work, "missing_ck")
    return {          # flag: (usual, wrong)
        "--data": ([corpus], [empty, folder, binary, missing, ""]),
        "--tokenizer": ([os.path.join(work, "missing_tok")], [folder, corpus, "",
                                    "gpt2"]),
        "--cache-dir": ([os.path.join(work, "cache")], [corpus, os.path.join(corpus, "s"), ""]),
        "--save": (["ck"], [corpus, os.path.join(corpus, "sub"), folder, ""]),
        "--resume": (["auto"], ["ck", missing_ck, folder, corpus, ""]),
        "--init-from": ([missing_ck], ["gpt2", folder, corpus, ""]),
        "--log-json": (["log.jsonl"], [folder, os.path.join(corpus, "log.jsonl"), ""]),
        "--trace": (["trace.json"], [folder, os.path.join(corpus, "t.json"), ""]),
    }


def make_files(work):
    os.makedirs(os.path.join(work, "folder"), exist_ok=True)
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(200))
    with open(os.path.join(work, "corpus.txt"), "w") as f:
        f.write(text)
    open(os.path.join(work, "empty.txt"), "w").close()
    with open(os.path.join(work, "binary.bin"), "wb") as f:
        f.write(bytes(range(256)) * 40)


def draw_value(rng, action, flag, files, usual_chance):
    """One value for `flag` (an argparse action of train_parser): a usual one with chance
    `usual_chance`, else an edge of its range or a wrong one (a word for a number, a bogus
    choice)."""
    usual = rng.random() < usual_chance
    if flag in files:
        good, bad = files[flag]
        return rng.choice(good if usual else bad)
    if action.choices is not None:
        return str(rng.choice(list(action.choices))) if usual else \
            rng.choice(["bogus", "", "1"])
    pools = SIZES.get(flag) or (INTS if action.type is int else FLOATS
                                if action.type is float else ("x 1", ""))
    if usual:
        return rng.choice(pools[0].split())
    return rng.choice(pools[1].split() + WORDS) if pools[1] else rng.choice(WORDS)


def draw_trial(rng, work):
    """(ranks, flags) of one trial: 1 to 6 flags drawn from the parser's table, in half the
    trials each given a usual value (combinations that may well train), in the other half
    one in four an edge or a wrong one."""
    actions = [a for a in train_parser()._actions if a.option_strings]
    files = paths(work)
    flags, usual_chance = [], rng.choice([1.0, 0.75])
    for action in rng.sample(actions, rng.randint(1, 6)):
        flag = action.option_strings[-1]
        if flag in SKIP:
            continue
        if action.nargs == 0:                       # a switch
            flags.append(flag)
        else:
            flags += [flag, draw_value(rng, action, flag, files, usual_chance)]
    ranks = rng.choice([1, 1, 1, 2, 2, 4])
    return ranks, flags


def run_trial(ranks, flags, work, limit):
    """Run one trial in `work`; {rc, seconds, violations, tail}."""
    cmd = ([mpiexec(), "-n", str(ranks)] if ranks > 1 else []) + [
        sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), *BASE,
        *(["--comm-timeout", "60"] if ranks > 1 else []),
        "--data", os.path.join(work, "corpus.txt"), "--cache-dir",
        os.path.join(work, "cache"), "--device", "cpu", *flags]
    t = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=mpi_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    bad = []
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        bad.append(f"hang: still running after {limit} s")
    rc = proc.returncode
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if not bad and rc in (2, 3):       # 3: a run whose loss diverged (--weight-decay 1e30)
        if len(errors) != 1:
            bad.append(f"exit {rc} with {len(errors)} error: lines")
        if "Traceback" in err:
            bad.append(f"exit {rc} with a traceback")
        if rc == 3 and errors and "training diverged" not in errors[0]:
            bad.append("exit 3, not a diverged run's")
    elif not bad and rc != 0:
        bad.append(f"exit {rc}" + (" with a traceback" if "Traceback" in err else ""))
    return {"rc": rc, "seconds": round(time.monotonic() - t, 1), "violations": bad,
            "error": errors[0][:300] if len(errors) == 1 else None,
            "tail": lines[-12:] if bad else [], "stdout_tail": out.splitlines()[-3:] if bad
            else []}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--first", type=int, default=0, help="the first trial's number")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--limit", type=float, default=180.0, help="seconds a trial may run")
    p.add_argument("--work", default="/tmp/minidist_fuzz")
    p.add_argument("--json", help="write the trials' records here")
    args = p.parse_args()
    records = []
    for trial in range(args.first, args.first + args.trials):
        work = os.path.join(args.work, f"t{trial}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        make_files(work)
        rng = random.Random(f"{args.seed}-{trial}")
        ranks, flags = draw_trial(rng, work)
        rec = {"trial": trial, "seed": args.seed, "ranks": ranks, "flags": flags,
               **run_trial(ranks, flags, work, args.limit)}
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if not rec["violations"]:
            shutil.rmtree(work, ignore_errors=True)
    broken = [r for r in records if r["violations"]]
    ran = sum(r["rc"] == 0 for r in records)
    print(f"{len(records)} trials: {ran} trained, "
          f"{sum(r['rc'] == 3 and not r['violations'] for r in records)} diverged, "
          f"{sum(r['rc'] == 2 and not r['violations'] for r in records)} refused in one line, "
          f"{len(broken)} broke the rules", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
