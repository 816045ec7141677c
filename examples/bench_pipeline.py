"""Pipeline schedules measured: activation memory per stage (the memory ledger) and the bubble
from the trace next to its formula (minidist/pp/schedule.py bubble_fraction), for GPipe, 1F1B,
interleaved 1F1B (`1f1b-v2`: --pp-virtual 2) and ZB-H1; one MPI process per stage.

    mpiexec -n 2 python examples/bench_pipeline.py --micro-batches 1,2,4,8,16
    mpiexec -n 4 python examples/bench_pipeline.py --micro-batches 4,8,16 --n-layer 8
    mpiexec -n 4 python examples/bench_pipeline.py --n-layer 8 --micro-batches 8 \
        --schedules gpipe,1f1b,1f1b-v2,zb-h1

For each schedule and micro-batch count M, through the training loop's own train_step:
one step with the ledger on (the most activation bytes each stage held at once, over every
micro-batch in flight), then --steps traced steps: each rank's compute events (F3, B3) give
its idle share of the step's window, from the first micro-batch's start to the last one's
end over all stages (schedule.measured_bubble); the median over steps is reported. Rank 0
prints one JSON line per (schedule, M): {"schedule", "virtual", "pp", "micro_batches",
"rows_per_micro", "in_flight", "activation_mib", "mib_per_micro",
"ledger_act_plus_grads_mib", "traced_peak_mib", "bubble",
"bubble_per_stage", "bubble_theory", "bubble_theory_measured_times", "t_f_b_w_ms",
"bubble_unequal_stages", "ms_per_step"}. bubble_theory is bubble_fraction with equal F, B
and W times (the simulator's pictures); bubble_theory_measured_times puts in the mean F, B, W
times measured here (it matters for ZB-H1 only); bubble_unequal_stages is what the stages'
measured compute times imply for GPipe and 1F1B with free messages (sum(t_s) +
(m-1) max(t_s) per step), so the rest of the gap to the measurement is communication and
waiting. in_flight counts chunk-micro-batches under interleaving; mib_per_micro is the
ledger's bytes over them. Memory, per rank: activation_mib is the ledger's peak of what the
in-flight micro-batches keep (step 0); traced_peak_mib is what tracemalloc measured for one
more step (the most bytes numpy held at once beyond those held before the step), to set
beside the ledger's activations + gradients (ledger_act_plus_grads_mib): the difference is
the ops' transient buffers.
More ranks than cores stretch every stage's compute while others compute too, which hides
idle time: measure with one core per rank.
Everything is checked before the first step: a default schedule or M that this model, batch
or rank count cannot run is skipped with one `note:` line on stderr (stdout stays JSON lines);
one given by --schedules or --micro-batches is one `error:` line, exit 2. Tested by
tests/test_pipeline_train.py (test_bench_pipeline_*).
"""
import json
import statistics
import sys
import time
import tracemalloc

import numpy as np

from minidist import backend
from minidist import comm as minidist_comm
from minidist.comm import trace
from mpi4py import MPI   # after minidist.comm: MPI starts in comm.init(), not on import
from minidist.nn import GPTConfig
from minidist.launcher import launcher_rank, world_size_from_env
from minidist.pp.schedule import SCHEDULES, bubble_fraction, measured_bubble
from minidist.pp.strategy import pp_problems
from minidist.train.args import add_model_args, arch_fields, train_parser
from minidist.train.cli import UsageError, check_flags
from minidist.train.loop import moe_fields
from minidist.train.step import train_step
from minidist.train.strategy import check_layout, make_strategy
from minidist.train.args import example_parser

DEFAULT_MICRO_BATCHES = "1,2,4,8,16"
DEFAULT_SCHEDULES = "gpipe,1f1b,1f1b-v2,zb-h1"


def batch(step, rows, config):
    x = np.random.default_rng([1, step]).integers(0, config.vocab_size,
                                                   (rows, config.block_size))
    return x, np.roll(x, -1, axis=1)


def bubble_model(events_by_rank, m):
    """The bubble the stages' own measured compute implies if messages were free: stage s
    busy t_s per micro-batch (its F + B time), a step lasting sum(t_s) + (m-1) max(t_s)."""
    t = [sum(e["end"] - e["start"] for e in events if e["group"] == "compute") / m
         for events in events_by_rank]
    step = sum(t) + (m - 1) * max(t)
    return sum(1 - m * ts / step for ts in t) / len(t)


def event_times(events_by_rank):
    """Mean F, B (whole backward, or B of a split one) and W durations in ms, over ranks."""
    out = []
    for kind in "FBW":
        d = [e["end"] - e["start"] for events in events_by_rank for e in events
             if e["group"] == "compute" and e["op"].startswith(kind)]
        out.append(1e3 * sum(d) / len(d) if d else 0.0)
    return out


def traced_peak(strategy, model, opt, x, y, args):
    """The most bytes held at once during one step beyond those held before it, as
    tracemalloc sees them (numpy reports every array's allocation to it): the in-flight
    activations, the gradients and every op's transient buffers. A measurement independent
    of the ledger, which counts only what the in-flight graphs keep."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    train_step(strategy, model, opt, x, y, args)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak


def model_flags(cli):
    """The model flags given to this script, as train_gpt.py takes them (every one is used:
    the model, its dropout, attention and MoE, the dtype and seed)."""
    flags = ["--n-layer", cli.n_layer, "--n-head", cli.n_head, "--n-embd", cli.n_embd,
             "--block-size", cli.block_size, "--batch-size", cli.batch_size,
             "--dropout", cli.dropout, "--attention", cli.attention,
             "--attention-block", cli.attention_block, "--dtype", cli.dtype,
             "--seed", cli.seed, "--moe-experts", cli.moe_experts]
    if cli.moe_experts:
        flags += ["--moe-top-k", cli.moe_top_k, "--moe-capacity-factor",
                  cli.moe_capacity_factor, "--moe-aux-loss-coef", cli.moe_aux_loss_coef,
                  "--moe-z-loss-coef", cli.moe_z_loss_coef, "--moe-every", cli.moe_every,
                  "--moe-shared", cli.moe_shared]
    defaults = GPTConfig()                  # the block's fields where not GPT-2's defaults
    flags += [f for name, value in arch_fields(cli).items()
              if name != "bias" and value != getattr(defaults, name)      # (--no-bias below)
              for f in ("--" + name.replace("_", "-"), value)]
    return [str(f) for f in flags] + ([] if cli.bias else ["--no-bias"])


def train_args(cli, name, m, pp):
    """train_gpt.py's flags for schedule `name` ("1f1b-v2": interleaved) with m micro-batches
    over pp stages."""
    schedule, _, virtual = name.partition("-v")
    flags = ["--pp", str(pp), "--micro-batches", str(m), "--schedule", schedule,
             "--pp-virtual", virtual or "1", *model_flags(cli), "--lr", "1e-3"]
    return train_parser().parse_args(flags)


def micro_batch_counts(p, cli, size, notes):
    """The Ms to run, checked before MPI starts (a late UsageError would abort the job after
    some rows): 2 or more ranks, the model over `size` stages, and an M given by
    --micro-batches must fit; a default M that does not split --batch-size is skipped, with a
    note."""
    asked = cli.micro_batches is not None
    text = cli.micro_batches if asked else DEFAULT_MICRO_BATCHES
    if not all(m.isdigit() and int(m) > 0 for m in text.split(",")):
        p.error(f"--micro-batches {text}: give positive counts, comma-separated")
    if size < 2:
        p.error("one process: run the stages on 2 or more ranks (mpiexec -n 2 python ...)")
    if size > cli.n_layer:      # (train_gpt's message would name a --pp this script lacks)
        p.error(f"{size} processes for --n-layer {cli.n_layer} blocks: each process is a "
                f"stage of at least one block; run it with mpiexec -n {cli.n_layer} or fewer, "
                "or give more --n-layer")
    if cli.steps < 1:
        p.error(f"--steps {cli.steps}: time at least 1 step")
    ms = []
    for m in map(int, text.split(",")):
        try:
            args = train_args(cli, "gpipe", m, size)
            check_flags(args)
            check_layout(args, size)
            ms.append(m)
        except UsageError as e:
            if asked or m == 1:                # M = 1 always splits: the model does not fit
                p.error(str(e))
            notes.append(f"skipped --micro-batches {m}: {e}")
    return ms


def schedule_names(p, cli):
    """--schedules (or the default), each name checked."""
    names = (cli.schedules if cli.schedules is not None else DEFAULT_SCHEDULES).split(",")
    for name in names:
        schedule, _, virtual = name.partition("-v")
        if schedule not in SCHEDULES or not (virtual.isdigit() or name == schedule):
            p.error(f"--schedules {name!r}: choose from {', '.join(SCHEDULES)} or 1f1b-vN "
                    "(N chunks per rank)")
    return names


def schedule_runs(p, cli, names, ms, size, notes):
    """{schedule: the Ms it runs with}. A schedule given by --schedules must suit the model
    and every M; a default one that does not (1f1b-v2 on 2 blocks over 2 stages) is skipped
    where it does not, with a note."""
    runs = {}
    for name in names:
        why = {m: pp_problems(train_args(cli, name, m, size), m) for m in ms}
        bad = [str(m) for m in ms if why[m]]
        problems = "; ".join(dict.fromkeys(sum(why.values(), [])))
        if bad and cli.schedules is not None:
            p.error(f"--schedules {name}: {problems}")
        if bad:
            notes.append(f"skipped {name} at --micro-batches {','.join(bad)}: {problems}")
        runs[name] = [m for m in ms if not why[m]]
    return runs


def run(cli, name, m, comm, world):
    args = train_args(cli, name, m, comm.size)
    schedule, v = args.schedule, args.pp_virtual
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       block_size=args.block_size, vocab_size=cli.vocab_size,
                       dropout=args.dropout, attention=args.attention,
                       attention_block=args.attention_block, **arch_fields(args),
                       **moe_fields(args))
    strategy = make_strategy(args, world)
    model = strategy.build_model(config, args.seed, args.dtype)
    opt = strategy.build_optimizer(model, args)
    args.log_json = "measure"                          # step 0: the ledger's activations
    mem = train_step(strategy, model, opt, *batch(0, args.batch_size, config), args)[2]
    args.log_json = None
    peak = traced_peak(strategy, model, opt, *batch(0, args.batch_size, config), args)
    bubbles, per_stage, ms, times = [], [], [], []
    trace.enable()
    for step in range(1, cli.steps + 1):
        trace.clear_events()
        comm.Barrier()
        t0 = time.perf_counter()
        train_step(strategy, model, opt, *batch(step, args.batch_size, config), args)
        ms.append((time.perf_counter() - t0) * 1e3)
        events = comm.allgather(trace.events())
        b, rows = measured_bubble(events)
        bubbles.append(b)
        per_stage.append((rows, bubble_model(events, m)))
        times.append(event_times(events))
    trace.disable()
    k = bubbles.index(statistics.median_low(bubbles))
    rows, model_bubble = per_stage[k]
    t_f, t_b, t_w = times[k]
    if schedule != "zb-h1":              # a whole backward's time is B + W
        t_b, t_w = t_b / 2, t_b / 2
    in_flight = comm.gather(strategy.stats["in_flight"], root=0)
    mib = comm.gather(mem["activations"] / 2**20, root=0)
    p = comm.size
    return {"schedule": schedule, "virtual": v, "pp": p, "micro_batches": m,
            "rows_per_micro": args.batch_size // m, "in_flight": in_flight,
            "activation_mib": mib and [round(x, 2) for x in mib],
            "mib_per_micro": mib and [round(x / n, 2) for x, n in zip(mib, in_flight)],
            "ledger_act_plus_grads_mib": comm.gather(
                round((mem["activations"] + mem["grads"]) / 2**20, 2), root=0),
            "traced_peak_mib": comm.gather(round(peak / 2**20, 2), root=0),
            "bubble": round(bubbles[k], 3), "bubble_per_stage": [round(b, 3) for b in rows],
            "bubble_theory": round(bubble_fraction(schedule, p, m, v), 3),
            "bubble_theory_measured_times": round(bubble_fraction(schedule, p, m, v, t_f, t_b,
                                                                  t_w), 3),
            "t_f_b_w_ms": [round(t, 2) for t in times[k]],
            "bubble_unequal_stages": (round(model_bubble, 3) if v == 1 and schedule != "zb-h1"
                                      else None),
            "ms_per_step": round(statistics.median(ms), 1)}


def main():
    host_clock = "this benchmark times the stages on the host clock, so it runs on CPUs"
    p = add_model_args(example_parser(__doc__, cpu_only=host_clock))  # errors: rank 0 only
    p.add_argument("--vocab-size", type=int, default=256, help="the random tokens' vocabulary")
    p.add_argument("--micro-batches", default=None,
                   help=f"comma-separated. Default: {DEFAULT_MICRO_BATCHES}, skipping those "
                   "that do not split --batch-size")
    p.add_argument("--schedules", default=None,
                   help=f"comma-separated, from {', '.join(SCHEDULES)}; 1f1b-vN: interleaved "
                   f"1F1B with N chunks per rank (--pp-virtual N). Default: {DEFAULT_SCHEDULES}"
                   ", skipping those the model or --micro-batches cannot run")
    p.add_argument("--steps", type=int, default=5,
                   help="traced steps per schedule and M; the median bubble counts")
    p.set_defaults(batch_size=32)
    cli = p.parse_args()
    size, notes = world_size_from_env(), []      # before MPI starts: errors exit cleanly
    names = schedule_names(p, cli)
    ms = micro_batch_counts(p, cli, size, notes)
    runs = schedule_runs(p, cli, names, ms, size, notes)
    if launcher_rank() == 0:
        for text in notes:                       # on stderr: stdout stays JSON lines
            print(f"note: {text}", file=sys.stderr, flush=True)
    backend.setup(threads=None, device="cpu")   # cores on this node // ranks on it
    world = minidist_comm.init("ring")    # MPI_Init, abort hooks, watchdog
    comm = MPI.COMM_WORLD
    for m in ms:
        for schedule in runs:
            if m not in runs[schedule]:
                continue                   # its note said why
            row = run(cli, schedule, m, comm, world)
            if comm.rank == 0:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
