"""The planners' command line (examples/plan.py, examples/plan_memory.py): their model flags,
the check of every numeric flag before any planning (one `error:` line naming it), and the
GPTConfig the flags describe (minidist/train/planner.py plans for it).
Tests: tests/test_planner_cli.py (the planners' bad numbers), tests/test_plan_cli.py (the
planners' bad input), tests/test_planner.py.
"""
import math
from dataclasses import replace

from minidist.nn.config import GPTConfig
from minidist.train.args import add_moe_args, train_default
from minidist.train.cli import UsageError
from minidist.train.cluster import fills_nodes
from minidist.train.model_flags import check_moe
from minidist.train.planner import config_for_params, stage_params


def add_model_args(p):
    """The model flags of both planners (examples/plan.py, plan_memory.py): --params (a shape
    assumed by config_for_params) or the shape, --vocab-size, --seq, and the Mixture of
    Experts: train_gpt.py's own flags (minidist/train/args.py add_moe_args)."""
    p.add_argument("--params", type=float,
                   help="model size; the shape is assumed (h/L~128, the count it reaches is "
                        "printed); refused where even the smallest shape (one layer of width "
                        "256, with --vocab-size and --seq) is over twice it. With "
                        "--moe-experts it sizes the dense shape, whose MLPs then become the "
                        "experts: the model line prints both counts")
    p.add_argument("--n-layer", type=int, default=4, help="blocks (without --params)")
    p.add_argument("--n-head", type=int, default=4, help="heads (without --params)")
    p.add_argument("--n-embd", type=int, default=128, help="width (without --params)")
    p.add_argument("--vocab-size", type=int, default=50257, help="tokens (GPT-2's)")
    p.add_argument("--seq", "--block-size", type=int, default=1024,
                   help="tokens per sequence (train_gpt.py's --block-size)")
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                   help="the block (train_gpt.py's --arch): llama's SwiGLU MLP keeps 3F "
                   "values per token for GELU's 8h, and holds no position table")
    p.add_argument("--n-kv-head", type=int, default=0,
                   help="k and v heads (grouped-query attention); 0: --n-head (with --params: "
                   "its assumed head count, h/128)")
    p.add_argument("--ffn-hidden", type=int, default=0,
                   help="the MLP's width (train_gpt.py's flag; 0: 4h, Llama's ~8h/3; "
                   "Llama-2-7B: 11008)")
    return add_moe_args(p)


def block_flags(config):
    """The flags (examples/train_gpt.py's, which the planners take too: add_model_args) of
    `config`'s block beyond its layers, heads and width: Llama's block and its kv heads, the
    MLP's width, the experts (their capacity, the losses' weights and the shared experts
    where not the defaults). A search row's run (search.train_flags) and a refusal's
    plan_memory.py command (memory_check.plan_command) both say the model so."""
    flags = []
    if config.moe_experts:
        flags += ["--moe-experts", config.moe_experts, "--moe-top-k", config.moe_top_k,
                  "--moe-every", config.moe_every]
        defaults = GPTConfig()          # the capacity, the losses' weights and the shared
        flags += [f for name in ("moe_capacity_factor", "moe_aux_loss_coef",  # experts, where
                                 "moe_z_loss_coef", "moe_shared")       # not the default
                  if getattr(config, name) != getattr(defaults, name)
                  for f in ("--" + name.replace("_", "-"), getattr(config, name))]
    if config.llama:
        flags += ["--arch", "llama"] + (["--n-kv-head", config.n_kv_head]
                                        if config.n_kv_head else [])
    return flags + (["--ffn-hidden", config.ffn_hidden] if config.ffn_hidden else [])


# the planners' numeric flags that may be 0 (the others must be positive)
MAY_BE_ZERO = ("n_kv_head", "ffn_hidden", "moe_experts", "moe_shared", "moe_capacity_factor",
               "moe_aux_loss_coef", "moe_z_loss_coef", "headroom", "intra_lat", "inter_lat",
               "sync_us", "overlap")

# flags with a second name (train_gpt.py's): an error names both, as either may have been typed
TWO_NAMES = {"seq": "--seq/--block-size", "global_batch": "--global-batch/--batch-size",
             "chunks": "--chunks/--pp-virtual"}


def number_problem(args):
    """The first numeric flag of a planner's `args` that is not a finite number > 0 (>= 0
    for MAY_BE_ZERO; --headroom below 1, --efficiency at most 1), or a --moe-* flag given
    without --moe-experts (refused as training refuses it), as a sentence naming it; None
    when all are.
    (A GPU count of 0 or an efficiency of 0 was a ZeroDivisionError, a negative --params a
    complex number, a negative --gpu-mem a plan in which nothing fits.)"""
    for name, value in sorted(vars(args).items()):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        zero = name in MAY_BE_ZERO
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            flag = TWO_NAMES.get(name, f"--{name.replace('_', '-')}")
            return (f"{flag} {value}: must be "
                    + ("a number >= 0" if zero else "a positive number"))
    if getattr(args, "headroom", 0) >= 1:
        return f"--headroom {args.headroom}: the fraction of memory kept free, below 1"
    if (getattr(args, "efficiency", None) or 0) > 1:   # (45 for 45%: MFU 40, steps / 45)
        return (f"--efficiency {args.efficiency}: the fraction of peak the compute reaches, "
                "at most 1 (0.45 for 45%)")
    if not args.moe_experts:                 # a dense plan would ignore them, silently
        try:
            check_moe(args)                  # training's own refusal of the idle --moe-*
        except UsageError as e:
            return str(e)
    shape = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n, default in SHAPE.items()
             if getattr(args, n) != default]
    if args.params is not None and shape:      # the shape --params assumes would replace it
        return (f"{' '.join(shape)}: --params {args.params:g} assumes its own shape; give "
                "--params or the shape, not both")
    return size_problem(args) or params_problem(args)


# the largest model the planners take: a search's time grows with the layers (L = 8,000, the
# shape of --params 1e17: 30 s on the development VM), and --params 1e30 ran for hours
# (tests/scripts/fuzz_cli.py's neighbour: the planner's flags tried by hand); the largest
# models trained have about 2e12 parameters and 130 layers
MAX_PARAMS, MAX_LAYERS = 1e17, 10_000
# and the most experts: a layout's expert tensors are priced one by one (their buckets), so
# a search's time and memory grow with them (1,024: 39 s, 1.2 GiB; 4,096: 153 s, 4.7 GiB);
# DeepSeek-V3 has 256
MAX_EXPERTS = 1024


def size_problem(args):
    """--params over MAX_PARAMS, --n-layer over MAX_LAYERS or --moe-experts over MAX_EXPERTS,
    as a sentence naming the flag and the limit; None when the model is within them."""
    if args.params is not None and args.params > MAX_PARAMS:
        return (f"--params {args.params:g}: at most {MAX_PARAMS:g} (100,000T; the largest "
                "models trained have about 2T): the search's time grows with the layers")
    if args.params is None and args.n_layer > MAX_LAYERS:
        return (f"--n-layer {args.n_layer}: at most {MAX_LAYERS:,} (the largest models "
                "trained have about 130): the search's time grows with the layers")
    if args.moe_experts > MAX_EXPERTS:
        return (f"--moe-experts {args.moe_experts}: at most {MAX_EXPERTS:,} (DeepSeek-V3 has "
                "256): the search's time and memory grow with the experts")
    return None


def muon_problem(args):
    """plan.py's --muon-ns-steps changed without --optimizer muon (it would price nothing;
    training refuses it too, minidist/train/idle_flags.py), as a sentence naming it; None
    otherwise (and for plan_memory.py, which has no such flag: it prices no time)."""
    steps = getattr(args, "muon_ns_steps", None)
    if steps is None or args.optimizer == "muon" or \
            steps == train_default("muon_ns_steps"):
        return None
    return (f"--muon-ns-steps {steps}: sets Muon's Newton-Schulz iterations, which this plan "
            "does not price (add --optimizer muon, or leave --muon-ns-steps out)")


def nodes_problem(gpus, gpus_per_node):
    """--gpus that do not fill whole nodes of --gpus-per-node (cluster.fills_nodes: the
    step-time model prices every node like the one holding rank 0, so 8 + 4 would be priced
    as 8 + 8), as a sentence naming the whole-node counts either side and the largest
    per-node count that divides --gpus; None when they fill whole nodes or fit in one.
    examples/plan.py's; plan_memory.py prices no link, so any count is fine there."""
    if fills_nodes(gpus, gpus_per_node):
        return None
    full = gpus // gpus_per_node
    even = next((k for k in range(gpus_per_node - 1, 1, -1) if gpus % k == 0), None)
    return (f"--gpus {gpus} --gpus-per-node {gpus_per_node}: {gpus} GPUs fill {full} "
            f"node{'s' if full > 1 else ''} of {gpus_per_node} and part of another, which the "
            f"step-time model cannot price (it takes every node as full); give --gpus "
            f"{full * gpus_per_node} or {(full + 1) * gpus_per_node}"
            + (f", or --gpus-per-node {even} ({gpus // even} full nodes)" if even else ""))


SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128}       # add_model_args' shape and defaults


def params_problem(args):
    """--params below what config_for_params can build: its shape has over twice the
    parameters asked for (--params 1e3 planned a 14M-parameter model, silently), as a
    sentence naming the smallest it can plan; None when the shape is within 2x."""
    if not args.params:
        return None
    built = sum(stage_params(config_for_params(args.params, args.seq, args.vocab_size)))
    if built <= 2 * args.params:
        return None
    least = config_for_params(1, args.seq, args.vocab_size)    # one layer, h 256
    n = sum(stage_params(least))
    unit = 10 ** (math.floor(math.log10(n / 2)) - 2)           # n / 2 rounded up, 3 digits
    return (f"--params {args.params:g}: the smallest model it can plan with --vocab-size "
            f"{args.vocab_size} and --seq {args.seq} (L={least.n_layer}, h={least.n_embd}) "
            f"has {count_text(n)} parameters, over twice that; give --params "
            f"{math.ceil(n / 2 / unit) * unit:.3g} or more, or the shape (--n-layer, --n-head, "
            f"--n-embd, a smaller --vocab-size)")


def count_text(n):
    """A parameter count as people write it (7.07B, 13.9M, 950K, 812, 1T): from 0.9995 of a
    unit on, .3g rounds to at least 1 of it; 1,000 units and up keep that unit's name
    (billions alone printed 1e12 as 1e+03B)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale * 0.9995:
            x = n / scale
            return f"{x:.3g}{unit}" if x < 999.5 else f"{x:,.0f}{unit}"
    return str(int(n))


def model_text(n_params, c):
    """The planners' model line: '7.07B parameters (L=32, h=4096, a=32, V=50257)'; with
    experts it says what --params sized: the dense shape, whose MLPs became the experts."""
    shape = f"L={c['n_layer']}, h={c['n_embd']}, a={c['n_head']}, V={c['vocab_size']}"
    if c.get("arch") == "llama":                  # GPTConfig.to_dict names it only then
        kv = c.get("n_kv_head") or c["n_head"]
        shape += f", Llama's block, {kv} kv head{'s' if kv > 1 else ''}"
    if c.get("ffn_hidden"):
        shape += f", MLP {c['ffn_hidden']} wide"
    if not c.get("moe_experts"):
        return f"{count_text(n_params)} parameters ({shape})"
    dense = sum(stage_params(GPTConfig(**{k: v for k, v in c.items()
                                          if not k.startswith("moe_")})))
    blocks = "every block" if c["moe_every"] == 1 else f"one block in {c['moe_every']}"
    shared = f" + {c['moe_shared']} shared" if c.get("moe_shared") else ""
    return (f"{count_text(n_params)} parameters: the {count_text(dense)} dense shape ({shape}, "
            f"what --params sizes) with the MLP of {blocks} made {c['moe_experts']} experts, "
            f"top-{c['moe_top_k']}{shared}")


def config_from_args(args):
    """The GPTConfig of add_model_args' flags; GPTConfig's ValueError on bad moe_* values."""
    block = dict(arch=args.arch, n_kv_head=args.n_kv_head, ffn_hidden=args.ffn_hidden,
                 bias=args.arch == "gpt2")
    base = (config_for_params(args.params, args.seq, args.vocab_size, **block) if args.params
            else GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           block_size=args.seq, vocab_size=args.vocab_size, **block))
    return replace(base, moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                   moe_capacity_factor=args.moe_capacity_factor, moe_every=args.moe_every,
                   moe_shared=args.moe_shared)
