"""The layout search: every dp x tp x pp x cp split of a cluster, ZeRO stage, recompute and
micro-batch count; its per-rank memory (planner.bill) and step time (cost.step_time); the
fastest that fit. The CLI is examples/plan.py; tests: tests/test_planner.py.

Which splits are tried: tp a power of two inside one node dividing the heads (TP's
all-reduces are the chattiest traffic, so mesh.py puts tp fastest, on neighbouring ranks);
pp up to the layers; cp a power of two dividing the sequence; dp the rest, dividing the
global batch. micro-batches: pp, 2 pp, 4 pp, ... with pp > 1 (fewer idle most of the
step), 1 otherwise (a micro-batch of the whole per-rank batch, the usual choice when it
fits); ckpt: without and with full recompute (not under ZB-H1, which training refuses).
With sequence parallelism (always with tp > 1) each cp rank's seq / cp tokens must split
over tp; under the interleaved schedule every one of pp x v chunks needs a block.
A Mixture of Experts (config.moe_experts) also tries every ep dividing both dp and the
expert count (expert parallelism carved out of dp), with cp and SP as a dense model (its
routing's exchange over the split sequence priced by moe_cost.py split_times).
`train_flags(config, row)` is a row as examples/train_gpt.py's flags: what a proposal asks
training to run (tests/test_planner.py checks that training accepts every one).
"""
from dataclasses import asdict

from minidist.train.cost import step_time
from minidist.train.planner import GiB, Layout, bill


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
        if config.n_head % tp or gpus % tp:
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


def micro_batch_counts(pp, per_rank_batch, most=4):
    """Micro-batch counts to try: 1 without a pipeline, else pp, 2pp, 4pp, ... that divide
    the per-rank batch (at most `most` of them)."""
    if pp == 1:
        return [1]
    out, m = [], pp
    while m <= per_rank_batch and len(out) < most:
        if per_rank_batch % m == 0:
            out.append(m)
        m *= 2
    return out


def evaluate(config, layout, cluster, seq, global_batch, micro_batches, schedule="1f1b",
             comm="ring", headroom=0.1, v=1, moe_load=1.0):
    """One row: the layout, its memory bill on the worst stage and its step-time figures."""
    b = global_batch // (layout.dp * micro_batches)
    mem = bill(config, layout, seq, b, dropout=False)
    t = step_time(config, layout, cluster, seq, global_batch, micro_batches, schedule, comm, v,
                  moe_load=moe_load)
    return {"layout": layout.name(), **asdict(layout), "micro_batches": micro_batches,
            "micro_batch": b, "schedule": schedule, "comm": comm, "mem": mem,
            "fits": mem["total"] <= cluster.mem_gib * GiB * (1 - headroom), **t}


def expert_splits(config, dp):
    """ep degrees to try: 1 for a dense model; else every divisor of dp that divides the
    expert count."""
    E = config.moe_experts
    return [ep for ep in range(1, dp + 1) if dp % ep == 0 and E % ep == 0] if E else [1]


def search(config, cluster, gpus, seq, global_batch, schedule="1f1b", comm="ring", amp=True,
           tiled=True, zeros=(0, 1, 2, 3), recomputes=("none", "full"), headroom=0.1, v=1,
           moe_load=1.0):
    """Every candidate row, fastest first among those that fit, then the rest."""
    rows = []
    for dp, tp, pp, cp in splits(config, gpus, cluster.gpus_per_node, seq, global_batch, v=v):
        for zero in (zeros if dp * cp > 1 else (0,)):
            for recompute in recomputes:
                if recompute == "full" and schedule == "zb-h1" and pp > 1:
                    continue                    # training refuses it: W would recompute
                for ep in expert_splits(config, dp):
                    layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, amp=amp, ep=ep,
                                    recompute=recompute, sp=tp > 1, tiled=tiled)
                    for m in micro_batch_counts(pp, global_batch // dp):
                        rows.append(evaluate(config, layout, cluster, seq, global_batch, m,
                                             schedule, comm, headroom, v, moe_load))
    return sorted(rows, key=lambda r: (not r["fits"], r["step"]))


def train_flags(config, row, v=1):
    """examples/train_gpt.py's flags for a search row (its layout, micro-batches, schedule;
    v: model chunks per stage under the interleaved schedule) on `config`, global batch
    row["micro_batch"] x dp x micro-batches sequences of config.block_size tokens. The
    planner's dp counts the ep ranks (ep is carved out of it), train_gpt's --dp does not."""
    if row["recompute"] == "selective":
        raise ValueError("selective recompute: examples/train_gpt.py has no flag for it")
    flags = ["--n-layer", config.n_layer, "--n-head", config.n_head, "--n-embd",
             config.n_embd, "--block-size", config.block_size, "--batch-size",
             row["micro_batch"] * row["dp"] * row["micro_batches"], "--dp", row["dp"] // row["ep"],
             "--tp", row["tp"], "--pp", row["pp"], "--cp", row["cp"], "--ep", row["ep"],
             "--zero", row["zero"], "--attention", "tiled" if row["tiled"] else "auto"]
    if config.moe_experts:
        flags += ["--moe-experts", config.moe_experts, "--moe-top-k", config.moe_top_k,
                  "--moe-every", config.moe_every]
    if row["pp"] > 1:
        interleaved = row["schedule"] == "interleaved"
        flags += ["--micro-batches", row["micro_batches"], "--schedule",
                  "1f1b" if interleaved else row["schedule"],
                  "--pp-virtual", v if interleaved else 1]
    flags += (["--sequence-parallel"] if row["sp"] else []) + (["--amp"] if row["amp"] else [])
    flags += ["--ckpt-activations"] if row["recompute"] == "full" else []
    return [str(f) for f in flags]
