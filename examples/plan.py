"""How fast will it train? Step time, tokens/s and MFU of every layout that fits, fastest first.

    python examples/plan.py --params 7e9 --seq 4096 --global-batch 512 --gpus 64
    python examples/plan.py --params 70e9 --seq 4096 --global-batch 1024 --gpus 512 \\
        --schedule interleaved --comm hier --top 5 --json
    python examples/plan.py --params 7e9 --gpus 64 --layout dp=8,tp=8,zero=1,ckpt
    python examples/plan.py --params 7e9 --gpus 64 --layout "PP2 x ZeRO-1/8 x32 (amp, tiled)"
    python examples/plan.py --preset here --n-layer 4 --n-head 4 --n-embd 128 --seq 128 \\
        --vocab-size 256 --global-batch 16 --gpus 2 --layout dp=2 --fp32
    python examples/plan.py --params 7e9 --moe-experts 8 --moe-top-k 2 --gpus 64   # MoE: + ep
    python examples/plan.py --params 7e9 --gpus 64 --seq 32768 --global-batch 64 \\
        --layout dp=4,pp=2,cp=8,zero=1,micro=16,cpattn=ulysses    # Ulysses instead of the ring
    python examples/plan.py --params 1.3e9 --seq 2048 --global-batch 256 --gpus 64 \
        --layout dp=64,zero=3,shard=8       # hybrid sharding: ZeRO-3 inside each node
    python examples/plan.py --params 7e9 --seq 4096 --gpus 64 --optimizer muon
    python examples/plan.py --params 7e9 --seq 4096 --gpus 64 --grad-dtype float32

The model: minidist/train/cost.py (compute, the elementwise work TP repeats without SP, the
sync of blocking collectives, alpha-beta collectives on the links each group spans, overlap,
the bubble; a Mixture of Experts' router, experts and expert parallelism's all-to-alls in
minidist/train/moe_cost.py; --optimizer muon's Newton-Schulz, at the float32 rate, and its
gathers in minidist/train/muon_cost.py); memory: minidist/train/run_bill.py step_bill, the
start-up memory check's bill of the row's run (examples/plan_memory.py is its memory-only
table); the search: minidist/train/search.py.
--preset h100 is H100 SXM nodes (8 GPUs, NVLink, a 400 Gb/s InfiniBand NIC per GPU);
--preset here is this machine as examples/calibrate_here.py measured it
(examples/calibration_here.json, or --calibration FILE), its efficiency the one measured for
the model's width. Every cluster figure can be overridden (--gpu-mem, --peak-tflops (16-bit),
--peak-tflops-fp32, --efficiency, --overlap, --intra-bw, --sync-us, ...), and every plan
prints what it assumed (an `assumed:` line; "assumed" in --json).
A --layout train_gpt.py would refuse (its own checks: search.layout_problems), a --gpus with
no valid layout or that does not fill whole nodes (12 on nodes of 8: plan_args.nodes_problem),
or a --params below the smallest shape is one `error:` line, exit 2; "nothing fits" (valid
layouts, none in memory) says the least memory one needs.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minidist.train.cluster import (H100_IB, assumptions, assumptions_text,  # noqa: E402
                                    cluster_from_calibration, with_links)
from minidist.train.plan_args import (add_model_args, config_from_args,  # noqa: E402
                                      model_text, muon_problem, nodes_problem,
                                      number_problem)
from minidist.train.plan_layout import LayoutError, parse_layout  # noqa: E402
from minidist.train.planner import GiB, stage_params  # noqa: E402
from minidist.train.search import (BUCKET_MB, TRAIN_BUCKET_MB, evaluate,  # noqa: E402
                                   fastest_first, no_layout_problem, search, train_flags)
from minidist.train.args import example_parser  # noqa: E402
from minidist.train.cli import check_one_process, run_main  # noqa: E402
from minidist.launcher import load_average  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration_here.json")
HERE_NAME = "examples/calibration_here.json"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def parse(argv=None):
    p = example_parser(__doc__)
    g = add_model_args(p)
    g.add_argument("--moe-load", type=float, default=1.0, metavar="L",
                   help="expert rows of the busiest rank over a balanced routing's (1; "
                        "< 1: tokens dropped; > 1: an unbalanced routing under ep; capped "
                        "where its experts are full)")
    p.add_argument("--global-batch", "--batch-size", type=int, default=512,
                   help="sequences per step (train_gpt.py's --batch-size)")
    p.add_argument("--preset", choices=("h100", "here"), default="h100",
                   help="the cluster: H100 SXM nodes, or this machine as measured")
    p.add_argument("--gpus", type=int, default=64, help="ranks in the job")
    p.add_argument("--gpus-per-node", type=int, help="default: the preset's (h100: 8)")
    p.add_argument("--gpu-mem", type=float, help="GiB per GPU (--preset here: per rank; "
                   "default: the node's memory over the ranks, which share it)")
    p.add_argument("--calibration", metavar="FILE",
                   help="with --preset here: the file examples/calibrate_here.py --out wrote "
                   f"(default: {HERE_NAME})")
    p.add_argument("--peak-tflops", type=float,
                   help="dense 16-bit peak of one GPU, the --amp rate (h100: 989; here: the "
                   "measured float32 rate of one core)")
    p.add_argument("--peak-tflops-fp32", type=float,
                   help="dense float32 peak of one GPU: --fp32 and Muon's Newton-Schulz "
                   "(h100: 67; here: the same as --peak-tflops)")
    p.add_argument("--efficiency", type=float, help="fraction of peak the compute reaches "
                   "(h100: 0.45, assumed; here: measured, by model width where the "
                   "calibration has several)")
    p.add_argument("--overlap", type=float, help="fraction of a compute window "
                   "communication can hide in (h100: 1, assumed; here: measured)")
    for link, h100 in (("intra", (450, 3)), ("inter", (50, 5))):
        p.add_argument(f"--{link}-bw", type=float,
                       help=f"{link}-node GB/s per GPU (h100: {h100[0]})")
        p.add_argument(f"--{link}-lat", type=float,
                       help=f"{link}-node latency, us (h100: {h100[1]})")
    p.add_argument("--sync-us", type=float, help="wait per blocking TP/CP collective, us "
                   "(the ranks' arrival; h100: 5, assumed; here: measured)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="the pipeline schedule priced")
    p.add_argument("--chunks", "--pp-virtual", dest="chunks", type=int, default=2,
                   help="model chunks per stage, with --schedule interleaved (train_gpt.py's "
                   "--pp-virtual)")
    p.add_argument("--comm", choices=("ring", "hier"), default="ring",
                   help="data-parallel all-reduce: flat ring or hierarchical")
    p.add_argument("--bucket-mb", type=float, metavar="MB",
                   help="DDP's gradient bucket, MiB, priced and in the command (h100: 25, "
                   "PyTorch DDP's, the usual on GPUs; here: train_gpt.py's 1, as its runs "
                   "were checked; ZeRO reduce-scatters per unit instead)")
    p.add_argument("--attention", choices=("materialized", "tiled", "recompute"),
                   default="tiled",
                   help="attention's memory: (T, T) scores (the search also tries them "
                   "recomputed in backward, selective recompute), tiles, or recompute: "
                   "the scores recomputed always, train_gpt.py's --attention recompute "
                   "(selective recompute, or full)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="train_gpt.py's: muon prices Muon for the blocks' matrices (AdamW the "
                   "rest): its momentum alone as their state, its Newton-Schulz iterations "
                   "(steps x (4 A^2 B + 2 A^3) FLOPs per A x B matrix, A <= B, at the float32 "
                   "rate: it runs on float32 masters) on the whole matrix: under TP one tp "
                   "rank runs a split one's, under ZeRO one owner rank each (and its tp "
                   "peers); and the collectives of the update (over tp, a split matrix's "
                   "gather before and reduce-scatter after; over ZeRO's shard group per "
                   "block, the same of its unit); the command runs it")
    p.add_argument("--muon-ns-steps", type=int, default=5,
                   help="Muon's Newton-Schulz iterations per step (train_gpt.py's flag; "
                   "with --optimizer muon)")
    p.add_argument("--fp32", action="store_true", help="float32 instead of mixed precision "
                   "(always with --preset here: numpy emulates 16-bit compute, slower there)")
    p.add_argument("--grad-dtype", choices=("float32",), default=None,
                   help="train_gpt.py's: mixed precision with float32 gradients (4 bytes a "
                   "parameter, in memory and in the data-parallel reductions); the command "
                   "runs it")
    p.add_argument("--layout", help="one layout instead of a search, e.g. "
                   "dp=8,tp=8,pp=1,cp=1,zero=1,micro=1,ckpt (micro: micro-batches, "
                   "--grad-accum without pp; left out: every count the search tries; "
                   "ckpt: full recompute; "
                   "selective: the attention's scores recomputed, with --attention "
                   "materialized; nosp: TP without SP; ep=: "
                   "expert parallelism over ep of the dp ranks, MoE only; cpattn=ring or "
                   "ulysses: the CP attention, with cp > 1; shard=K: hybrid sharding, ZeRO "
                   "over each K dp ranks; ogather: ZeRO-1/2's all-gathers behind the next "
                   "forward, --overlap-param-gather); or a name as the table prints it, "
                   "e.g. \"PP2 x ZeRO-1/8 x32 (amp, tiled)\" (every micro-batch count the "
                   "search tries); refused unless examples/train_gpt.py runs it")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of GPU memory left free (fragmentation, buffers)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return p.parse_args(argv)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def make_config(args):
    """The model: the assumed shape of --params, or the given one; the MoE flags on it."""
    try:
        return config_from_args(args)
    except ValueError as e:                    # GPTConfig's checks (the moe_* fields, ...)
        fail(f"model flags: {e}")


def make_cluster(args, config):
    """The preset (here: from the calibration, its efficiency for the model's width) with
    the flags' changes."""
    if args.calibration is not None and args.preset != "here":
        fail(f"--calibration {args.calibration}: only with --preset here")
    if args.preset == "here":
        path = HERE if args.calibration is None else args.calibration
        if not os.path.exists(path):
            fail(f"--calibration {path}: no such file; run examples/calibrate_here.py "
                 f"--out {path} first" if args.calibration is not None else
                 f"--preset here needs {HERE}: run examples/calibrate_here.py first")
        try:
            base = cluster_from_calibration(path, args.gpus, config.n_embd)
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            fail(f"--calibration {path}: not a calibration examples/calibrate_here.py wrote "
                 f"({type(e).__name__}: {e}); measure again")
    else:
        base = H100_IB
    us = 1e-6

    def link(name):                  # (a latency of 0 is a value: `is None`, not falsy)
        lat, bw = getattr(args, f"{name}_lat"), getattr(args, f"{name}_bw")
        if lat is None and bw is None:
            return None
        return (None if lat is None else lat * us, None if bw is None else bw * 1e9)
    return with_links(base, link("intra"), link("inter"), gpus_per_node=args.gpus_per_node,
                      mem_gib=args.gpu_mem, peak_tflops=args.peak_tflops,
                      peak_tflops_fp32=args.peak_tflops_fp32, efficiency=args.efficiency,
                      overlap=args.overlap,
                      sync_s=None if args.sync_us is None else args.sync_us * us)


def cell(x, width, digits=3):
    """`x` right-aligned in `width` after a space; past 1000, 4 significant digits, so that
    a long step (a 7B model on this CPU: 143713.907 s) never runs into the next column."""
    text = f"{x:.{digits}f}" if abs(x) < 1000 or digits == 0 else f"{x:.4g}"
    return " " + text.rjust(width - 1)


def print_table(rows, top):
    """The first `top` rows; memory in GiB, or in MiB where every row's is under 1 GiB (a
    small model on --preset here was a column of 0.0)."""
    w = max([40] + [len(r["layout"]) + 2 for r in rows[:top]])
    unit, size = ("GiB", GiB) if max(r["mem"]["total"] for r in rows[:top]) >= GiB else \
        ("MiB", 2 ** 20)
    print(f"{'layout':<{w}}{'mb':>4}{unit:>7}{'step s':>9}{'tok/s':>11}{'MFU':>6}"
          f"{'comp':>8}{'tp/cp':>8}{'ep a2a':>8}{'bubble':>8}{'dp exp':>8}{'optim':>8}"
          "  fits")
    for r in rows[:top]:
        print(f"{r['layout']:<{w}}{r['micro_batches']:>4}"
              + cell(r["mem"]["total"] / size, 7, 1) + cell(r["step"], 9)
              + cell(r["tokens_per_s"], 11, 0) + cell(r["mfu"], 6, 2)
              + cell(r["compute"], 8) + cell(r["tp_cp"] + r["tp_sum"], 8)  # SP's sum too
              + "".join(cell(r[k], 8) for k in ("ep_all_to_all", "bubble", "dp_exposed"))
              + cell(r["optimizer"] + r["muon_comm"], 8)     # Muon: its NS and gathers
              + f"  {'yes' if r['fits'] else 'no'}")


def nothing_fits(rows, cluster, headroom, here=False):
    """Why no row fits, as a sentence: the smallest memory any layout needs, and the budget.
    `here` (--preset here): the ranks share one machine's memory, so more of them hold less
    each; the remedy is a smaller model or sequence."""
    least = min(rows, key=lambda r: r["mem"]["total"])
    budget, m = cluster.mem_gib * (1 - headroom), least["micro_batches"]
    which = "the layout" if len(rows) == 1 else "the smallest layout"
    unit, fix = ("rank", "plan a smaller model or --seq (the ranks share this machine's "
                 "memory: more of them hold less each)") if here else \
        ("GPU", "add --gpus or --gpu-mem, or plan a smaller model")
    return (f"{which}, {least['layout']} ({m} micro-batch{'es' if m > 1 else ''}), needs "
            f"{least['mem']['total'] / GiB:.1f} GiB per {unit}, over the {budget:.1f} GiB of "
            f"{cluster.mem_gib:.3g} less --headroom {headroom:g}; {fix}")


def here_load_note(preset, load=None, path=HERE):
    """With --preset here, a sentence when the machine is busier now than when it was
    calibrated (a 1-minute load average over half its cores above the calibration's):
    steps measured now take longer than the plan says. None otherwise. `load`: the 1-minute
    load average (launcher.load_average() when None); `path`: the calibration."""
    if preset != "here":
        return None
    with open(path) as f:
        cal = json.load(f)
    load = load_average() if load is None else load
    if load is None:
        return None
    if load <= cal.get("load_before", 0.0) + cal["cores"] / 2:
        return None
    return (f"the load average is {load:.1f} now, {cal.get('load_before', 0.0):.2f} when "
            f"{os.path.relpath(path)} was measured ({cal.get('date', 'its date unknown')}): "
            f"steps run here now take longer than planned (python examples/calibrate_here.py "
            f"measures again)")


def here_notes(args, cluster):
    """What the plan's figures rest on, where a reader could take them for more: on the
    H100 preset, that nothing here was measured on a GPU; on `here`, how the efficiency was
    chosen for this model's width, a rank count the collectives were not measured at, and
    a machine busier now than at its calibration (here_load_note)."""
    if args.preset != "here":
        return ["the H100 figures are published peaks and assumed efficiency, overlap and "
                "latencies, never measured by minidist on a GPU; the step-time model was "
                "checked against runs on a 2-core CPU only (minidist/train/PLAN.md); MFU is "
                "model FLOPs / (step x peak), the whole attention square counted (tiled "
                "attention computes half of it, so MFU can pass the efficiency a little)"]
    notes = [f"efficiency {cluster.efficiency:.2f}: {cluster.notes['efficiency']} "
             f"({os.path.relpath(cluster.notes['calibration'])})"]
    notes += [cluster.notes["ranks"]] if "ranks" in cluster.notes else []
    busy = here_load_note(args.preset, path=cluster.notes["calibration"])
    return notes + ([busy] if busy else [])


def command(config, row, gpus, v, on_gpus):
    """The train_gpt command that runs `row`; `on_gpus` (a GPU preset): one rank per GPU,
    --device cuda --comm nccl, the collectives GPU to GPU at the links' bandwidth the plan
    priced (minidist's own ring and hier move GPU data through host memory: far slower
    than priced). NCCL picks its own algorithm per call, so a plan priced with --comm hier
    runs NCCL too."""
    flags = train_flags(config, row, v)
    if on_gpus:
        if "--comm" in flags:                      # hier: NCCL's own choice instead
            at = flags.index("--comm")
            del flags[at:at + 2]
        flags = ["--device", "cuda", "--comm", "nccl"] + flags
    return f"mpirun -n {gpus} python examples/train_gpt.py " + " ".join(flags)


def main(argv=None):
    check_one_process("plan.py")
    args = parse(argv)
    args.fp32 = args.fp32 or args.preset == "here"  # numpy emulates 16 bits: slower than 32
    problem = number_problem(args) or muon_problem(args)
    if problem:
        fail(problem)
    if args.grad_dtype and args.fp32:
        fail(f"--grad-dtype {args.grad_dtype}: only with mixed precision, and "
             + ("--preset here plans float32" if args.preset == "here" else "--fp32 is given")
             + " (its gradients are float32 already); leave --grad-dtype out")
    if args.seq % 2:
        fail(f"--seq {args.seq}: must be even")
    if args.moe_load <= 0:
        fail(f"--moe-load {args.moe_load}: the busiest rank's rows over the balanced count "
             f"must be positive")
    if (args.overlap or 0) > 1:
        fail(f"--overlap {args.overlap}: the fraction of a compute window communication "
             "hides in, at most 1")
    config = make_config(args)
    cluster = make_cluster(args, config)
    problem = nodes_problem(args.gpus, cluster.gpus_per_node)   # the preset's when not given
    if problem:
        fail(problem)
    schedule = args.schedule
    v = args.chunks if schedule == "interleaved" else 1
    if args.bucket_mb is None:        # a cluster's usual, or the small runs' of this machine
        args.bucket_mb = TRAIN_BUCKET_MB if args.preset == "here" else BUCKET_MB
    if args.layout:
        try:
            layout, counts = parse_layout(args.layout, args, config, v)
        except LayoutError as e:
            fail(str(e))
        try:
            rows = fastest_first([evaluate(config, layout, cluster, args.seq,
                                           args.global_batch, m, schedule, args.comm,
                                           args.headroom, v, args.moe_load,
                                           args.muon_ns_steps, args.bucket_mb)
                                  for m in counts])
        except ValueError as e:                # a MoE layout minidist does not run
            fail(f"--layout: {e}")
    else:
        rows = search(config, cluster, args.gpus, args.seq, args.global_batch, schedule,
                      args.comm, amp=not args.fp32, tiled=args.attention == "tiled",
                      recomputes=("selective", "full") if args.attention == "recompute"
                      else None, headroom=args.headroom, v=v, moe_load=args.moe_load,
                      muon=args.optimizer == "muon", ns_steps=args.muon_ns_steps,
                      grad32=args.grad_dtype == "float32", bucket_mb=args.bucket_mb)
        if not rows:                           # no valid layout (not: none fits)
            fail(no_layout_problem(config, args.gpus, cluster.gpus_per_node, args.seq,
                                   args.global_batch, v)
                 or f"--gpus {args.gpus}: the search found no layout")
    best = next((r for r in rows if r["fits"]), None)
    n_params = sum(stage_params(config))
    result = {"config": config.to_dict(), "params": n_params, "cluster": cluster.name,
              "gpus": args.gpus, "seq": args.seq, "global_batch": args.global_batch,
              "optimizer": args.optimizer, "assumed": assumptions(cluster),
              "rows": rows[:args.top], "best": best and best["layout"],
              "command": best and command(config, best, args.gpus, v,
                                          on_gpus=args.preset != "here"),
              "nothing_fits": None if best else nothing_fits(rows, cluster, args.headroom,
                                                             args.preset == "here")}
    if args.json:
        print(json.dumps(result))
        return
    c = result["config"]
    muon = (f", Muon ({args.muon_ns_steps} Newton-Schulz steps) for the blocks' matrices"
            if args.optimizer == "muon" else "")
    print(f"model: {model_text(n_params, c)}, seq {args.seq}, global batch "
          f"{args.global_batch}{muon}; {args.gpus} "
          + (f"ranks of {cluster.name}" if args.preset == "here" else f"GPUs of {cluster.name}")
          + f" ({cluster.gpus_per_node} per node, {cluster.mem_gib:.1f} GiB"
          + (" a rank, its share of the node's; float32: numpy has no 16-bit arithmetic, "
             "--amp is slower here)" if args.preset == "here" else ")"))
    print(assumptions_text(cluster, amp=not args.fp32))
    for note in here_notes(args, cluster):
        print(f"note: {note}")
    print_table(rows, args.top)
    print(f"best: {result['best']}" if result["best"] else
          f"best: nothing fits: {result['nothing_fits']}")
    if result["command"]:
        vocab = "" if c["vocab_size"] == 256 else (
            f" (planned with a {c['vocab_size']:,}-token vocabulary: add --data, a folder of "
            "token files in it, as nanoGPT or llm.c write them; without, train_gpt.py trains "
            "256 bytes)")
        print(f"run it{vocab}: {result['command']}")


if __name__ == "__main__":
    run_main(main, None)            # (None: parse reads sys.argv; `| head` ends quietly)
