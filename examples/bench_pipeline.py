"""Pipeline schedules measured: activation memory per stage (the memory ledger) and the bubble
from the trace next to its formula (minidist/pp/schedule.py bubble_fraction), for GPipe, 1F1B,
interleaved 1F1B (`1f1b-v2`: --pp-virtual 2) and ZB-H1.

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
"""
import argparse
import json
import statistics
import time
import tracemalloc

import numpy as np

from minidist import backend
from minidist import comm as minidist_comm
from minidist.comm import trace
from mpi4py import MPI   # after minidist.comm: MPI starts in comm.init(), not on import
from minidist.nn import GPTConfig
from minidist.pp.schedule import bubble_fraction, measured_bubble
from minidist.train.args import add_model_args, train_parser
from minidist.train.step import train_step
from minidist.train.strategy import make_strategy


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


def run(cli, name, m, comm, world):
    schedule, _, virtual = name.partition("-v")               # "1f1b-v2": interleaved
    v = int(virtual) if virtual else 1
    flags = ["--pp", str(comm.size), "--micro-batches", str(m), "--schedule", schedule,
             "--pp-virtual", str(v),
             "--n-layer", str(cli.n_layer), "--n-head", str(cli.n_head), "--n-embd",
             str(cli.n_embd), "--block-size", str(cli.block_size), "--batch-size",
             str(cli.batch_size), "--lr", "1e-3"]
    args = train_parser().parse_args(flags)
    config = GPTConfig(n_layer=cli.n_layer, n_head=cli.n_head, n_embd=cli.n_embd,
                       block_size=cli.block_size, vocab_size=cli.vocab_size)
    strategy = make_strategy(args, world)
    model = strategy.build_model(config, 0, "float32")
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
    p = add_model_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--micro-batches", default="1,2,4,8,16")
    p.add_argument("--schedules", default="gpipe,1f1b,1f1b-v2,zb-h1",
                   help="1f1b-vN: interleaved 1F1B with N chunks per rank (--pp-virtual N)")
    p.add_argument("--steps", type=int, default=5)
    p.set_defaults(batch_size=32)
    cli = p.parse_args()
    backend.setup(threads=None, device="cpu")   # cores on this node // ranks on it
    world = minidist_comm.init("ring")    # MPI_Init, abort hooks, watchdog
    comm = MPI.COMM_WORLD
    for m in map(int, cli.micro_batches.split(",")):
        for schedule in cli.schedules.split(","):
            if "-v" in schedule and m % comm.size:
                continue                   # interleaving needs m a multiple of pp
            row = run(cli, schedule, m, comm, world)
            if comm.rank == 0:
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
