"""The step-time model against measurements: predicted vs measured ms per step of DDP, ZeRO-3,
TP and PP (and DDP over the hierarchical all-reduce) on 2 and 4 ranks of this machine, and of
a Mixture of Experts (4 experts, top-2) under DDP and expert parallelism (EP2, EP2 x DP2),
and on split sequences (CP2, TP2 with SP, EP2 x CP2).

    python examples/calibrate_here.py          # first: examples/calibration_here.json
    python examples/bench_plan.py --repeats 3  # JSON lines on stdout, a markdown table on stderr
    python examples/bench_plan.py --cases 0,7  # cases by number, from 0: DDP x2 and TP4

Each case is examples/train_gpt.py (float32, materialized attention, the model below, global
batch 16) for --steps steps under mpiexec, --repeats times; of the steps after each run's first
--skip, the case's measurement is the fastest (the machine is shared with other jobs, which
only ever slow a step down; the calibration takes best-of figures likewise), and the median
and slowest are reported beside it, so the noise is shown, not hidden. The prediction is
minidist/train/cost.py's step_time with the calibrated "here" cluster for that rank count
(minidist/train/cluster.py: cluster_from_calibration). Each case's JSON line has its number
("index", the table's # column, what --cases takes), "error" (predicted / fastest - 1) and
"error_median" (predicted / median - 1: the fastest step is what an unloaded machine would
run, the median what a loaded one did). Every flag (and the calibration file) is checked
before the first case runs: a bad one is one `error:` line, exit status 2.

--reference: the other jobs on a shared machine change its speed minute by minute, so just
before each run of a case its N ranks' compute is measured as N independent processes (1
thread each, no communication) training the same model on 1/N of the batch at the same time
(their first and last --skip steps left out: the processes start and end at different moments);
the compute efficiency of the prediction comes from the fastest of these reference steps
(the cores they really got, shared with each other and with the other jobs) instead of the
calibration file's, the elementwise work TP repeats is slowed by the same factor (calibrated
efficiency / reference efficiency, in place of cost.py's ranks-per-core share), and the
collectives keep their calibrated alpha-beta and sync. The row gives the reference's step
time. A MoE case's reference runs the same MoE model (one process holds every expert). A MoE
case also gets a prediction at the routing its runs logged (--log-json's moe_tokens): the
expert rows the busiest rank ran at the case's fastest step, and those of the reference's
processes at theirs, over the balanced count the model assumes (cost.py's moe_load, 1 by
default): the drops and, under ep, the imbalance, measured like the reference's compute.
"""
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from minidist.nn import GPT, GPTConfig                                # noqa: E402
from minidist.train.cluster import cluster_from_calibration           # noqa: E402
from minidist.train.cost import forward_flops, step_time              # noqa: E402
from minidist.train.moe_cost import expert_rows                       # noqa: E402
from minidist.train.planner import Layout                             # noqa: E402
from minidist.train.args import check_at_least, example_parser  # noqa: E402

MODEL = dict(n_layer=4, n_head=4, n_embd=256, block_size=128)          # calibrate_here.py's
BATCH = 16
MOE = ["--moe-experts", "4", "--moe-top-k", "2"]                       # capacity factor 1.25
# (name, ranks, train_gpt.py flags, layout, micro-batches, ranks per simulated node or None)
CASES = [
    ("DDP x2", 2, [], Layout(dp=2, amp=False), 1, None),
    ("ZeRO-3 x2", 2, ["--zero", "3"], Layout(dp=2, zero=3, amp=False), 1, None),
    ("TP2", 2, ["--tp", "2"], Layout(tp=2, amp=False), 1, None),
    ("PP2, 4 micro-batches", 2, ["--pp", "2", "--micro-batches", "4"],
     Layout(pp=2, amp=False), 4, None),
    ("DDP x4", 4, [], Layout(dp=4, amp=False), 1, None),
    ("DDP x4, --comm hier (2 nodes x 2)", 4, ["--comm", "hier"], Layout(dp=4, amp=False), 1, 2),
    ("ZeRO-3 x4", 4, ["--zero", "3"], Layout(dp=4, zero=3, amp=False), 1, None),
    ("TP4", 4, ["--tp", "4"], Layout(tp=4, amp=False), 1, None),
    ("PP4, 4 micro-batches", 4, ["--pp", "4", "--micro-batches", "4"],
     Layout(pp=4, amp=False), 4, None),
    ("TP2 x DDP2", 4, ["--tp", "2"], Layout(dp=2, tp=2, amp=False), 1, None),
    ("MoE DDP x2, 4 experts top-2", 2, MOE, Layout(dp=2, amp=False), 1, None),
    ("EP2, 4 experts top-2", 2, MOE + ["--ep", "2"], Layout(dp=2, ep=2, amp=False), 1, None),
    ("EP2 x DP2, 4 experts top-2", 4, MOE + ["--ep", "2", "--dp", "2"],
     Layout(dp=4, ep=2, amp=False), 1, None),
    # a sequence split over ranks: the routing's exchange (minidist/nn/moe_split.py)
    ("MoE CP2, 4 experts top-2", 2, MOE + ["--cp", "2"], Layout(cp=2, amp=False), 1, None),
    ("MoE TP2+SP, 4 experts top-2", 2, MOE + ["--tp", "2", "--sequence-parallel"],
     Layout(tp=2, sp=True, amp=False), 1, None),
    ("EP2 x CP2, 4 experts top-2", 4, MOE + ["--ep", "2", "--cp", "2"],
     Layout(dp=2, ep=2, cp=2, amp=False), 1, None),
]


def model_flags(flags):
    """The --moe-* flags (and their values) of a case: the model, for its reference too."""
    return [x for i, f in enumerate(flags) if f.startswith("--moe-") for x in flags[i:i + 2]]


def case_config(flags):
    """The case's GPTConfig: MODEL, vocab 256, its MoE flags."""
    pairs = dict(zip(model_flags(flags)[::2], model_flags(flags)[1::2]))
    kinds = {"--moe-experts": int, "--moe-top-k": int, "--moe-capacity-factor": float,
             "--moe-every": int}
    return GPTConfig(**MODEL, vocab_size=256, **{f[2:].replace("-", "_"): kinds[f](v)
                                                 for f, v in pairs.items()})


def train_cmd(steps, log, flags):
    model = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    return [sys.executable, "examples/train_gpt.py", *model, "--attention", "materialized",
            "--steps", str(steps), "--eval-every", "0", "--eval-iters", "1", "--sample", "0",
            "--log-json", log, "--overwrite", *flags]     # (scratch logs, one per case)


def step_rows(log, skip):
    rows = [json.loads(line) for line in open(log)]
    return [r for r in rows if "ms_per_step" in r][skip:]


def step_times(log, skip):
    return [r["ms_per_step"] for r in step_rows(log, skip)]


def routing_load(row, config, b, ep=1, replicas=1):
    """The expert rows the busiest rank ran in a --log-json row, over the balanced count the
    model assumes (b sequences x min(k s, E cap) per MoE block; cost.py's moe_load), from
    moe_tokens: the kept assignments per block and expert, summed over `replicas` alike
    groups (ep groups; or data-parallel ranks without ep). Rank r of an ep group holds
    experts r E/ep .. (r+1) E/ep - 1; each block waits for its busiest rank. 1 for a dense
    model."""
    if "moe_tokens" not in row:
        return 1.0
    blocks = row["moe_tokens"]
    per = len(blocks[0]) // ep
    busiest = sum(max(sum(c[r * per:(r + 1) * per]) for r in range(ep)) for c in blocks)
    return busiest / replicas / (len(blocks) * b * expert_rows(config, MODEL["block_size"]))


def reference(ranks, steps, skip, tmp, model=(), config=None):
    """Fastest step of `ranks` independent 1-thread processes run at once, each on 1/ranks
    of the batch: the compute each rank of a case gets, without its communication. The
    processes start and finish at different moments, so each one's first and last `skip`
    steps are left out: those may run while another is not yet or no longer computing (seen:
    201-278 ms steps at the end of 4-rank references whose other steps took 320-330 ms)."""
    logs = [os.path.join(tmp, f"ref{i}.jsonl") for i in range(ranks)]
    env = dict(os.environ, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1")
    procs = [subprocess.Popen(train_cmd(steps, log, ["--batch-size", str(BATCH // ranks),
                                                     "--threads", "1", *model]),
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL) for log in logs]
    if any(p.wait(timeout=900) for p in procs):
        raise RuntimeError("a reference run failed")
    fastest = [min(step_rows(log, skip)[:-skip or None], key=lambda r: r["ms_per_step"])
               for log in logs]
    return (float(np.median([r["ms_per_step"] for r in fastest])),
            float(np.median([routing_load(r, config, BATCH // ranks) for r in fastest])))


def measure(ranks, flags, steps, skip, per_node, tmp, layout, config):
    """(ms_per_step, routing_load) of one train_gpt.py run's steps after its first `skip`."""
    log = os.path.join(tmp, "log.jsonl")
    cmd = train_cmd(steps, log, ["--batch-size", str(BATCH), *flags])
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [here if os.path.exists(here) else "mpiexec", "-n", str(ranks)] + cmd
    env = dict(os.environ, PYTHONPATH=ROOT)
    if per_node:
        env["MINIDIST_RANKS_PER_NODE"] = str(per_node)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, timeout=900)
    b, groups = BATCH // layout.dp, layout.dp // layout.ep
    return [(r["ms_per_step"], routing_load(r, config, b, layout.ep, groups))
            for r in step_rows(log, skip)]


def reference_efficiency(cluster, ms, ranks, config, load=1.0):
    """Compute efficiency of a rank whose step on 1/ranks of the batch took `ms` (the
    optimizer's time taken out), its MoE blocks at `load` x the balanced rows."""
    seconds = ms / 1e3 - cluster.opt_s_per_param * GPT(config).num_parameters()
    flops = 3 * forward_flops(config, BATCH // ranks, MODEL["block_size"], load=load)
    return flops / seconds / (cluster.peak_tflops * 1e12)


def predict(cal_path, ranks, layout, micro, per_node, comm, config, reference_ms=None,
            moe_load=1.0, reference_load=1.0):
    cluster = cluster_from_calibration(cal_path, ranks)
    if reference_ms:     # the reference shared the cores; its slowdown against the lone
        eff = reference_efficiency(cluster, reference_ms, ranks, config,  # calibration
                                   reference_load)                        # slows
        cluster = replace(cluster, compute_slots=None, efficiency=eff,  # TP's repeated work
                          replicated=cluster.replicated.scaled(cluster.efficiency / eff))
    if per_node:   # simulated nodes: the same measured link inside and across, and each
        slots = cluster.compute_slots and max(1, cluster.compute_slots * per_node // ranks)
        cluster = replace(cluster, gpus_per_node=per_node, inter=cluster.intra,
                          compute_slots=slots)      # a node's share of the cores
    return step_time(config, layout, cluster, MODEL["block_size"], BATCH, micro, "1f1b", comm,
                     bucket_mb=1.0, moe_load=moe_load)


def check_flags(p, args):
    """--steps, --skip, --repeats, --cases and --calibration, before any case runs (a case
    takes minutes): p.error's one `error:` line, exit status 2. Returns the chosen cases'
    numbers."""
    check_at_least(p, args, (("--steps", 1, "steps per run"), ("--skip", 0, "warm-up steps"),
                             ("--repeats", 1, "runs per case")))
    if args.steps <= args.skip:
        p.error(f"--skip {args.skip}: leaves none of --steps {args.steps} to time; give "
                "--steps above --skip")
    if args.reference and args.steps <= 2 * args.skip:
        p.error(f"--steps {args.steps}: --reference leaves out each reference process's "
                f"first and last --skip {args.skip} steps; give --steps above {2 * args.skip}")
    numbers = args.cases.split(",") if args.cases is not None else range(len(CASES))
    for i in numbers:
        if not str(i).isdigit() or int(i) >= len(CASES):
            p.error(f"--cases {args.cases}: {i!r} is not a case number; give numbers from 0 "
                    f"to {len(CASES) - 1}, comma-separated")
    try:
        cluster_from_calibration(args.calibration, 2)
    except OSError as e:
        p.error(f"--calibration {args.calibration}: {e.strerror or e} (python examples/"
                "calibrate_here.py --out FILE writes one)")
    except (ValueError, KeyError, TypeError) as e:
        p.error(f"--calibration {args.calibration}: not a calibration file ({e!r}); "
                "python examples/calibrate_here.py --out FILE writes one")
    return [int(i) for i in numbers]


def run_case(case, args, tmp):
    """One case's JSON row: its runs alternating with the references, the predictions."""
    name, ranks, flags, layout, micro, per_node = case
    comm = "hier" if "hier" in flags else "ring"
    load, config = os.getloadavg()[0], case_config(flags)
    refs, steps = [], []
    for _ in range(args.repeats):     # alternate, so both meet the same conditions
        if args.reference:
            refs.append(reference(ranks, args.steps, args.skip, tmp, model_flags(flags),
                                  config))
        steps += measure(ranks, flags, args.steps, args.skip, per_node, tmp, layout, config)
    (ref, ref_load), ms = (min(refs) if refs else (None, 1.0)), [t for t, _ in steps]
    pred = predict(args.calibration, ranks, layout, micro, per_node, comm, config, ref)
    quiet = predict(args.calibration, ranks, layout, micro, per_node, comm, config)
    row = {"case": name, "ranks": ranks, "reference_ms": ref, "measured_ms": min(ms),
           "median_ms": float(np.median(ms)), "slowest_ms": max(ms),
           "steps": len(ms), "predicted_ms": pred["step"] * 1e3,
           "predicted_from_calibration_ms": quiet["step"] * 1e3,
           "parts_ms": {k: v * 1e3 for k, v in pred.items()
                        if k not in ("step", "tokens_per_s", "mfu")},
           "load_1min": [load, os.getloadavg()[0]]}
    row["error"] = row["predicted_ms"] / row["measured_ms"] - 1
    row["error_median"] = row["predicted_ms"] / row["median_ms"] - 1
    if config.moe_experts:   # at the routing the runs logged: the case's fastest step's
        moe_load = min(steps)[1]                   # busiest rank, the reference's rows
        at = predict(args.calibration, ranks, layout, micro, per_node, comm, config, ref,
                     moe_load, ref_load)
        row.update(moe_load=moe_load, reference_moe_load=ref_load,
                   moe_loads=sorted({round(x, 3) for _, x in steps}),
                   predicted_at_load_ms=at["step"] * 1e3,
                   error_at_load=at["step"] * 1e3 / row["measured_ms"] - 1,
                   error_at_load_median=at["step"] * 1e3 / row["median_ms"] - 1)
    return row


def table(rows):
    """The rows as a markdown table, on stderr (stdout: the JSON lines). # is the case's
    number for --cases; the reference cell is blank without --reference."""
    lines = ["\n| # | case | ranks | measured ms: fastest (median, slowest) | predicted ms | "
             "error vs fastest (vs median) | load | reference ms | from the calibration "
             "alone | at the logged routing |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        at = (f"{r['predicted_at_load_ms']:.0f} ({r['error_at_load']:+.0%}; rows x"
              f"{r['moe_load']:.2f}, reference x{r['reference_moe_load']:.2f})"
              if "moe_load" in r else "")
        ref = "" if r["reference_ms"] is None else f"{r['reference_ms']:.0f}"
        lines.append(
            f"| {r['index']} | {r['case']} | {r['ranks']} | {r['measured_ms']:.0f} "
            f"({r['median_ms']:.0f}, {r['slowest_ms']:.0f}) | {r['predicted_ms']:.0f} | "
            f"{r['error']:+.0%} ({r['error_median']:+.0%}) | {r['load_1min'][0]:.1f} | {ref} | "
            f"{r['predicted_from_calibration_ms']:.0f} | {at} |")
    print("\n".join(lines), file=sys.stderr, flush=True)


def main():
    p = example_parser(__doc__)
    p.add_argument("--calibration", default=os.path.join(ROOT, "examples",
                                                         "calibration_here.json"),
                   help="this machine's figures (examples/calibrate_here.py writes them)")
    p.add_argument("--steps", type=int, default=8, help="steps per run of a case")
    p.add_argument("--skip", type=int, default=2, help="first steps left out (warm-up)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per case (examples/BENCHMARKS.md: how long past runs took)")
    p.add_argument("--cases", default=None,
                   help="comma list of case numbers, counted from 0 (the table's # column; "
                   "default: all): " + "; ".join(f"{i}: {c[0]}" for i, c in enumerate(CASES)))
    p.add_argument("--reference", action="store_true",
                   help="efficiency from a 1-process run just before each case")
    args = p.parse_args()
    chosen = check_flags(p, args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in chosen:
            row = {"index": i, **run_case(CASES[i], args, tmp)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    table(rows)


if __name__ == "__main__":
    main()
