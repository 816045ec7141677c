"""Which strategy do I need? The per-rank memory bill of every layout, and the first that fits.

    python examples/plan_memory.py --params 7e9 --gpus 8 --gpu-mem 80 --seq 4096
    python examples/plan_memory.py --n-layer 48 --n-head 25 --n-embd 1600 --seq 1024 \\
        --gpus 4 --gpu-mem 24 --micro-batch 4 --json
    python examples/plan_memory.py --measure        # small model: ledger beside the planner
    python examples/plan_memory.py --params 1e9 --moe-experts 8 --moe-top-k 2 --gpus 8
    python examples/plan_memory.py --params 7e9 --gpus 8 --seq 4096 --optimizer muon
    python examples/plan_memory.py --params 7e9 --gpus 8 --seq 4096 --grad-dtype float32

Each row is what the start-up's memory check (minidist/train/memory_check.py) bills that
layout's run on GPUs: the model states and activations (minidist/train/planner.py), the
step's logits and buffers (minidist/train/run_bill.py, step_buffers.py); the total holds a
training run's evaluation forward where it needs more than the step. --measure trains the
train_gpt.py default model for 2 steps under each strategy that exists (mpiexec for several
ranks) and prints the ledger's per-rank bytes beside both predictions (README table);
with --optimizer muon, trained and planned with Muon.
"""
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minidist.nn import GPTConfig                                      # noqa: E402
from minidist.nn.config import TILED_FROM_T                            # noqa: E402
from minidist.train.plan_args import (add_model_args, config_from_args,  # noqa: E402
                                      model_text, number_problem)
from minidist.train.planner import GiB, Layout, bill, stage_params   # noqa: E402
from minidist.train.run_bill import plan                               # noqa: E402
from minidist.train.args import a_path, example_parser  # noqa: E402
from minidist.train.cli import check_one_process, run_main  # noqa: E402

# --measure: (label, ranks, train_gpt.py flags, the planner's Layout); a strategy is one row.
MEASURED = [
    ("1 process, float32", 1, [], Layout(amp=False)),
    ("1 process, float32, --ckpt-activations", 1, ["--ckpt-activations"],
     Layout(amp=False, recompute="full")),
    ("1 process, --amp", 1, ["--amp"], Layout(amp=True)),
    ("1 process, --amp --attention recompute", 1, ["--amp", "--attention", "recompute"],
     Layout(amp=True, recompute="selective")),
    ("1 process, --amp --ckpt-activations", 1, ["--amp", "--ckpt-activations"],
     Layout(amp=True, recompute="full")),
    ("DDP x2, float32", 2, [], Layout(dp=2, amp=False)),
    ("DDP x2, --amp --ckpt-activations", 2, ["--amp", "--ckpt-activations"],
     Layout(dp=2, amp=True, recompute="full")),
    ("ZeRO-1 x2, --amp", 2, ["--zero", "1", "--amp"], Layout(dp=2, zero=1)),
    ("ZeRO-2 x2, --amp", 2, ["--zero", "2", "--amp"], Layout(dp=2, zero=2)),
    ("ZeRO-3 x2, --amp", 2, ["--zero", "3", "--amp"], Layout(dp=2, zero=3)),
    ("ZeRO-3 x2, --amp --ckpt-activations", 2, ["--zero", "3", "--amp", "--ckpt-activations"],
     Layout(dp=2, zero=3, recompute="full")),
    ("TP2, --amp", 2, ["--tp", "2", "--amp"], Layout(tp=2)),
    ("PP2 (2 micro-batches), --amp", 2, ["--pp", "2", "--micro-batches", "2", "--amp"],
     Layout(pp=2)),
]


def parser():
    p = example_parser(__doc__)
    add_model_args(p)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per pass")
    p.add_argument("--dropout", action="store_true",
                   help="a model with dropout: its masks, billed as the run's check bills them")
    p.add_argument("--gpus", type=int, default=8,
                   help="GPUs in all, whole nodes of --gpus-per-node")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node (tensor parallelism stays inside one)")
    p.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="train_gpt.py's: muon keeps Muon's momentum alone for the blocks' "
                   "matrices, 4 bytes a parameter less than AdamW's m and v where the "
                   "optimizer is per parameter (no ZeRO); under ZeRO the same bytes as AdamW "
                   "(its flat v spans them, zero there)"),
    p.add_argument("--grad-dtype", choices=("float32",), default=None,
                   help="train_gpt.py's: the mixed-precision rows with float32 gradients, 4 "
                   "bytes a parameter (sharded under ZeRO-2/3)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction kept free for workspace, buffers, fragmentation")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--measure", action="store_true",
                   help="measure the train_gpt.py default model (ledger vs planner)")
    p.add_argument("--data", type=a_path, default=None,
                   help="--measure: training text (default stdlib)")
    return p


# the flags both runs read (--measure trains train_gpt.py's default model with this block),
# and the one only --measure reads
BOTH_READ, MEASURE_ONLY = ("measure", "arch", "n_kv_head", "optimizer"), ("data",)


def measure_problem(args, p):
    """A flag given (not its default) that this run would ignore, as a sentence naming it:
    with --measure every planning flag (the model's size, the GPUs, --json...), without it
    --data (first-use walk 18: --measure --n-layer 2 measured the 4-layer default model
    silently); None when there is none."""
    for name, value in sorted(vars(args).items()):
        if value == p.get_default(name) or name in BOTH_READ or \
                (name in MEASURE_ONLY) == bool(args.measure):
            continue
        flag = f"--{name.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
        if args.measure:
            return (f"{flag}: --measure trains train_gpt.py's default model (only --arch, "
                    f"--n-kv-head, --optimizer and --data change what it runs); leave "
                    f"{flag.split()[0]} out, or drop --measure to plan with it")
        return f"{flag}: only read by --measure (the text it trains on); leave it out"
    return None


def print_plan(result):
    c = result["config"]
    muon = ", Muon for the blocks' matrices" if result["optimizer"] == "muon" else ""
    print(f"model: {model_text(result['params'], c)}, seq {result['seq']}, "
          f"micro-batch {result['micro_batch']} per rank{muon}, {result['gpus']} GPUs, "
          f"budget {result['budget_bytes'] / GiB:.1f} GiB per GPU")
    keys = ("params", "grads", "optimizer", "activations", "logits", "buffers", "total")
    # 8 wide, or wider where a value needs it (a 1T model's 15255.66 GiB), one space between
    w = max(8, *(len(f"{r[k] / GiB:.2f}") + 1 for r in result["rows"] for k in keys))
    print(f"{'layout (per-rank GiB)':<48}{'params':>{w}}{'grads':>{w}}{'optim':>{w}}"
          f"{'activ':>{w}}{'logits':>{w}}{'buffers':>{w}}{'total':>{w}}  fits")
    for r in result["rows"]:
        shown = {**r, "activations": shown_activations(r)}
        cols = "".join(f"{shown[k] / GiB:{w}.2f}" for k in keys)
        print(f"{r['layout']:<48}{cols}  {'yes' if r['fits'] else 'no'}")
    if any(shown_activations(r) != r["activations"] for r in result["rows"]):
        print("activ: the step's graph, or where it holds more (ckpt rows) the evaluation's "
              "forward, one block at a time (with the logits)")
    best = result["recommendation"]
    print(f"recommendation: {best}" if best else
          "recommendation: nothing fits; add GPUs, shorten --seq or --micro-batch")
    if "note" in result:
        print(f"note: {result['note']}")


def shown_activations(row):
    """A row's activations as the table prints them, so that its columns add up to its total
    (run_bill.step_total): the step's, or the evaluation's forward less the logits where it
    holds more than the step (its activations and logits) in turn."""
    return max(row["activations"], row["evaluation"] - row["logits"])


# first-use walk 38: a 131072-token plan priced the scores train_gpt.py would never keep
LONG_SEQUENCE = (f"activations are priced with the attention's (T, T) scores kept (--attention "
                 f"materialized); train_gpt.py tiles attention from {TILED_FROM_T} tokens on "
                 "(--attention auto), and context parallelism splits the sequence: "
                 "examples/plan.py prices both")


def _run_train(ranks, flags, data, tmp):
    """The last step's ledger row of a 2-step train_gpt.py run on `ranks` processes."""
    log = os.path.join(tmp, f"log{len(os.listdir(tmp))}.jsonl")
    cmd = [sys.executable, "examples/train_gpt.py", "--steps", "2", "--eval-every", "0",
           "--eval-iters", "1", "--sample", "0", "--log-json", log, *flags]
    cmd += ["--data", data] if data else []
    if ranks > 1:
        here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        cmd = [here if os.path.exists(here) else "mpiexec", "-n", str(ranks)] + cmd
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(cmd, cwd=root, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    rows = [json.loads(line) for line in open(log)]
    return rows[-2]["mem"]


def measure(args):
    """Markdown: measured per-rank MiB beside the minidist count and Korthikanti's, for
    train_gpt.py's default model with --arch, --n-kv-head and --optimizer."""
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256,
                       arch=args.arch, n_kv_head=args.n_kv_head, bias=args.arch == "gpt2")
    block = ["--arch", args.arch, "--n-kv-head", str(args.n_kv_head), "--optimizer",
             args.optimizer]
    muon = args.optimizer == "muon"
    mib = 2 ** 20
    shape = model_text(sum(stage_params(config)), config.to_dict())
    print(f"model: train_gpt.py's default, {shape}, T 128, batch 16"
          + (", --optimizer muon" if muon else ""))
    print("| strategy | params | grads | optimizer | activations (measured / minidist count "
          "/ Korthikanti) | total measured / predicted |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, ranks, flags, layout in MEASURED:
            layout = replace(layout, muon=muon)
            got = _run_train(ranks, flags + block, args.data, tmp)
            b = 16 // layout.dp // (2 if layout.pp > 1 else 1)    # sequences per micro-batch
            theirs = bill(config, layout, 128, b)
            ours = bill(config, layout, 128, b, formula="minidist") \
                if layout.tp == layout.pp == 1 else None
            same = all(got[k] == theirs[k] for k in ("params", "grads", "optimizer"))
            count = f"{ours['activations'] / mib:.2f}" if ours else "-"
            print(f"| {label} | " + " | ".join(f"{got[k] / mib:.2f}" for k in
                                               ("params", "grads", "optimizer")) +
                  f" | {got['activations'] / mib:.2f} / {count} / "
                  f"{theirs['activations'] / mib:.2f} | {got['total'] / mib:.2f} / "
                  f"{(ours or theirs)['total'] / mib:.2f} |" + ("" if same else " states differ!"))


def main(argv=None):
    check_one_process("plan_memory.py")
    p = parser()
    args = p.parse_args(argv)
    problem = measure_problem(args, p)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    if args.measure:
        return measure(args)
    problem = number_problem(args)    # (a part of a node is fine: no link is priced here)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        config = config_from_args(args)
    except ValueError as e:                    # GPTConfig's checks (the moe_* fields, ...)
        print(f"error: model flags: {e}", file=sys.stderr)
        sys.exit(2)
    if args.dropout:            # any p > 0 keeps the same masks: the check's bill of the run
        config = replace(config, dropout=0.1)
    result = plan(config, args.gpus, args.gpu_mem, args.seq, args.micro_batch,
                  args.gpus_per_node, args.headroom,
                  muon=args.optimizer == "muon", grad32=args.grad_dtype == "float32")
    if args.seq >= TILED_FROM_T:
        result["note"] = LONG_SEQUENCE
    if args.json:
        print(json.dumps(result))
    else:
        print_plan(result)


if __name__ == "__main__":
    run_main(main, None)            # (None: parse reads sys.argv; `| head` ends quietly)
