"""Will the run fit? Before the model is built, the planner's bill for this run (minidist/
train/planner.py: parameters, gradients and optimizer state to the byte, activations as
minidist's graph keeps them for DDP and ZeRO, at least Korthikanti's count for TP, PP and CP:
tests/test_planner.py holds both to the runs' ledger; Korthikanti's for an MoE model too,
whose experts the graph's count has not (one process, top-k 2: 120.1 MiB for the ledger's
130.2); for DDP and ZeRO the evaluation's no-grad forward of a rank's whole batch where it
needs more; with --save or --resume the copy of the state a save or a load holds:
rank_bill, load_copy) is set beside the memory free where the ranks run
(memory_room.py): each host's (MemAvailable, less where its cgroup's limit leaves less; the
address space `ulimit -v` leaves each rank), or each GPU's. A run that cannot fit stops
here, one `error:` line naming what it needs, what is free and what needs less, instead of
a kernel's OOM kill (signal 9, no word why) or a MemoryError's traceback on every rank
minutes later; one that fits says so in its start-up lines:

    memory: 35.3 MiB a rank by the planner (parameters 3.2 MiB, gradients 3.2 MiB, optimizer
    6.4 MiB, activations 21.0 MiB, logits 0.5 MiB, buffers 0.9 MiB); the 4 ranks on this
    host: 141.0 MiB of 18.23 GiB free

The bill (run_bill.py step_bill: the same count examples/plan_memory.py prints for each
layout) is what the model's arrays hold, the step's logits and its buffers (step_buffers.py:
the optimizer's scratch, ZeRO's gradients in flight and gathered units, --ckpt-activations'
recomputed block); a gradient on its way into a DDP bucket and Python's own memory are not
in it (within a tenth of a run's live arrays: tests/test_memory_check.py), so a run near the
line may still fail later: run_main then ends it with one line too (cli.py
out_of_memory_line).
--no-memory-check starts a run whatever the count says.
Tests: tests/test_memory_check.py (the bill), tests/test_memory_room.py (the room, the runs).
"""
import argparse
import json
import math
import os

from minidist import backend
from minidist.comm.mesh import mesh_coords
from minidist.nn.config import uses_tiled
from minidist.strategy import checkpoint, checkpoint_dirs
from minidist.strategy.checkpoint_dirs import CheckpointError
from minidist.train.args import train_default
from minidist.train.cli import UsageError
from minidist.train.memory_room import address_room, where_and_room
from minidist.train.plan_args import block_flags
from minidist.train.planner import GiB, Layout
from minidist.train.run_bill import eval_bytes, graph_counted, step_bill, step_total
from minidist.train.step_buffers import kept_buffers, rank_shapes
from minidist.train.strategy import check_layout

MARGIN = 0.9                      # a run (or advice's flag) above this share of the room is
                                  # near the limit (what the bill leaves out: a tenth, at most)
ADDRESS_MARGIN = 0.75             # the same of what `ulimit -v` leaves: it counts address
# space, which grew 1.24 x the bill (RSS 0.98 x) over 2 ranks of ZeRO-3, 1.25 x (1.04) of DDP:
# glibc reserves a 64 MiB arena for each thread that allocates (the comm stream's) and keeps
# freed heap; at 0.87 of it, a run the advice called fitting ran out in its first step


def run_layout(args, world_size):
    """(planner.Layout, sequences per micro-batch, pipeline micro-batches) of the run the
    flags ask for on `world_size` ranks: dp and the micro-batch count as training's own
    check_layout (train/strategy.py) makes them (UsageError where it refuses the flags)."""
    dp, m = check_layout(args, world_size)
    rows = dp * args.ep * args.grad_accum
    recompute = "full" if args.ckpt_activations else \
        "selective" if args.attention == "recompute" else "none"
    tiled = uses_tiled(args.attention, args.block_size)
    layout = Layout(dp=dp * args.ep, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                    zero=args.zero, amp=args.amp, recompute=recompute,
                    sp=args.sequence_parallel and args.tp > 1, tiled=tiled,
                    cp_attention=args.cp_attention, zero_shard=args.zero_shard or 0,
                    overlap_gather=args.overlap_param_gather, muon=args.optimizer == "muon",
                    grad32=args.amp and args.grad_dtype == "float32")
    micro = args.batch_size // (rows * m)
    return layout, max(micro, 1), m


def rank_bill(config, args, world_size, rank, host_is_device=True, assembled=False):
    """The planner's bytes for `rank` ({"params", "grads", "optimizer", "activations",
    "logits", "buffers", "evaluation", "checkpoint", "total"}): its pipeline stage's training
    step (run_bill.py step_bill, the memory planner's row for the same layout: model states,
    activations, logits, "buffers" the step's beyond the planner's rows, step_buffers.py),
    and this run's own terms below; twice the float32 count
    under --dtype float64; --eval-only: no gradients, no optimizer state (none is built; a
    --resume reads the parameters alone; DDP and ZeRO make no gradient buffers), the
    activations a ceiling of the forward's (eval_activations', the plain forward's under TP,
    CP, PP and for an MoE model), and "build", the model's build
    (build_bytes), where it holds more. "evaluation": a training run's evaluations
    (eval_activations; 0 where there is none), between steps. "logits": the step's (B, T, V)
    logits beside the probabilities the graph keeps, on the rank holding the head (under
    --amp 16-bit and the loss's float32 copy; not counted under TP, whose head is split):
    a 4,096-token vocabulary at --batch-size 64 peaked at 671 MiB RSS for 477 counted
    without them, 605 with. "checkpoint", where the device is the host (`host_is_device`: a
    GPU's copies go to the host): the copy of the rank's state a save holds (parameters and
    optimizer, from the step's end until written: with --async-save through the next
    steps, beside their activations; else after them), a --resume's load its load_copy
    (`assembled`: the checkpoint's arrays are shards, loads_assembled); none for --init-from,
    whose weights are read a block (ZeRO-3: a unit) at a time as the model is built, before
    any gradient or optimizer state is (train/gather.py CheckpointWeights: one process, 4
    layers of 512, 213.9 MiB traced peak from a checkpoint, 213.1 from the seed; billed
    the model's float32 copy, 255.7 for 209.2). "buffers": step_buffers.py's; those a step
    frees are billed with the steps, not beside a checkpoint's copy."""
    layout, micro, m = run_layout(args, world_size)
    stage = mesh_coords(rank, layout.dp, layout.tp, layout.pp, layout.cp)[2]
    row = step_bill(config, layout, micro, args.schedule, m, args.pp_virtual, at_stage=stage,
                    cpu=host_is_device, training=not args.eval_only)
    scale = 2 if args.dtype == "float64" else 1
    row = {k: scale * row[k] for k in ("params", "grads", "optimizer", "activations",
                                       "logits", "evaluation", "buffers")}
    evaluation = eval_activations(config, args, layout)
    if args.eval_only and graph_counted(config, layout):  # no graph: the forward's ceiling
        row["activations"] = scale * evaluation
    elif args.eval_only:
        # TP, CP, PP, MoE: no graph either, and the plain forward's ceiling (every head, the
        # whole sequence and head, on the rank's rows) is above theirs, with a pipeline's
        # sends of each chunk's (rows, T, C) output (pp/stage.py _pipe_forward: the rows as
        # one micro-batch); the training graph's count (every layer) was 4.5 x a --tp 2
        # evaluation's live peak (tests/test_memory_check.py), 2.9 x a --pp 2 one's (8 layers
        # of 128, `--resume CKPT --eval-only --batch-size 64 --pp 2` under tests/scripts/
        # peak_memory.py: 171.6 MiB for 59.7, now 117.9)
        sends = args.pp_virtual * eval_rows(args, layout) * config.block_size * \
            config.n_embd * 4 if layout.pp > 1 else 0
        row["activations"] = min(row["activations"], scale * (evaluation + sends))
    copy = row["params"] + row["optimizer"] if host_is_device and args.save else 0
    if host_is_device and args.resume:
        copy = max(copy, load_copy(row, layout, assembled))
    row["checkpoint"] = copy
    # a step's own buffers are freed by its end, so a save's or a load's copy is not beside
    # them: billed with the steps (2 ranks --zero 2 --resume: 178.1 MiB for a peak of 113.1
    # when added to both); --eval-only's (ZeRO-3's gathered units, the 16-bit matmul's
    # copies) are made by the forward, after the load: with it too (2 ranks --zero 3, 4
    # layers of 512: 59.8 MiB for a peak of 57.1; 73.7 beside the load's copy)
    kept = 0 if args.eval_only else scale * kept_buffers(config, layout, stage,
                                                         v=args.pp_virtual)
    row["total"] = step_total(row, kept, copy, args.async_save and args.save)
    if args.eval_only:           # no gradients or optimizer state: the build may be larger
        row["build"] = build_bytes(config, layout, stage, scale, row["params"],
                                   args.pp_virtual)
        row["total"] = max(row["total"], row["build"])
    return row


def build_bytes(config, layout, stage, scale=1, shards=0, v=1):
    """Bytes a rank holds while its model is built (nn/gpt.py init_parameters; --init-from's
    weights read as drawn ones are): its parameters in float32 (cast to 16 bits for --amp
    only once built) and one part's numbers beside them (a block, or a root parameter:
    gpt_init's float64 normals of its largest whole parameter, made and scaled, beside the
    part's float32 numbers). ZeRO-3 builds a unit at a time on placeholders: the `shards`
    made so far (the rank's parameter bytes) and one unit's draws (and its 16-bit copy under
    --amp). Billed under --eval-only, whose state is the parameters alone: 4 layers of 512,
    the build's traced peak 81.8 MiB of one process's 81.6, billed 76.9; ZeRO-3 --amp on 2
    ranks 43.0 MiB, billed 46.3."""
    shapes = rank_shapes(config, layout, stage, v)
    parts = {}
    for name, shape, k in shapes:
        part = ".".join(name.split(".")[:3]) if name.startswith("transformer.h.") else name
        elements, largest = parts.get(part, (0, 0))
        parts[part] = (elements + k, max(largest, math.prod(shape)))
    draws = max(scale * 4 * e + 16 * n for e, n in parts.values())
    if layout.zero >= 3:
        return shards + draws + (2 * max(e for e, _ in parts.values()) if layout.amp else 0)
    return scale * 4 * sum(k for _, _, k in shapes) + draws


def load_copy(row, layout, assembled):
    """Bytes a --resume's load holds beside the rank's state (`row`) before step 1: under
    ZeRO (zero/checkpoint.py load_sharded) the shards it cuts, parameters' (ZeRO-1/2's a
    1/zero_ranks share of the model's) and optimizer's; else the rank's parameters and
    optimizer where the checkpoint holds shards that the load glues whole (`assembled`:
    strategy/readers.py read_whole), and nothing where its arrays are whole: memory-mapped,
    pages the kernel can drop (4 layers of 512, one process: 251 MiB RSS resumed, 278
    afresh; billed a copy, 355)."""
    if layout.zero:
        return row["params"] // (1 if layout.zero == 3 else layout.zero_ranks) + \
            row["optimizer"]
    return row["params"] + row["optimizer"] if assembled else 0


def loads_assembled(path):
    """load_copy's `assembled`: whether --resume `path`'s manifest is ZeRO's or TP x ZeRO's
    parts (False where it cannot be read: the load then says what is wrong)."""
    try:
        folder = checkpoint_dirs.resolve(path)
        with open(os.path.join(folder, "manifest.json")) as f:
            manifest = json.load(f)
    except (CheckpointError, OSError, ValueError):
        return False
    return isinstance(manifest, dict) and checkpoint.holds_shards(manifest)


def eval_rows(args, layout):
    """The sequences an evaluation's forward takes at once on a rank: a training
    micro-batch's, batch / (dp x --grad-accum) (loop.py evaluate's `parts`)."""
    return max(args.batch_size // (layout.dp * args.grad_accum), 1)


def eval_activations(config, args, layout):
    """run_bill.eval_bytes of the evaluation's forward on a rank, its training
    micro-batch's rows at once (eval_rows); an MoE model's too (until 2026-11-30 None: its
    --eval-only was billed the training graph's every layer)."""
    return eval_bytes(config, layout, eval_rows(args, layout))


def check_memory(args, config, group=None):
    """The start-up's `memory:` line, or UsageError on every rank (the same verdict: each
    computes it from the same gathered numbers) where the planner's bill for the ranks on a
    host or a GPU is more than it has free, or one rank's more than `ulimit -v` leaves it.
    `group`: every rank of the job (strategy.job_group(); None: one process). Collective
    over `group`."""
    where, room, free = where_and_room()
    mine = (where, room, address_room(), free)
    seen = [mine] if group is None else group.all_gather_object(mine)
    size, on_host = len(seen), backend.device() != "cuda"
    bills = job_bills(config, args, size, on_host)
    problem, line = verdict(seen, bills)
    if problem and not args.no_memory_check:
        text, per_rank, shared, margin = problem
        raise UsageError(f"{text}; "
                         f"{advice(args, config, size, per_rank, shared, on_host, margin)}, "
                         "or --no-memory-check to start anyway")
    if not problem:
        return line
    return f"{line}; {problem[0][len('memory: '):]}: --no-memory-check started it anyway"


def job_bills(config, args, size, on_host=True):
    """rank_bill of each of `size` ranks, in rank order (computed once a pipeline stage)."""
    layout, by_stage, bills = run_layout(args, size)[0], {}, []
    assembled = bool(args.resume) and loads_assembled(args.resume)
    for rank in range(size):
        stage = mesh_coords(rank, layout.dp, layout.tp, layout.pp, layout.cp)[2]
        if stage not in by_stage:
            by_stage[stage] = rank_bill(config, args, size, rank, on_host, assembled)
        bills.append(by_stage[stage])
    return bills


def verdict(seen, bills):
    """(the problem or None, the `memory:` line) of the ranks' (where, room, address room,
    whether room is free memory or all there is) `seen` and their planner bills, in rank
    order. The line names the largest rank's bill and the place (host or GPU) whose ranks
    need the largest share of its room. A problem is (its text, the bytes a rank may have
    there, whether ranks share them: a host's or GPU's memory, not each its `ulimit -v`, the
    share of them a run may fill: MARGIN, ADDRESS_MARGIN of an address space)."""
    places = {}
    for rank, (where, room, _, free) in enumerate(seen):
        ranks, rooms = places.setdefault(where, ([], []))
        ranks.append(rank)
        rooms.append((room, free))
    tightest, ratio = None, -1.0
    for where, (ranks, rooms) in places.items():
        need = sum(bills[r]["total"] for r in ranks)
        room, free = min(((r, f) for r, f in rooms if r is not None), default=(None, True))
        share = need / max(room, 1) if room is not None else 0.0
        if share > ratio:
            tightest, ratio = (where, ranks, need, room, free), share
    top = max(bills, key=lambda b: b["total"])
    parts = ", ".join(f"{name} {size_text(top[key])}" for name, key in (
        ("parameters", "params"), ("gradients", "grads"), ("optimizer", "optimizer"),
        ("activations", "activations"), ("logits", "logits"), ("buffers", "buffers"),
        ("evaluation", "evaluation"), ("checkpoint", "checkpoint"), ("build", "build"))
        if key not in ("logits", "buffers", "evaluation", "checkpoint", "build") or
        top.get(key, 0) > (top["activations"] + top["logits"] if key == "evaluation" else 0))
    where, ranks, need, room, free = tightest
    what = _place_text(where, ranks, len(places), len({w[0] for w in places}))
    has = "free" if free else "of memory in all (no count of free memory here)"
    line = f"memory: {size_text(top['total'])} a rank by the planner ({parts})"
    if room is not None:
        line += f"; {what}: {size_text(need)} of {size_text(room)} {has}"
    if room is not None and need > room:
        return (f"memory: {what} need {size_text(need)} by the planner's count (the largest "
                f"rank {size_text(top['total'])}: {parts}) but there is {size_text(room)} "
                f"{has} there", room / len(ranks), len(ranks) > 1, MARGIN), line
    for rank, (_, _, address, _) in enumerate(seen):
        if address is not None and bills[rank]["total"] > address:
            who = f"rank {rank} needs" if len(seen) > 1 else "the run needs"
            return (f"memory: {who} {size_text(bills[rank]['total'])} by the "
                    f"planner's count but `ulimit -v` leaves it {size_text(address)} of "
                    "address space", address, False, ADDRESS_MARGIN), line
    address = min((a for _, _, a, _ in seen if a is not None), default=None)
    if address is not None:                         # (a limit the host's count does not show)
        line += f"; `ulimit -v` leaves a rank {size_text(address)} of address space"
    if any(a is not None and b["total"] > ADDRESS_MARGIN * a
           for (_, _, a, _), b in zip(seen, bills)):
        line += " (near the limit: `ulimit -v` counts the address space malloc reserves too)"
    elif ratio > MARGIN:
        line += " (near the limit: Python's own memory is not in the count)"
    return None, line


def size_text(n):
    """Bytes as people read them: "3.21 GiB", "842.0 MiB"."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"


def _place_text(where, ranks, n_places, n_hosts):
    here = "this host" if n_hosts == 1 else f"host {where[0]}"
    if len(where) > 1:
        here = f"the GPU {where[1]} on {here}"
    return (f"the {len(ranks)} ranks on {here}" if len(ranks) > 1 else
            f"rank {ranks[0]} on {here}" if n_places > 1 else f"the run on {here}")


def zero3_way(args):
    """(the advice's text, the flags' change) for --zero 3: DDP's own flags given (--ddp,
    --bucket-mb, which training refuses under ZeRO) go with it, and the text says so (the
    walk found --zero 3 left out of the advice whenever --bucket-mb was given)."""
    ddp = [f for f in ("ddp", "bucket_mb") if getattr(args, f) != train_default(f)]
    text = "--zero 3" + (" (without " + " and ".join("--" + f.replace("_", "-") for f in ddp)
                         + ")" if ddp else "")
    return text, dict(zero=3, **{f: train_default(f) for f in ddp})


def advice(args, config, size, per_rank, shared=True, on_host=True, margin=MARGIN):
    """What needs less: each flag the run could add (that training takes with the others:
    train/strategy.py check_layout) priced again, those that alone bring every rank within
    `margin` of `per_rank` bytes named as fitting (Python's own memory is not in the
    count: `--dtype float64 --grad-accum 2` at 1.27 GiB for 1.27 ran out; ADDRESS_MARGIN
    where `per_rank` is what `ulimit -v` leaves), those that only need less after them; a
    smaller batch or sequence; fewer ranks a host where they `shared` the memory; then the
    planner's command for this run on `size` ranks of `per_rank` bytes each
    (plan_command)."""
    layout, micro, _ = run_layout(args, size)
    ways = [zero3_way(args)] if layout.dp * layout.cp > 1 and args.zero < 3 else []
    ways += [] if args.amp else [("--amp", dict(amp=True))]
    ways += [] if args.ckpt_activations else [("--ckpt-activations",
                                               dict(ckpt_activations=True))]
    split = min((k for k in range(2, micro + 1) if micro % k == 0), default=None)
    ways += [(f"--grad-accum {split * args.grad_accum} (the same batch in smaller parts)",
              dict(grad_accum=split * args.grad_accum))] if args.pp == 1 and split else []
    now = max(b["total"] for b in job_bills(config, args, size, on_host))
    fits, less = [], []
    for text, change in ways:
        other = argparse.Namespace(**{**vars(args), **change})
        try:
            check_layout(other, size)
        except UsageError:
            continue                                     # training would refuse it here
        need = max(b["total"] for b in job_bills(config, other, size, on_host))
        if need <= margin * per_rank:
            fits.append(text)
        elif need < now:
            less.append(text)
    said = [" or ".join(fits) + (" fits" if len(fits) == 1 else " each fit") +
            " by the planner's count"] if fits else []
    less += ["a smaller --batch-size or --block-size"] + (["fewer ranks a host"] if shared
                                                          else [])
    return "; ".join(said + [", ".join(less) + " need less"]) + \
        f" ({plan_command(args, config, size, per_rank, margin)} prices each layout)"


def plan_command(args, config, size, per_rank, margin=MARGIN):
    """The memory planner's command (examples/plan_memory.py) for this run's model (its
    block, grouped-query heads, MLP width, experts, dropout), optimizer and gradient dtype
    on `size` GPUs of `per_rank` bytes, the same share of them kept free (--headroom), and
    as many tokens a rank as the run holds: its micro-batch of whole sequences, or under
    --cp, whose ranks hold T/cp of each sequence's tokens, micro / cp of them (rounded up;
    the command priced cp x the run's tokens, and a dense GPT-2 of the same width for a
    Llama or MoE run, until 2026-11-30)."""
    layout, micro, _ = run_layout(args, size)
    words = ["python examples/plan_memory.py", "--n-layer", config.n_layer, "--n-head",
             config.n_head, "--n-embd", config.n_embd, "--vocab-size", config.vocab_size,
             "--seq", config.block_size]
    words += block_flags(config)
    words += ["--dropout"] if config.dropout > 0 else []
    words += ["--optimizer", "muon"] if args.optimizer == "muon" else []
    words += ["--grad-dtype", "float32"] if layout.grad32 else []
    words += ["--micro-batch", -(-micro // layout.cp), "--gpus", size, "--gpu-mem",
              f"{per_rank / GiB:.2g}"]
    words += ["--headroom", f"{1 - margin:g}"] if margin != MARGIN else []
    return " ".join(str(w) for w in words)
