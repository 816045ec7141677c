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
"""
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import time
from minidist.train.args import example_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def peaks(model, layout, extra, cache):
    """Each rank's peak RssAnon (KB) of one 4-rank run."""
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = ["mpiexec", "-n", "4", sys.executable, __file__, "--measure", out_dir,
               os.path.join(ROOT, "examples", "train_gpt.py"), *model, *layout, *extra,
               "--cache-dir", cache]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
        return [json.load(open(os.path.join(out_dir, n)))["peak_anon_kb"]
                for n in sorted(os.listdir(out_dir))]


def main():
    if len(sys.argv) > 3 and sys.argv[1] == "--measure":
        return measure(sys.argv[2], sys.argv[3], sys.argv[4:])
    p = example_parser(__doc__)
    p.add_argument("--n-layer", default="8", help="transformer blocks (ep: half as many)")
    p.add_argument("--n-embd", default="512", help="embedding width (ep: half as wide)")
    p.add_argument("--n-head", default="8", help="attention heads")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), action="append",
                   help="which checkpoints to resume (default: all)")
    cli = p.parse_args()
    run = ["--block-size", "64", "--batch-size", "8", "--sample", "0", "--eval-every", "0",
           "--eval-iters", "1", "--log-every", "1"]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        cache = os.path.join(work, "cache")
        for name in cli.scenario or list(SCENARIOS):
            div, moe, saved_as, layouts = SCENARIOS[name]
            model = ["--n-layer", str(max(1, int(cli.n_layer) // div)),
                     "--n-embd", str(int(cli.n_embd) // div), "--n-head", cli.n_head,
                     *moe, *run]
            ck = os.path.join(work, name)
            subprocess.run(["mpiexec", "-n", "4", sys.executable,
                            os.path.join(ROOT, "examples", "train_gpt.py"), *model,
                            *saved_as.split(), "--steps", "1", "--save", ck,
                            "--cache-dir", cache], check=True, capture_output=True,
                           timeout=600)
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
