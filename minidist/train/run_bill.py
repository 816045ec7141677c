"""A training step's bill on one rank, written once for the two that price it: the start-up's
memory check (minidist/train/memory_check.py rank_bill, which adds a run's own terms: --dtype
float64, --eval-only, a save's or a load's copy) and the memory planner's table (plan below:
examples/plan_memory.py, where every refusal of the check points). On a layout both price,
the planner's row is the check's for the same run on GPUs, byte for byte; until 2026-11-30
the planner priced neither the step's logits nor its buffers, and Korthikanti's activations
where the check bills minidist's graph, so it called layouts fitting that the check refused.

The bill: planner.bill's model states and activations (minidist's graph count for DDP and
ZeRO of a dense model, what the ledger holds: tests/test_planner.py; Korthikanti's
elsewhere, a floor of the graph's), the step's (B, T, V) logits beside the probabilities the
graph keeps (logits_bytes), the step's buffers (step_buffers.py), and a training run's
evaluation forward where it holds more than the step (eval_bytes).
Tests: tests/test_plan_check.py (the planner's row is the check's), tests/test_memory_check.py.
"""
from dataclasses import asdict, replace

from minidist.train.activations import minidist_activation_bytes, moe_block_extra
from minidist.train.planner import GiB, bill, candidates, stage_params
from minidist.train.step_buffers import step_buffers


def graph_counted(config, layout):
    """Whether the activations are billed as minidist's graph keeps them (DDP and ZeRO of a
    dense model: held to the ledger) rather than by Korthikanti's count (TP, PP, CP, EP, an
    MoE model: what the graph's count does not cover)."""
    return layout.tp == layout.pp == layout.cp == layout.ep == 1 and not config.moe_experts


def logits_bytes(config, layout, stage, micro):
    """The step's (B, T, V) logits beside the probabilities the graph keeps, on the rank
    holding the head (the last stage): float32, or under --amp 16-bit and the loss's float32
    copy; none under TP, whose head is split (a 4,096-token vocabulary at --batch-size 64
    peaked at 671 MiB RSS for 477 counted without them, 605 with)."""
    if stage != layout.pp - 1 or layout.tp > 1:
        return 0
    return (6 if layout.amp else 4) * micro * config.block_size // layout.cp * \
        config.vocab_size


def eval_bytes(config, layout, rows):
    """Bytes the evaluation's forward (loop.py evaluate, under no_grad) holds at most on a
    rank taking `rows` sequences at once: one block's worth of what a graph keeps (no graph:
    each block's values go as the next runs; untiled, the (T, T) causal bias its scores add),
    and at the head the logits (under --amp, 16-bit, and the loss's float32 copy of them)
    beside the probabilities that count has (tracemalloc of such forwards, and an --amp
    run's peak RSS: tests/test_memory_check.py). The whole model on a rank: the plain
    forward's (TP, CP and PP run a part of it). An MoE model's largest block is an MoE one:
    activations.moe_block_extra's more, on the whole sequence (--eval-only of 4 layers of
    128, 4 experts top-2, 32 rows: billed 249.5 MiB, every layer's training count, for a
    live peak of 36.8 MiB; now 79.5; under --ep 2 125.4, now 40.4, for 28.3)."""
    one = minidist_activation_bytes(replace(config, n_layer=1, moe_experts=0),  # (a dense
                                    config.block_size, rows, layout.amp,       # one's count)
                                    dropout=False, tiled=layout.tiled)
    if any(config.is_moe(i) for i in range(config.n_layer)):
        one += moe_block_extra(config, replace(layout, tp=1, sp=False, cp=1),
                               config.block_size, rows, 2 if layout.amp else 4)
    T = config.block_size
    bias = 0 if layout.tiled else 4 * T * T               # the (T, T) causal bias beside P
    logits = 6 if layout.amp else 4          # (--amp: 16-bit logits and their float32 copy)
    return int(one) + bias + logits * rows * T * config.vocab_size


def step_total(row, kept=0, copy=0, beside=False):
    """A rank's total of its bill's `row`: the model states and the buffers `kept` for the
    run (step_buffers.kept_buffers), then in turn the step (its activations and logits, or
    the evaluation's forward, whichever holds more, and the step's own buffers) and a
    checkpoint's `copy` of the state, or both at once where they are `beside` each other
    (--async-save)."""
    state = row["params"] + row["grads"] + row["optimizer"] + kept
    steps = max(row["activations"] + row["logits"], row["evaluation"]) + \
        row["buffers"] - kept
    return state + (steps + copy if beside else max(steps, copy))


def step_bill(config, layout, micro, schedule="1f1b", micro_batches=None, v=1,
              at_stage=None, cpu=False, dropout=None, training=True):
    """{"params", "grads", "optimizer", "activations", "logits", "buffers", "evaluation",
    "total", "stage"} of a rank of pipeline stage `at_stage` (None: the stage whose total is
    largest), `micro` sequences of config.block_size tokens a micro-batch; schedule,
    micro_batches, v: the pipeline's (planner.bill). `cpu`: the device is the host (numpy's
    16-bit matmul copies, step_buffers). dropout None: the config's for the graph's count
    and a recomputed block's masks, none for Korthikanti's (its floor). Not `training`
    (--eval-only): no gradients, optimizer state, logits kept for a backward, nor
    training's buffers (step_buffers)."""
    graph = graph_counted(config, layout)
    rows = []
    for stage in range(layout.pp) if at_stage is None else [at_stage]:
        row = bill(config, layout, config.block_size, micro,
                   (None if graph else False) if dropout is None else dropout,
                   "minidist" if graph else "korthikanti", schedule, micro_batches, v,
                   at_stage=stage)
        row = {k: row[k] for k in ("params", "grads", "optimizer", "activations")}
        if not training:
            row.update(grads=0, optimizer=0)
        row["logits"] = logits_bytes(config, layout, stage, micro) if training else 0
        row["evaluation"] = eval_bytes(config, layout, micro) if graph and training else 0
        masks = config.dropout > 0 if dropout is None else bool(dropout)   # (recomputed)
        row["buffers"] = step_buffers(config, layout, stage, micro, dropout=masks,
                                      training=training, cpu=cpu, v=v)
        row["total"] = step_total(row)
        row["stage"] = stage
        rows.append(row)
    return max(rows, key=lambda r: r["total"])


def plan(config, gpus, gpu_mem_gib=80.0, seq=None, micro_batch=1, gpus_per_node=8,
         headroom=0.1, muon=False, grad32=False):
    """Every candidate's (planner.candidates) per-rank bill (step_bill on GPUs: what the
    start-up's check bills that layout's run), whether it fits in (1 - headroom) x gpu
    memory, and the first that fits (None if none does); `muon`: with --optimizer muon;
    `grad32`: the mixed-precision rows with --grad-dtype float32."""
    seq = seq or config.block_size
    config = replace(config, block_size=seq)
    budget = gpu_mem_gib * GiB * (1 - headroom)
    rows = []
    for layout in candidates(config, gpus, gpus_per_node, seq, muon, grad32):
        row = {"layout": layout.name(), **asdict(layout),
               **step_bill(config, layout, micro_batch)}
        row["fits"] = row["total"] <= budget
        rows.append(row)
    best = next((r["layout"] for r in rows if r["fits"]), None)
    return {"config": config.to_dict(), "params": sum(stage_params(config)),
            "gpus": gpus, "seq": seq, "micro_batch": micro_batch,
            "optimizer": "muon" if muon else "adamw",
            "budget_bytes": int(budget), "rows": rows, "recommendation": best}
