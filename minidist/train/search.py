"""The layout search: every dp x tp x pp x cp split of a cluster, ZeRO stage, recompute and
micro-batch count; its per-rank memory (run_bill.step_bill: the start-up's memory check's
bill of the run train_flags makes of the row, logits and step buffers in it; planner.bill's
states and activations alone until 2026-11-30) and step time (cost.step_time); the fastest
that fit. The CLI is examples/plan.py; tests: tests/test_plan_search.py,
tests/test_plan_cli.py, tests/test_plan_search_check.py (the rows' memory is the check's).

Which splits are tried: tp a power of two inside one node dividing the heads (TP's
all-reduces are the chattiest traffic, so mesh.py puts tp fastest, on neighbouring ranks);
pp up to the layers; cp a power of two dividing the sequence, each cp > 1 with the ring and,
where the heads n_head / tp divide by cp, with Ulysses' all-to-alls (cp_attentions); dp the
rest, dividing the global batch. micro-batches: pp, 2 pp, 4 pp, ... with pp > 1 (fewer idle
most of the step; from the first count above pp that divides the batch where pp does not);
without a pipeline 1, 2, 4, ... (--grad-accum), up to the first that fits: a micro-batch of
the whole per-rank batch when it fits, else the largest that does (in the model more
accumulation only costs time: smaller backwards to hide DDP's all-reduce behind, ZeRO-3's
gathers once a micro-batch);
ckpt: without and with full recompute (not under ZB-H1, which training refuses), and with
selective recompute where attention is materialised (--attention recompute: its scores
computed again in backward; tiled attention keeps none).
With sequence parallelism (always with tp > 1) each cp rank's seq / cp tokens must split
over tp; under the interleaved schedule every one of pp x v chunks needs a block.
ZeRO whose dp x cp ranks span nodes also tries hybrid sharding, one node's
share of them per sharded replica (zero_shards). A Mixture of Experts (config.moe_experts)
also tries every ep dividing both dp and the expert count (expert parallelism carved out of
dp), with cp and SP as a dense model (its routing's exchange over the split sequence priced
by moe_cost.py split_times).
`muon` (plan.py --optimizer muon) prices every row with Muon (its state in
planner.bill, its Newton-Schulz and gathers in muon_cost.py) and its command runs it.
`train_flags(config, row)` is a row as examples/train_gpt.py's flags: what a proposal asks
training to run (tests/test_plan_strategies.py checks that training accepts every one).
`layout_problems` is the check of a layout given by hand (plan.py --layout): training's own
checks on its train_flags, so the planner prices only what train_gpt runs. The search tries
a subset of those (powers of two, tp inside a node, cp up to 8: the likely fastest);
`no_layout_problem` says why it found none.
"""
from dataclasses import asdict, replace

from minidist.cp.context import ATTENTIONS
from minidist.cp.strategy import cp_problems, ulysses_problems
from minidist.ep.strategy import ep_problems, moe_problems
from minidist.pp.strategy import pp_problems
from minidist.tp.strategy import tp_problems
from minidist.train.args import parse_train_flags, train_default
from minidist.train.cli import UsageError
from minidist.train.cluster import fills_nodes
from minidist.train.cost import step_time
from minidist.train.moe_cost import check_moe_layout
from minidist.train.plan_args import block_flags
from minidist.train.planner import GiB, Layout
from minidist.train.run_bill import step_bill
from minidist.train.strategy import check_layout
from minidist.zero.strategy import zero_shard_problem

ZERO_STAGES = (0, 1, 2, 3)       # train_gpt's --zero choices (minidist/train/args.py)
MUON_NS_STEPS = train_default("muon_ns_steps")     # its --muon-ns-steps: 5
TRAIN_BUCKET_MB = train_default("bucket_mb")       # its --bucket-mb: 1 MiB
BUCKET_MB = 25.0       # DDP's bucket the search prices (PyTorch DDP's default, the usual on
                       # GPUs; train_gpt's 1 MiB suits its small models), its command's too
CP_ATTENTIONS = ATTENTIONS             # its --cp-attention choices (minidist/cp/context.py)


def _powers_of_two(limit):
    p, out = 1, []
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def splits(config, gpus, gpus_per_node, seq, global_batch, max_cp=8, v=1):
    """(dp, tp, pp, cp) with dp tp pp cp = gpus under the rules in the module docstring;
    with sequence parallelism (every tp > 1) each cp rank's seq / cp tokens split over tp;
    v chunks per stage (interleaved) each need a block."""
    out = []
    for tp in _powers_of_two(min(gpus, gpus_per_node)):
        if config.n_head % tp or config.kv_heads % tp or gpus % tp:
            continue
        for cp in _powers_of_two(min(max_cp, gpus // tp)):
            if seq % (2 * cp) and cp > 1 or (gpus // tp) % cp:
                continue
            if tp > 1 and seq % (cp * tp):
                continue                                     # SP: seq / cp over tp ranks
            for pp in range(1, min(config.n_layer, gpus // (tp * cp)) + 1):
                dp, rest = divmod(gpus, tp * cp * pp)
                if rest == 0 and global_batch % dp == 0 and (pp == 1 or
                                                             pp * v <= config.n_layer):
                    out.append((dp, tp, pp, cp))
    return out


def micro_batch_counts(pp, per_rank_batch, most=4, grouped=False):
    """Micro-batch counts to try: without a pipeline 1, 2, 4, ... that divide the per-rank
    batch (gradient accumulation, --grad-accum: the search stops at the first that fits);
    else pp, 2pp, 4pp, ... that divide it (at most `most` of them); where pp does not divide
    it (pp 3, 512 sequences), the same from the first count above pp that does (4, 8, ...:
    training runs any), unless `grouped` (the interleaved schedule runs micro-batches in
    groups of pp)."""
    if pp == 1:
        return [m for m in (2 ** i for i in range(per_rank_batch.bit_length()))
                if per_rank_batch % m == 0]
    out, m = [], next((m for m in range(pp, per_rank_batch + 1, pp if grouped else 1)
                       if per_rank_batch % m == 0), per_rank_batch + 1)
    while m <= per_rank_batch and len(out) < most:
        if per_rank_batch % m == 0:
            out.append(m)
        m *= 2
    return out


def evaluate(config, layout, cluster, seq, global_batch, micro_batches, schedule="1f1b",
             comm="ring", headroom=0.1, v=1, moe_load=1.0, ns_steps=5, bucket_mb=BUCKET_MB):
    """One row: the layout, its memory bill on the worst stage (step_bill, on GPUs, of the
    model at `seq` tokens: what the check bills its run) and its step-time figures
    (DDP's buckets of bucket_mb MiB, "bucket_mb": train_flags runs the same); under Muon
    (layout.muon) also its Newton-Schulz iterations, "muon_ns_steps"."""
    b = global_batch // (layout.dp * micro_batches)
    sized = config if config.block_size == seq else replace(config, block_size=seq)
    mem = step_bill(sized, layout, b, schedule, micro_batches, v)
    t = step_time(config, layout, cluster, seq, global_batch, micro_batches, schedule, comm, v,
                  bucket_mb, moe_load=moe_load, ns_steps=ns_steps)
    muon = {"muon_ns_steps": ns_steps} if layout.muon else {}
    return {"layout": layout.name(), **asdict(layout), **muon, "micro_batches": micro_batches,
            "bucket_mb": bucket_mb,
            "micro_batch": b, "schedule": schedule, "comm": comm, "mem": mem,
            "fits": mem["total"] <= cluster.mem_gib * GiB * (1 - headroom), **t}


def cp_attentions(config, tp, cp):
    """CP attentions to try: none to choose without cp; the ring, and Ulysses where each cp
    rank gets whole heads (n_head / tp divisible by cp: cp_problems refuses it otherwise)."""
    if cp == 1:
        return ["ring"]
    return ["ring"] + (["ulysses"] if (config.n_head // tp) % cp == 0 else [])


def zero_shards(zero, ranks, tp, gpus_per_node):
    """Hybrid sharding's group sizes to try: 0 (ZeRO over all its `ranks`, dp x cp, the ep
    ranks among dp) and, where they span more than one node, as many as one node holds (its
    GPUs / tp: the group's ranks are tp apart), if that is 2 or more (1 would shard
    nothing). Under --ep the experts stay ZeRO-1 over their replicas (minidist/ep/optim.py)."""
    k = gpus_per_node // tp
    return [0, k] if zero and 2 <= k < ranks and ranks % k == 0 else [0]


def expert_splits(config, dp):
    """ep degrees to try: 1 for a dense model; else every divisor of dp that divides the
    expert count."""
    E = config.moe_experts
    return [ep for ep in range(1, dp + 1) if dp % ep == 0 and E % ep == 0] if E else [1]


def search(config, cluster, gpus, seq, global_batch, schedule="1f1b", comm="ring", amp=True,
           tiled=True, zeros=ZERO_STAGES, recomputes=None, headroom=0.1, v=1,
           moe_load=1.0, muon=False, ns_steps=5, grad32=False, bucket_mb=BUCKET_MB):
    """Every candidate row, fastest first among those that fit, then the rest. recomputes:
    None: none and full, and selective too where the attention is not tiled (tiles keep
    no scores to recompute). muon: every row with --optimizer muon (ns_steps: its
    Newton-Schulz iterations). grad32 (with amp): --grad-dtype float32's 4-byte gradients.
    bucket_mb: DDP's bucket size, MiB."""
    recomputes = recomputes or (("none", "full") if tiled else ("none", "selective", "full"))
    rows = []
    for dp, tp, pp, cp in splits(config, gpus, cluster.gpus_per_node, seq, global_batch, v=v):
        for zero in (zeros if dp * cp > 1 else (0,)):
            for recompute in recomputes:
                if recompute == "full" and schedule == "zb-h1" and pp > 1:
                    continue                    # training refuses it: W would recompute
                for ep in expert_splits(config, dp):
                    for attention in cp_attentions(config, tp, cp):
                        for shard in zero_shards(zero, dp * cp, tp, cluster.gpus_per_node):
                            layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, amp=amp,
                                            ep=ep, recompute=recompute, sp=tp > 1,
                                            tiled=tiled, cp_attention=attention,
                                            zero_shard=shard, muon=muon,
                                            grad32=grad32 and amp)
                            if recompute == "selective" and not layout.keeps_scores:
                                continue        # no scores to recompute (the ring's tiles)
                            for m in micro_batch_counts(pp, global_batch // dp,
                                                        grouped=v > 1):
                                rows.append(evaluate(config, layout, cluster, seq,
                                                     global_batch, m, schedule, comm,
                                                     headroom, v, moe_load, ns_steps,
                                                     bucket_mb))
                                if pp == 1 and rows[-1]["fits"]:
                                    break       # more accumulation: only slower

    return fastest_first(rows)


def fastest_first(rows):
    """Rows that fit first, each part fastest first: the order the tables print."""
    return sorted(rows, key=lambda r: (not r["fits"], r["step"]))


def train_flags(config, row, v=1):
    """examples/train_gpt.py's flags for a search row (its layout, micro-batches, schedule;
    v: model chunks per stage under the interleaved schedule) on `config`, global batch
    row["micro_batch"] x dp x micro-batches sequences of config.block_size tokens. The
    planner's dp counts the ep ranks (ep is carved out of it), train_gpt's --dp does not.
    Micro-batches without a pipeline are train_gpt's --grad-accum (the same steps in turn).
    A row priced with Muon (row["muon"]) runs --optimizer muon, with --muon-ns-steps
    where its "muon_ns_steps" is not training's default, 5; one with float32 gradients
    (row["grad32"]) --grad-dtype float32; one priced with DDP's buckets of row["bucket_mb"]
    MiB, --bucket-mb where that is not training's default (1) and DDP runs (--zero 0 over
    more than one replica: training refuses the flag elsewhere, idle_flags.py)."""
    attention = "tiled" if row["tiled"] else \
        "recompute" if row["recompute"] == "selective" else "materialized"   # as priced
    flags = ["--n-layer", config.n_layer, "--n-head", config.n_head, "--n-embd",
             config.n_embd, "--block-size", config.block_size, "--batch-size",
             row["micro_batch"] * row["dp"] * row["micro_batches"], "--dp", row["dp"] // row["ep"],
             "--tp", row["tp"], "--pp", row["pp"], "--cp", row["cp"], "--ep", row["ep"],
             "--zero", row["zero"], "--attention", attention]
    if row.get("zero_shard"):
        flags += ["--zero-shard", row["zero_shard"]]
    flags += ["--overlap-param-gather"] if row.get("overlap_gather") else []
    flags += block_flags(config)
    if row["pp"] > 1:
        interleaved = row["schedule"] == "interleaved"
        flags += ["--micro-batches", row["micro_batches"], "--schedule",
                  "1f1b" if interleaved else row["schedule"],
                  "--pp-virtual", v if interleaved else 1]
    elif row["micro_batches"] > 1:
        flags += ["--grad-accum", row["micro_batches"]]
    flags += (["--sequence-parallel"] if row["sp"] else []) + (["--amp"] if row["amp"] else [])
    flags += ["--grad-dtype", "float32"] if row.get("grad32") else []
    bucket = row.get("bucket_mb", TRAIN_BUCKET_MB)
    if bucket != TRAIN_BUCKET_MB and not row["zero"] and row["dp"] * row["cp"] > 1:
        flags += ["--bucket-mb", f"{bucket:g}"]
    flags += ["--ckpt-activations"] if row["recompute"] == "full" else []
    ulysses = row.get("cp_attention", "ring") == "ulysses"   # the ring: training's default
    flags += ["--cp-attention", "ulysses"] if ulysses else []
    flags += ["--comm", "hier"] if row.get("comm") == "hier" else []   # ring: the default
    if row.get("muon"):                                                # adamw: the default
        flags += ["--optimizer", "muon"]
        steps = row.get("muon_ns_steps", MUON_NS_STEPS)
        flags += ["--muon-ns-steps", steps] if steps != MUON_NS_STEPS else []
    return [str(f) for f in flags]


def layout_problems(config, layout, gpus, global_batch, micro=1, schedule="1f1b", v=1):
    """Why examples/train_gpt.py would not run `layout` with `micro` micro-batches on `gpus`
    GPUs, as sentences each naming a plan.py --layout key ([] if it runs): the keys' ranges,
    the sizes, the step-time model's MoE rule (moe_cost.check_moe_layout), then training's own
    checks (tp_problems, pp_problems, cp_problems, ep_problems; check_layout for the rest) on
    the flags train_flags makes of it (sequences of config.block_size tokens); cp_problems'
    refusal of Ulysses (heads that do not divide by cp) is named by its key, cpattn."""
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp,
             "ep": layout.ep, "micro": micro}
    problems = [f"{k}={n}: must be at least 1" for k, n in sizes.items() if n < 1]
    if layout.zero not in ZERO_STAGES:
        problems.append(f"zero={layout.zero}: the ZeRO stage is 0 (DDP), 1, 2 or 3")
    if layout.cp_attention not in CP_ATTENTIONS:
        problems.append(f"cpattn={layout.cp_attention}: the CP attention is ring or ulysses")
    if layout.zero_shard and not layout.zero:
        problems.append(f"shard={layout.zero_shard}: hybrid sharding needs zero=1, 2 or 3")
    if layout.recompute == "selective" and not layout.keeps_scores:
        problems.append("selective: tiled attention keeps no scores to recompute; use "
                        "--attention materialized, or leave selective out" if layout.tiled else
                        "selective: the ring keeps no scores to recompute (its blocks are "
                        "tiled); use cpattn=ulysses, or leave selective out")
    if layout.overlap_gather and layout.zero not in (1, 2):
        problems.append("ogather: the overlapped parameter gather needs zero=1 or 2 (ZeRO-3 "
                        "gathers before each block anyway)")
    if problems:
        return problems
    if layout.gpus != gpus:
        problems.append(f"dp x tp x pp x cp = {layout.gpus}, but --gpus is {gpus}")
    if global_batch % (layout.dp * micro):
        problems.append(f"dp={layout.dp} x micro={micro} = {layout.dp * micro} micro-batches "
                        f"do not split --global-batch {global_batch} evenly")
    try:
        check_moe_layout(config, layout)
    except ValueError as e:
        problems.append(f"ep={layout.ep}: {e}")
    if problems:
        return problems
    row = {**asdict(layout), "micro_batches": micro, "schedule": schedule,
           "micro_batch": global_batch // (layout.dp * micro)}
    args = parse_train_flags(train_flags(config, row, v))
    cp = cp_problems(args) if layout.cp > 1 else []
    heads = ulysses_problems(args) if layout.cp > 1 and layout.cp_attention == "ulysses" \
        else []                                   # those of cp_problems' that are Ulysses'
    named = [(f"tp={layout.tp}", tp_problems(args) if layout.tp > 1 else []),
             (f"pp={layout.pp}", pp_problems(args, micro) if layout.pp > 1 else []),
             (f"cp={layout.cp}", [p for p in cp if p not in heads]),
             (f"cpattn={layout.cp_attention}", [p for p in cp if p in heads]),
             (f"ep={layout.ep}", moe_problems(args) + (ep_problems(args) if layout.ep > 1
                                                       else []))]
    problems = [f"{key}: {p}" for key, found in named for p in found]
    if not problems and layout.zero_shard:
        shard = zero_shard_problem(args, layout.dp // layout.ep)
        problems += [f"shard={layout.zero_shard}: {shard}"] if shard else []
    if not problems:
        try:
            check_layout(args, gpus)                        # whatever else training refuses
        except UsageError as e:
            problems.append(f"examples/train_gpt.py refuses it: {e}")
    return problems


def no_layout_problem(config, gpus, gpus_per_node, seq, global_batch, v=1, max_cp=8):
    """Why the search has no layout of `gpus` GPUs, as a sentence naming splits' rules and
    the nearest GPU counts below and above that have one; None when it has one."""
    def found(n):                      # no count plan.py refuses (a part of a node)
        return fills_nodes(n, gpus_per_node) and any(
            micro_batch_counts(pp, global_batch // dp, grouped=v > 1)
            for dp, tp, pp, cp in splits(config, n, gpus_per_node, seq, global_batch, max_cp, v))
    if found(gpus):
        return None
    near = [next((n for n in range(gpus - 1, 0, -1) if found(n)), None),
            next((n for n in range(gpus + 1, 2 * gpus + 1) if found(n)), None)]
    chunks = f" x --chunks {v}" if v > 1 else ""
    return (f"--gpus {gpus}: no layout of {gpus} GPUs divides --global-batch {global_batch}, "
            f"the {config.n_head} heads and the {config.n_layer} layers (dp x tp x pp x cp "
            f"= {gpus}: dp dividing the batch, tp a power of two up to {gpus_per_node} per node "
            f"dividing the heads and --seq {seq} / cp, pp{chunks} at most the layers, cp a "
            f"power of two up to {max_cp} dividing --seq / 2"
            + (", micro-batches in groups of pp" if v > 1 else "") + "); try --gpus "
            + " or ".join(str(n) for n in near if n))
