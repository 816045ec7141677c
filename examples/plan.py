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
gathers in minidist/train/muon_cost.py); memory: minidist/train/planner.py
(examples/plan_memory.py is its memory-only table); the search: minidist/train/search.py.
--preset h100 is H100 SXM nodes (8 GPUs, NVLink, a 400 Gb/s InfiniBand NIC per GPU);
--preset here is this machine as examples/calibrate_here.py measured it
(examples/calibration_here.json). Every cluster figure can be overridden (--gpu-mem,
--peak-tflops, --efficiency, --intra-bw, --sync-us, ...).
A --layout train_gpt.py would refuse (its own checks: search.layout_problems), a --gpus with
no valid layout or that does not fill whole nodes (12 on nodes of 8: plan_args.nodes_problem),
or a --params below the smallest shape is one `error:` line, exit 2; "nothing fits" (valid
layouts, none in memory) says the least memory one needs.
"""
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minidist.train.cluster import H100_IB, cluster_from_calibration, with_links  # noqa: E402
from minidist.train.plan_args import (add_model_args, config_from_args,  # noqa: E402
                                      model_text, muon_problem, nodes_problem,
                                      number_problem)
from minidist.train.planner import (GiB, Layout, layout_from_name,  # noqa: E402
                                    stage_params)
from minidist.train.search import (CP_ATTENTIONS, evaluate, layout_problems,  # noqa: E402
                                   fastest_first, micro_batch_counts, no_layout_problem,
                                   search, train_flags)
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
    p.add_argument("--peak-tflops", type=float, help="dense peak of one GPU (16-bit)")
    p.add_argument("--efficiency", type=float, help="fraction of peak the compute reaches")
    for link in ("intra", "inter"):
        p.add_argument(f"--{link}-bw", type=float, help=f"{link}-node GB/s per GPU")
        p.add_argument(f"--{link}-lat", type=float, help=f"{link}-node latency, us")
    p.add_argument("--sync-us", type=float,
                   help="wait per blocking TP/CP collective, us (the ranks' arrival)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="the pipeline schedule priced")
    p.add_argument("--chunks", "--pp-virtual", dest="chunks", type=int, default=2,
                   help="model chunks per stage, with --schedule interleaved (train_gpt.py's "
                   "--pp-virtual)")
    p.add_argument("--comm", choices=("ring", "hier"), default="ring",
                   help="data-parallel all-reduce: flat ring or hierarchical")
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


def make_cluster(args):
    if args.preset == "here":
        if not os.path.exists(HERE):
            fail(f"--preset here needs {HERE}: run examples/calibrate_here.py first")
        base = cluster_from_calibration(HERE, args.gpus)
    else:
        base = H100_IB
    us = 1e-6

    def link(name):
        lat, bw = getattr(args, f"{name}_lat"), getattr(args, f"{name}_bw")
        return (lat and lat * us, bw and bw * 1e9) if (lat or bw) else None
    return with_links(base, link("intra"), link("inter"), gpus_per_node=args.gpus_per_node,
                      mem_gib=args.gpu_mem, peak_tflops=args.peak_tflops,
                      peak_tflops_fp32=args.peak_tflops, efficiency=args.efficiency,
                      sync_s=args.sync_us and args.sync_us * us)


LAYOUT_KEYS = ("dp", "tp", "pp", "cp", "zero", "ep", "micro", "shard")


def parse_layout(text, args, config, v):
    """--layout -> (Layout, the micro-batch counts to price): key=value items
    (`layout_fields`: micro=M one count; without micro=, every count the search tries) or a
    name as the tables print it (`named_fields`: every count the search tries). A layout
    examples/train_gpt.py would not run (search.layout_problems: training's own checks) is
    one error line."""
    named = NAMED.match(text.strip())
    fields, micro = named_fields(text, args) if named else layout_fields(text)
    sp = fields.pop("sp", True)
    fields.pop("amp", None)                  # the flags' (named_fields checked the name's)
    fields.pop("tiled", None)
    if args.attention == "recompute":        # train_gpt's: the scores always recomputed
        fields.setdefault("recompute", "selective")
    fields.pop("grad32", None)               # the flag's (named_fields checked the name's)
    layout = Layout(amp=not args.fp32, sp=sp and fields.get("tp", 1) > 1,
                    tiled=args.attention == "tiled", muon=args.optimizer == "muon",
                    grad32=args.grad_dtype == "float32", **fields)
    counts = micro_batch_counts(layout.pp, args.global_batch // layout.dp, grouped=v > 1) \
        if micro is None else [micro]
    problems = layout_problems(config, layout, args.gpus, args.global_batch, counts[0],
                               args.schedule, v) if counts else \
        [f"a global batch of {args.global_batch} over dp {layout.dp} leaves no micro-batch "
         f"count for {layout.pp} stages"]
    if problems:
        fail("--layout: " + "; ".join(problems) + " (change the layout, or leave --layout "
             "out to search the ones train_gpt.py runs)")
    return layout, counts


NAMED = re.compile(r"(TP|PP|CP|EP)\d|ZeRO-|DDP", re.IGNORECASE)  # (key=value: tp=, zero=)


def named_fields(text, args):
    """A layout's name as plan.py's and plan_memory.py's tables print it -> (its fields,
    None: the search's micro-batch counts). Its precision and attention must be the
    flags': the name says "fp32" with --fp32 alone, "tiled" with --attention tiled alone."""
    fields = layout_from_name(text, args.gpus)
    if isinstance(fields, str):
        fail(f"--layout: {fields}")
    amp = fields.get("amp", not args.fp32)
    tiled = fields.get("tiled", args.attention == "tiled")
    if amp == args.fp32:
        fail(f"--layout {text!r}: names a " + ("mixed-precision layout: drop --fp32" if amp
                                                  else "float32 layout: add --fp32"))
    if fields.get("grad32", False) != (args.grad_dtype == "float32"):
        fail(f"--layout {text!r}: " + ("names float32 gradients: give --grad-dtype float32"
                                       if fields.get("grad32") else
                                       "has no 'fp32 grads': leave --grad-dtype out, or write "
                                       "the name with 'fp32 grads'"))
    if tiled != (args.attention == "tiled"):
        fail(f"--layout {text!r}: " + (
            "names tiled attention: give --attention tiled" if tiled else
            "has no 'tiled': it names materialized attention, as plan_memory.py prices it; "
            "give --attention materialized, or write the name with 'tiled'"))
    if args.attention == "recompute" and fields.get("recompute", "none") == "none":
        fail(f"--layout {text!r}: names attention that keeps its scores; give --attention "
             "materialized, or write the name with 'selective recompute'")
    return fields, None


def layout_fields(text):
    """"dp=8,tp=8,zero=1,micro=4,ckpt" -> (fields, micro-batches, None where not given);
    "nosp": TP without
    sequence parallelism; "ep=2": expert parallelism; "cpattn=ulysses": Ulysses' all-to-alls
    instead of the ring (cp > 1); "shard=8": hybrid sharding, ZeRO over each 8 dp ranks. An
    unknown or repeated key, a value that is not a whole number (cpattn: not ring or
    ulysses) are one error line naming the key."""
    fields, micro, seen = {}, None, set()      # micro None: the search's counts
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if key in seen:
            fail(f"--layout: {key} is given twice; give each key once")
        seen.add(key)
        if item in ("ckpt", "selective") and "recompute" in fields:
            fail("--layout: ckpt and selective: give one recompute (ckpt: full; selective: "
                 "the attention's scores)")
        if item == "ckpt":
            fields["recompute"] = "full"
        elif item == "selective":         # (search.layout_problems: where no scores are kept)
            fields["recompute"] = "selective"
        elif item == "nosp":
            fields["sp"] = False
        elif item == "ogather":
            fields["overlap_gather"] = True
        elif key == "cpattn" and eq:
            if value not in CP_ATTENTIONS:
                fail(f"--layout: {item}: cpattn is " + " or ".join(CP_ATTENTIONS))
            fields["cp_attention"] = value
        elif key in LAYOUT_KEYS and eq:
            if not (value.isascii() and value.isdecimal()):     # -1, abc, 2.5, ""
                fail(f"--layout: {item}: {key} takes a whole number ("
                     + ("0 to 3" if key == "zero" else "1 or more") + ")")
            if key == "micro":
                micro = int(value)
            else:
                fields["zero_shard" if key == "shard" else key] = int(value)
        else:
            fail(f"--layout: cannot read {item!r}; use dp=,tp=,pp=,cp=,zero=,ep=,micro=,"
                 f"shard=,cpattn=,ckpt,selective,nosp,ogather, or a name as the table "
                 f"prints it")
    return fields, micro


def cell(x, width, digits=3):
    """`x` right-aligned in `width` after a space; past 1000, 4 significant digits, so that
    a long step (a 7B model on this CPU: 143713.907 s) never runs into the next column."""
    text = f"{x:.{digits}f}" if abs(x) < 1000 or digits == 0 else f"{x:.4g}"
    return " " + text.rjust(width - 1)


def print_table(rows, top):
    w = max([40] + [len(r["layout"]) + 2 for r in rows[:top]])
    print(f"{'layout':<{w}}{'mb':>4}{'GiB':>7}{'step s':>9}{'tok/s':>11}{'MFU':>6}"
          f"{'comp':>8}{'tp/cp':>8}{'ep a2a':>8}{'bubble':>8}{'dp exp':>8}{'optim':>8}"
          "  fits")
    for r in rows[:top]:
        print(f"{r['layout']:<{w}}{r['micro_batches']:>4}"
              + cell(r["mem"]["total"] / GiB, 7, 1) + cell(r["step"], 9)
              + cell(r["tokens_per_s"], 11, 0) + cell(r["mfu"], 6, 2)
              + "".join(cell(r[k], 8) for k in ("compute", "tp_cp", "ep_all_to_all",
                                                "bubble", "dp_exposed"))
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


def here_load_note(preset, load=None):
    """With --preset here, a sentence when the machine is busier now than when it was
    calibrated (a 1-minute load average over half its cores above the calibration's):
    steps measured now take longer than the plan says. None otherwise. `load`: the 1-minute
    load average (launcher.load_average() when None)."""
    if preset != "here":
        return None
    with open(HERE) as f:
        cal = json.load(f)
    load = load_average() if load is None else load
    if load is None:
        return None
    if load <= cal.get("load_before", 0.0) + cal["cores"] / 2:
        return None
    return (f"the load average is {load:.1f} now, {cal.get('load_before', 0.0):.2f} when "
            f"{HERE_NAME} was measured ({cal.get('date', 'its date unknown')}): steps run "
            f"here now take longer than planned (python examples/calibrate_here.py measures "
            f"again)")


def command(config, row, gpus, v):
    """The train_gpt command that runs `row`."""
    return (f"mpirun -n {gpus} python examples/train_gpt.py "
            + " ".join(train_flags(config, row, v)))


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
    config = make_config(args)
    cluster = make_cluster(args)
    problem = nodes_problem(args.gpus, cluster.gpus_per_node)   # the preset's when not given
    if problem:
        fail(problem)
    schedule = args.schedule
    v = args.chunks if schedule == "interleaved" else 1
    if args.layout:
        layout, counts = parse_layout(args.layout, args, config, v)
        try:
            rows = fastest_first([evaluate(config, layout, cluster, args.seq,
                                           args.global_batch, m, schedule, args.comm,
                                           args.headroom, v, args.moe_load,
                                           args.muon_ns_steps) for m in counts])
        except ValueError as e:                # a MoE layout minidist does not run
            fail(f"--layout: {e}")
    else:
        rows = search(config, cluster, args.gpus, args.seq, args.global_batch, schedule,
                      args.comm, amp=not args.fp32, tiled=args.attention == "tiled",
                      recomputes=("selective", "full") if args.attention == "recompute"
                      else None, headroom=args.headroom, v=v, moe_load=args.moe_load,
                      muon=args.optimizer == "muon", ns_steps=args.muon_ns_steps,
                      grad32=args.grad_dtype == "float32")
        if not rows:                           # no valid layout (not: none fits)
            fail(no_layout_problem(config, args.gpus, cluster.gpus_per_node, args.seq,
                                   args.global_batch, v)
                 or f"--gpus {args.gpus}: the search found no layout")
    best = next((r for r in rows if r["fits"]), None)
    n_params = sum(stage_params(config))
    result = {"config": config.to_dict(), "params": n_params, "cluster": cluster.name,
              "gpus": args.gpus, "seq": args.seq, "global_batch": args.global_batch,
              "optimizer": args.optimizer,
              "rows": rows[:args.top], "best": best and best["layout"],
              "command": best and command(config, best, args.gpus, v),
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
    busy = here_load_note(args.preset)
    if busy:
        print(f"note: {busy}")
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
