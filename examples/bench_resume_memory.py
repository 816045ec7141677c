"""Host memory of resuming a checkpoint in another layout: each rank's peak anonymous memory
(RssAnon, sampled every 5 ms: what the process allocated, not the checkpoint's file pages it
mapped) while examples/train_gpt.py resumes a sharded checkpoint and takes a step, against
the same run started fresh. One JSON line per layout, then a summary line.

    python examples/bench_resume_memory.py                       # every scenario below
    python examples/bench_resume_memory.py --n-layer 8 --n-embd 512 --scenario tp

Each scenario writes one checkpoint on 4 ranks (`--steps 1 --save`), then runs each layout
twice on 4 ranks, fresh and with --resume: the difference is what the resume costs.
    tp    a dense model saved by --tp 4 --zero 1 (one ZeRO folder per tp rank). With the same
          --tp each rank reads only its own part's shards; with another --tp (or none) every
          rank reads the parts by name and keeps its own tp shard of each array as it is read
          (minidist/tp/state.py TpPiece); a pipeline stage reads only its own parameters
          (checkpoint.load's `only`), so no rank holds every whole array at once.
    ep    a mixture of experts (--moe-experts 16, at half the layers and half the width: 8 x
          the dense model's MLP weights) saved by --zero 1, resumed under --ep: a rank reads
          the dense parameters and its own experts, not the other ranks'.
Every layout's flags are checked as train_gpt.py checks them before the first run: the tp
scenario needs --n-head a multiple of 4 (--tp 4) and --n-layer 4 or more (--pp 4); ep halves
--n-layer and --n-embd, and the half width must split into --n-head heads. A bad one is one
`error:` line, exit status 2; a run that fails anyway ends the benchmark with one `error:`
line carrying the run's own, and its exit status.
"""
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from minidist.train.args import example_parser, train_parser
from minidist.train.cli import UsageError, check_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 4
RUN = ["--block-size", "64", "--batch-size", "8", "--sample", "0", "--eval-every", "0",
       "--eval-iters", "1", "--log-every", "1"]
SCENARIOS = {   # name: (size divisor, MoE flags, the saving layout, the resumed layouts)
    "tp": (1, [], "--tp 4 --zero 1", ["--tp 4 --zero 1", "--tp 2 --zero 1", "--tp 2", "--zero 3",
                                   "--pp 4", "--pp 2 --tp 2", "--pp 2 --dp 2"]),
    "ep": (2, ["--moe-experts", "16"], "--zero 1", ["--ep 4", "--ep 4 --zero 1",
                                                 "--ep 2 --zero 1"]),
}


def rss_anon_kb():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def measure(out_dir, script, args):
    """Run `script` with `args` in this process; write its peak RssAnon (KB) to a file of
    its own in `out_dir` (the ranks' stdout lines would interleave)."""
    peak, done = [rss_anon_kb()], threading.Event()

    def sample():
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss_anon_kb())

    threading.Thread(target=sample, daemon=True).start()
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    done.set()
    with open(os.path.join(out_dir, f"peak-{os.getpid()}.json"), "w") as f:
        json.dump({"peak_anon_kb": max(peak[0], rss_anon_kb())}, f)


def run_job(cmd, timeout=600):
    """Run one mpiexec job (in a session of its own, so a timeout kills every rank). Where
    it fails: its `error:` line (else the last line of its stderr) in our one `error:` line,
    and exit with its status (2 for a timeout), without a traceback of ours."""
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        _, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
        why, rc = f"ran past {timeout} s", 2
    else:
        if not job.returncode:
            return
        lines = [line for line in err.splitlines() if line.strip()]
        said = [line for line in lines if line.startswith("error:")] or lines or ["no output"]
        why, rc = f"exit status {job.returncode}: {said[-1]}", job.returncode
    print(f"error: {' '.join(cmd[4:])} failed ({why})", file=sys.stderr, flush=True)
    sys.exit(rc)


def peaks(model, layout, extra, cache):
    """Each rank's peak RssAnon (KB) of one 4-rank run."""
    with tempfile.TemporaryDirectory() as out_dir:
        run_job(["mpiexec", "-n", str(RANKS), sys.executable, __file__, "--measure", out_dir,
                 os.path.join(ROOT, "examples", "train_gpt.py"), *model, *layout, *extra,
                 "--cache-dir", cache])
        return [json.load(open(os.path.join(out_dir, n)))["peak_anon_kb"]
                for n in sorted(os.listdir(out_dir))]


def model_flags(cli, name):
    """train_gpt.py's model and run flags of scenario `name` (ep: half the layers and width)."""
    div, moe = SCENARIOS[name][:2]
    return ["--n-layer", str(max(1, cli.n_layer // div)), "--n-embd", str(cli.n_embd // div),
            "--n-head", str(cli.n_head), *moe, *RUN]


def check_scenarios(p, cli, names):
    """Every layout of every scenario, checked as train_gpt.py checks it (check_flags, and
    check_layout on 4 ranks) before the first run: a model a layout cannot split is one
    `error:` line (p.error: exit status 2), not a failed run minutes in."""
    # (not at the top: it loads numpy, which a --measure process must leave to train_gpt.py,
    # which sets the BLAS threads first)
    from minidist.train.strategy import check_layout
    for name in names:
        _, _, saved_as, layouts = SCENARIOS[name]
        for layout in dict.fromkeys([saved_as, *layouts]):
            args = train_parser().parse_args([*model_flags(cli, name), *layout.split()])
            try:
                check_flags(args)
                check_layout(args, RANKS)
            except UsageError as e:
                model = "" if SCENARIOS[name][0] == 1 else (     # ep: not the flags given
                    f" (its model: {' '.join(model_flags(cli, name)[:6])})")
                p.error(f"--scenario {name}{model}, its {layout} run: {e}")


def main():
    if len(sys.argv) > 3 and sys.argv[1] == "--measure":
        return measure(sys.argv[2], sys.argv[3], sys.argv[4:])
    p = example_parser(__doc__)
    p.add_argument("--n-layer", type=int, default=8,
                   help="transformer blocks (ep: half as many); tp's --pp 4 needs 4 or more")
    p.add_argument("--n-embd", type=int, default=512,
                   help="embedding width (ep: half as wide); a multiple of --n-head (ep: "
                   "half of it too)")
    p.add_argument("--n-head", type=int, default=8,
                   help="attention heads; the tp scenario (--tp 4) needs a multiple of 4")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), action="append",
                   help="which checkpoints to resume (default: all)")
    cli = p.parse_args()
    names = cli.scenario or list(SCENARIOS)
    check_scenarios(p, cli, names)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        cache = os.path.join(work, "cache")
        for name in names:
            _, _, saved_as, layouts = SCENARIOS[name]
            model = model_flags(cli, name)
            ck = os.path.join(work, name)
            run_job(["mpiexec", "-n", str(RANKS), sys.executable,
                     os.path.join(ROOT, "examples", "train_gpt.py"), *model,
                     *saved_as.split(), "--steps", "1", "--save", ck, "--cache-dir", cache])
            for layout in layouts:
                t0 = time.perf_counter()
                fresh = peaks(model, layout.split(), ["--steps", "1"], cache)
                resumed = peaks(model, layout.split(),
                                ["--steps", "2", "--resume", ck], cache)
                row = {"scenario": name, "from": saved_as, "to": layout,
                       "fresh_peak_anon_mb": round(max(fresh) / 1024, 1),
                       "resumed_peak_anon_mb": round(max(resumed) / 1024, 1),
                       "resume_cost_mb": round((max(resumed) - max(fresh)) / 1024, 1),
                       "seconds": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"summary": "resume cost per rank, MB",
                      "by_layout": {f"{r['from']} -> {r['to']}": r["resume_cost_mb"]
                                    for r in rows}}))


if __name__ == "__main__":
    main()
