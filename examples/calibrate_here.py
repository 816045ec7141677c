"""Measure this machine for the step-time model; writes examples/calibration_here.json, the
`--preset here` of examples/plan.py.

    python examples/calibrate_here.py                 # a few minutes when the machine is quiet
    python examples/calibrate_here.py --ranks 2,4 --out /tmp/cal.json

1. Collectives: examples/bench_collectives.py (ring all_reduce, reduce_scatter, all_gather,
   16 KiB to 16 MiB) at each rank count, and a least-squares fit of minidist/train/cost.py's
   ring_time, t = alpha x steps + moved bytes / bw + reduced bytes x gamma. Each rank count
   gets its own fit: ranks beyond the cores (4 on 2) slow every message too.
2. Overlap: bench_collectives.py --overlap --compute matmul at 2 ranks, its "hidden_thread"
   (how much of an async all-reduce hides behind CPU compute: little, with no idle core).
3. Compute: examples/bench_step.py on one process, one thread, the validation model of
   examples/bench_plan.py: peak = its fastest float32 matmul's GFLOP/s ("matmul_gflops_max"),
   efficiency = the model's FLOP rate in its fastest step (cost.py's count, the optimizer's
   time taken out) / peak: best-of over best-of, as other jobs on the machine only ever slow
   a step or a matmul down (a median matmul under load made the efficiency read high). The
   same at widths 64, 128 and 256 ("efficiency_by_width"): plan.py --preset here uses the
   one for the planned model's width (interpolated; narrow models reach less of the peak).
4. Optimizer: seconds per parameter of grad-norm clipping + AdamW (what train_gpt.py runs),
   timed here on that model.
5. Elementwise work TP repeats without SP (cluster.py's Elementwise): forward and backward of a
   block's two layer norms, two bias adds and two residual adds, of the embedding's token +
   position add, and of ln_f, through minidist's autograd on the validation model's (16, 128,
   256) float32 activation, one process, one thread; best of 10, seconds per activation byte.
6. Sync: bench_collectives.py --interleave (compute, then a blocking all-reduce, as TP runs
   them) at each rank count, at 32 KiB, 256 KiB and 2 MiB, 15 repeats each; the median of the
   three sizes' sync_median_s (each the median of its repeats' differences), >= 0.
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from minidist import backend                                          # noqa: E402
from minidist.autograd import Tensor                                  # noqa: E402
from minidist.autograd import fused as F                              # noqa: E402
from minidist.nn import GPT, GPTConfig                                # noqa: E402
from minidist.optim import AdamW, clip_grad_norm                      # noqa: E402
from minidist.train.cost import forward_flops                         # noqa: E402
from minidist.train.args import example_parser  # noqa: E402
from minidist.train.cli import UsageError, check_out_file  # noqa: E402

MODEL = dict(n_layer=4, n_head=4, n_embd=256, block_size=128)          # bench_plan.py's
BATCH = 16
WIDTHS = (64, 128, 256)      # the efficiency by model width (n_head 4, the rest MODEL's)
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def run(cmd, ranks=1):
    """stdout of a script under mpiexec (ranks > 1) or this interpreter, 1 BLAS thread."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=ROOT)
    if ranks > 1:
        here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        cmd = [here if os.path.exists(here) else "mpiexec", "-n", str(ranks)] + cmd
    return subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True,
                          timeout=900).stdout


def fit_link(rows):
    """alpha, bw, gamma of the ring from bench_collectives rows (one rank count)."""
    a, t = [], []
    for r in rows:
        p, n = r["ranks"], r["bytes"]
        phases = 2 if r["op"] == "all_reduce" else 1
        reduced = 0 if r["op"] == "all_gather" else (p - 1) / p * n
        a.append([phases * (p - 1), phases * (p - 1) / p * n, reduced])
        t.append(r["time_s"])
    a, t = np.array(a), np.array(t)
    alpha, inv_bw, gamma = nonnegative_fit(a / t[:, None], np.ones(len(t)))  # relative error
    err = np.abs(a @ np.array([alpha, inv_bw, gamma]) / t - 1)
    return {"alpha": alpha, "bw": 1 / inv_bw, "gamma": gamma, "points": len(t),
            "max_rel_err": float(err.max()), "median_rel_err": float(np.median(err))}


def nonnegative_fit(a, y):
    """argmin |a x - y| over x >= 0, for a few columns: least squares on every subset of the
    columns, the best whose coefficients are all >= 0 (the others stay 0)."""
    best, cols = (np.inf, np.zeros(a.shape[1])), range(a.shape[1])
    for mask in range(1, 2 ** a.shape[1]):
        use = [c for c in cols if mask >> c & 1]
        x, *_ = np.linalg.lstsq(a[:, use], y, rcond=None)
        if (x >= 0).all():
            full = np.zeros(a.shape[1])
            full[use] = x
            best = min(best, (float(np.sum((a @ full - y) ** 2)), full), key=lambda b: b[0])
    return best[1]


def collectives(ranks):
    out = run([sys.executable, "examples/bench_collectives.py", "--algos", "ring", "--ops",
               ",".join(OPS), "--min-bytes", "16K", "--max-bytes", "16M", "--factor", "4",
               "--repeats", "5"], ranks)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def optimizer_seconds_per_param(config, repeats=5):
    backend.setup(threads=1, device="cpu")
    model = GPT(config)
    params = list(model.named_parameters())
    for _, p in params:
        p.grad = np.full_like(p.data, 1e-3)
    opt = AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        clip_grad_norm([p for _, p in params], 1.0)
        opt.step()
        times.append(time.perf_counter() - t)
    return min(times[1:]) / model.num_parameters()


def timed_graph(build, shape, repeats=10):
    """(forward, backward) best seconds of the graph build(x) on a random x of `shape`."""
    x0 = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    fwd, bwd = [], []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        y = build(Tensor(x0, requires_grad=True))
        t1 = time.perf_counter()
        y.backward(np.ones_like(x0))
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return min(fwd[2:]), min(bwd[2:])


def elementwise(config):
    """Seconds per activation byte of the elementwise work a TP rank repeats without SP
    (forward, backward): a block's, the embedding add's, ln_f's (the module docstring, 5)."""
    backend.setup(threads=1, device="cpu")
    T, C = config.block_size, config.n_embd
    vec = [Tensor(np.ones(C, np.float32), requires_grad=True) for _ in range(6)]
    pos = Tensor(np.zeros((T, C), np.float32), requires_grad=True)

    def block(x):                  # x + (ln_1(x) + b), then the same with ln_2: the TP
        w1, b1, w2, b2, c1, c2 = vec          # rank's own work, without the split matmuls
        x = x + (F.layer_norm(x, w1, b1) + c1)
        return x + (F.layer_norm(x, w2, b2) + c2)
    graphs = {"layer": block, "embed": lambda x: x + pos,
              "head": lambda x: F.layer_norm(x, vec[0], vec[1])}
    nbytes = BATCH * T * C * 4
    out = {}
    for name, build in graphs.items():
        f, b = timed_graph(build, (BATCH, T, C))
        out[f"{name}_f"], out[f"{name}_b"] = f / nbytes, b / nbytes
    return out


def sync(ranks, sizes=("32K", "256K", "2M")):
    """bench_collectives.py --interleave rows at `ranks` and the median of their
    sync_median_s (>= 0)."""
    rows = [json.loads(run([sys.executable, "examples/bench_collectives.py", "--interleave",
                            "--max-bytes", size, "--repeats", "15"], ranks).splitlines()[-1])
            for size in sizes]
    median = float(np.median([r["sync_median_s"] for r in rows]))
    return {"sync_s": max(0.0, median), "rows": rows}


def step_efficiency(config, opt_s):
    """(efficiency, matmul peak FLOP/s, bench_step's row) of one bench_step.py run of
    `config` (batch BATCH, one thread): its fastest step, the optimizer's time taken out,
    over its fastest matmul."""
    shape = dict(n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                 block_size=config.block_size)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    out = run([sys.executable, "examples/bench_step.py", *flags, "--vocab-size",
               str(config.vocab_size), "--batch-size", str(BATCH), "--threads", "1",
               "--adamw", "per-param", "--steps", "10", "--attention", "materialized"])
    row = json.loads(out.strip().splitlines()[-1])
    n = GPT(config).num_parameters()
    step = row["ms_min"] / 1e3 - opt_s * n         # the fastest step: others only slow it
    peak = row["matmul_gflops_max"] * 1e9           # and the fastest matmul, likewise
    return 3 * forward_flops(config, BATCH, config.block_size) / step / peak, peak, row


def compute(config, opt_s):
    """The peak and efficiency of the validation model (`config`), and the efficiency at
    each of WIDTHS (the same model narrower or wider: Python's per-op time does not shrink
    with the matmuls, so a narrow model reaches less of the peak; first-use walk 32: 0.39
    at 128 against 0.53 at 256), which plan.py interpolates for the width it plans
    (cluster.efficiency_for_width)."""
    efficiency, peak, row = step_efficiency(config, opt_s)
    by_width = {str(config.n_embd): efficiency}
    for width in WIDTHS:
        if width != config.n_embd:
            by_width[str(width)] = step_efficiency(replace(config, n_embd=width), opt_s)[0]
    return {"peak_tflops": peak / 1e12, "efficiency": efficiency,
            "efficiency_by_width": dict(sorted(by_width.items(), key=lambda kv: int(kv[0]))),
            "bench_step": row}


def rank_counts(text):
    """--ranks: rank counts, comma-separated."""
    return [int(x) for x in text.split(",")]


def main():
    p = example_parser(__doc__)
    p.add_argument("--ranks", default="2,4", type=rank_counts,
                   help="rank counts to measure the collectives at, comma-separated")
    p.add_argument("--out", default=os.path.join(ROOT, "examples", "calibration_here.json"),
                   help="the JSON file to write")
    args = p.parse_args()
    if min(args.ranks) < 2:         # (bench_collectives.py refuses one rank: no collective)
        p.error(f"--ranks {','.join(map(str, args.ranks))}: the collectives need 2 ranks or "
                "more at each count")
    try:                            # before the minute of measuring, not after it
        check_out_file("--out", args.out)
    except UsageError as e:
        p.error(str(e))
    config = GPTConfig(**MODEL, vocab_size=256)
    cal = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_before": os.getloadavg()[0], "cores": os.cpu_count(),
           "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
           / os.cpu_count()}
    cal["links"] = {str(r): fit_link(collectives(r)) for r in args.ranks}
    lap = json.loads(run([sys.executable, "examples/bench_collectives.py", "--overlap",
                          "--compute", "matmul", "--max-bytes", "16M"], 2).splitlines()[-1])
    cal["overlap"] = min(1.0, max(0.0, lap["hidden_thread"]))
    cal["sync"] = {str(r): sync(r) for r in args.ranks}
    cal["opt_s_per_param"] = optimizer_seconds_per_param(config)
    cal["replicated"] = elementwise(config)
    cal.update(compute(config, cal["opt_s_per_param"]))
    cal["load_after"] = os.getloadavg()[0]
    with open(args.out, "w") as f:
        json.dump(cal, f, indent=1)
    print(json.dumps(cal))


if __name__ == "__main__":
    main()
