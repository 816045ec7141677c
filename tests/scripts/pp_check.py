"""Pipeline parallelism against one process, float64, in one mpiexec run.

    mpiexec -n 2 python tests/scripts/pp_check.py             # pp 2: M 1, 2, 8 x 4 schedules
    mpiexec -n 4 python tests/scripts/pp_check.py             # pp 4, pp 2 x dp 2, + ckpt
    mpiexec -n 8 python tests/scripts/pp_check.py             # dp 2 x tp 2 x pp 2 (3-D)
    mpiexec -n 4 python tests/scripts/pp_check.py --runs pp4-m8-gpipe,pp4-m8-1f1b
    mpiexec -n 4 python tests/scripts/pp_check.py --n-layer 8 --runs pp4-m8-v2-1f1b,pp4-m4-zbh1
    mpiexec -n 4 python tests/scripts/pp_check.py --n-layer 8 --runs pp2-dp2-m4-zbh1-z3 \
        --files pp2-dp2-m4-zbh1-z3                         # ZeRO-3 across pipelines
    VERBOSE=1 mpiexec -n 2 python tests/scripts/pp_check.py --runs pp2-m2-1f1b --steps 1

A run's name lists its flags: pp2, dp2, tp2 (sizes), m4 (--micro-batches), ga2 (--grad-accum),
gpipe, 1f1b or zbh1 (--schedule), v2 (--pp-virtual 2: interleaved 1F1B), sp
(--sequence-parallel), ckpt (--ckpt-activations), z1, z2, z3 (--zero k: ZeRO-k across the
pipelines instead of DDP), zs1 (--zero-shard 1: hybrid sharding, each shard group one rank),
b16k (--bucket-mb 1/64: DDP buckets of 16 KiB, several per stage).
Every rank also trains the single-process reference (SingleProcess, the whole global batch,
clipping at 0.05 so every step clips); each run builds its strategy from train_gpt's own flags
(make_strategy) and trains through the loop's train_step, measuring activations. Checks: losses,
grad norms and every parameter equal to the reference to --tol; the tied wte bitwise equal on
the first and the last stage; each stage's peak micro-batches in flight = what the schedule's
simulation (minidist/pp/simulate.py) holds on that stage; GPipe, 1F1B, interleaved 1F1B and
ZB-H1 runs of the same sizes bitwise equal (interleaved ones among themselves); with dp > 1,
how many all-reduces over the data-parallel groups (DDP's buckets, hybrid ZeRO's across the
replicas) each step issued from backward's hooks, before sync_grads began to wait
("in_backward", the fewest over the steps, and "buckets", DDP's per stage); for the --files
runs, the checkpoint (one process loads the whole model and Adam state: the reference's; a fresh
pipeline run loads its parts back, bitwise). Rank 0 prints `RESULT {json}` per run for
tests/test_pipeline.py; any failure raises and the abort handler ends the job.
"""
import argparse
import json
import os
import re
import tempfile
import warnings
import zlib

import numpy as np

from minidist import backend
import minidist.comm
from mpi4py import MPI  # after minidist.comm: MPI starts in comm.init(), not here
from minidist.nn import GPTConfig
from minidist.pp import checkpoint as pp_checkpoint
from minidist.pp.simulate import simulate
from minidist.strategy import checkpoint
from minidist.train.args import train_parser
from minidist.train.step import train_step
from minidist.comm import ProcessGroup, trace  # noqa: E402
from minidist.ddp.strategy import DataParallel
from minidist.strategy.base import SingleProcess
from minidist.train.strategy import make_strategy
# (exact: tests/scripts, the script's folder)
from exact import (check_tied_copies, issued_before_waits, max_abs,  # noqa: E402
                   worst_over_ranks)

CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=30)
SEED = 7
DEFAULT_RUNS = {
    2: "pp2-m1-1f1b,pp2-m2-1f1b,pp2-m2-gpipe,pp2-m8-1f1b,pp2-m8-gpipe,pp2-m2-ga2-1f1b,"
       "pp2-m2-v2-1f1b,pp2-m8-v2-1f1b,pp2-m1-zbh1,pp2-m8-zbh1,pp2-m4-ga2-zbh1",
    4: "pp4-m2-1f1b,pp4-m8-1f1b,pp4-m8-gpipe,pp4-m8-zbh1,pp2-dp2-m4-1f1b,"
       "pp2-dp2-m2-ga2-1f1b,pp2-dp2-m2-gpipe-ckpt,pp2-dp2-m4-v2-1f1b-ckpt-b16k,"
       "pp2-dp2-m4-zbh1-b16k",
    8: "dp2-tp2-pp2-m2-1f1b,dp2-tp2-pp2-m4-gpipe-sp,dp2-tp2-pp2-m2-v2-1f1b,"
       "dp2-tp2-pp2-m4-zbh1-sp"}


def flags(name, steps):
    """train_gpt's flags for run `name` (see the module docstring)."""
    tokens = name.split("-")
    extra = []
    for t in tokens:
        size = re.fullmatch(r"(dp|tp|pp|m|ga)(\d+)", t)
        if size:
            key = {"m": "--micro-batches", "ga": "--grad-accum"}.get(size[1], f"--{size[1]}")
            extra += [key, size[2]]
        elif t in ("gpipe", "1f1b"):
            extra += ["--schedule", t]
        elif t == "zbh1":
            extra += ["--schedule", "zb-h1"]
        elif t == "v2":
            extra += ["--pp-virtual", "2"]
        elif t == "sp":
            extra += ["--sequence-parallel"]
        elif t == "ckpt":
            extra += ["--ckpt-activations"]
        elif re.fullmatch(r"z[123]", t):
            extra += ["--zero", t[1]]
        elif re.fullmatch(r"zs\d+", t):
            extra += ["--zero-shard", t[2:]]
        elif t == "b16k":
            extra += ["--bucket-mb", str(1 / 64)]
        else:
            raise ValueError(f"unknown run token {t!r} in {name!r}")
    c = CONFIG
    args = train_parser().parse_args([
        "--n-layer", str(c.n_layer), "--n-head", str(c.n_head), "--n-embd", str(c.n_embd),
        "--block-size", str(c.block_size), "--dropout", "0", "--batch-size", "8",
        "--steps", str(steps), "--lr", "1e-2", "--grad-clip", "0.05", "--dtype", "float64",
        "--seed", str(SEED), *extra])
    args.log_json = "measure"          # train_step measures activations when logging
    return args


def batch(step, rows):
    rng = np.random.default_rng([SEED, step])
    x = rng.integers(0, CONFIG.vocab_size, size=(rows, CONFIG.block_size))
    return x, np.roll(x, -1, axis=1)


def train(strategy, args):
    model = strategy.build_model(CONFIG, args.seed, args.dtype)
    opt = strategy.build_optimizer(model, args)
    losses, norms, acts = [], [], []
    for step in range(args.steps):
        loss, norm, mem = train_step(strategy, model, opt, *batch(step, args.batch_size), args)
        losses.append(loss)
        norms.append(norm)
        acts.append(mem["activations"] if mem else 0)
    return model, opt, losses, norms, acts


def stage_state(strategy, opt):
    """This stage's parameters as whole host arrays (gathered over tp when it is split; under
    ZeRO gathered over dp to dp rank 0: {} on the other dp ranks)."""
    return pp_checkpoint.stage_state(strategy, opt)[0] or {}


def check_in_flight(strategy, comm):
    """Peak micro-batches in flight per stage (chunk-micro-batches when interleaved) equal
    to the schedule's simulation, on every rank."""
    m, pp, s, v = (strategy.micro_batches, strategy.group.size, strategy.group.rank,
                   strategy.virtual)
    want = simulate(strategy.schedule, pp, m, v)[s].peak_in_flight
    got = strategy.stats["in_flight"]
    assert got == want, f"stage {s} ({strategy.schedule}, v {v}, M {m}): {got} in flight, " \
                        f"not {want}"
    return got


def started_in_backward(strategy):
    """Per step, the all-reduces over the data-parallel groups (every group but tp's, pp's
    and the tied embedding's) issued before the step's "wait for gradients" (sync_grads)
    began: started by backward's hooks. The fewest over the steps (trace on; 0 without data
    parallelism, where nothing waits for gradients)."""
    other = {g.name for g in (strategy.mesh.tp, strategy.mesh.pp, strategy.embedding) if g}
    return issued_before_waits(trace.events(), lambda e: e["op"] == "all_reduce" and
                               e["group"] not in other)


def compare(name, ref, comm, cli):
    args = flags(name, cli.steps)
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    trace.clear_events()
    model, opt, losses, norms, acts = train(strategy, args)
    in_backward = comm.allreduce(started_in_backward(strategy), op=MPI.MIN)
    ddp = strategy.inner.ddp if isinstance(strategy.inner, DataParallel) else None
    ref_model, ref_opt, ref_losses, ref_norms, _ = ref
    state = stage_state(strategy, opt)
    ref_state = {n: ref_model.state_dict()[n] for n in state}
    diff = max_abs(state[n] - ref_state[n] for n in state)
    check_tied_copies(strategy, state)
    in_flight = check_in_flight(strategy, comm)
    crcs = {}                    # name -> crc of the whole array: any layout compares
    for part in comm.allgather({n: zlib.crc32(np.ascontiguousarray(a).tobytes())
                                for n, a in state.items()}):
        crcs.update(part)
    stage = strategy.group.rank
    per_stage = comm.gather((stage, strategy.mesh.dp_rank, strategy.mesh.tp_rank, in_flight,
                             max(acts)), root=0)
    result = {"run": name, "ranks": comm.size, "pp": strategy.group.size,
              "dp": strategy.mesh.shape["dp"], "tp": strategy.mesh.shape["tp"],
              "micro_batches": strategy.micro_batches, "schedule": strategy.schedule,
              "loss_diff": max_abs(np.subtract(losses, ref_losses)),
              "norm_diff": max_abs(np.subtract(norms, ref_norms)),
              "param_diff": worst_over_ranks(comm, diff), "losses": losses,
              "norms": norms, "crcs": dict(sorted(crcs.items())),
              "stages": sorted({(s, f, a) for s, d, t, f, a in per_stage or []
                                if d == 0 and t == 0}),
              "in_backward": in_backward,
              "buckets": None if ddp is None or ddp.mode == "naive" else
              comm.allreduce(len(ddp.buckets), MPI.MIN)}
    for key in ("loss_diff", "norm_diff", "param_diff"):
        assert result[key] <= cli.tol, (name, key, result)
    assert min(norms) > args.grad_clip, f"{name}: clipping never happened: {norms}"
    if name in cli.files.split(","):
        result.update(check_files(strategy, model, opt, ref, args, comm))
    for g in {id(g): g for g in (strategy.mesh.dp, strategy.mesh.tp, strategy.mesh.pp,
                                 strategy.embedding, strategy.mesh.world) if g}.values():
        g.destroy()
    return result


def check_files(strategy, model, opt, ref, args, comm):
    """--save writes the whole model and Adam state in the one-process format (one process
    loads them: equal to the reference's), and a fresh pipeline run loads its parts back."""
    ref_model, ref_opt = ref[0], ref[1]
    path = comm.bcast(tempfile.mkdtemp(prefix="pp_check_") if comm.rank == 0 else None)
    path = os.path.join(path, "ckpt")
    strategy.save(path, model, opt, args.steps, {}, {})
    one = SingleProcess()
    m1 = one.build_model(CONFIG, SEED + 1, "float64")
    o1 = one.build_optimizer(m1, args)
    checkpoint.load_checkpoint(path, m1, o1)
    ckpt_diff = max_abs(a - ref_model.state_dict()[n] for n, a in m1.state_dict().items())
    sa, sb = o1.state_dict()["state"], ref_opt.state_dict()["state"]
    adam_diff = max_abs(sa[n][k] - sb[n][k] for n in sb for k in ("exp_avg", "exp_avg_sq"))
    again = make_strategy(args, ProcessGroup.world(args.comm))
    m2 = again.build_model(CONFIG, SEED + 1, "float64")
    o2 = again.build_optimizer(m2, args)
    again.load(path, m2, o2)
    mine, back = stage_state(strategy, opt), stage_state(again, o2)
    assert all(np.array_equal(mine[n], back[n]) for n in mine), "reload differs"
    assert all(np.array_equal(o2.state[n][k], opt.state[n][k])
               for n in opt.state for k in ("exp_avg", "exp_avg_sq")), "Adam reload differs"
    out = {"ckpt_diff": worst_over_ranks(comm, ckpt_diff),
           "adam_diff": worst_over_ranks(comm, adam_diff)}
    assert all(v <= 1e-10 for v in out.values()), out
    return out


def check_schedules_agree(results):
    """Runs that differ only in the schedule end bitwise equal: every schedule sums each
    gradient in the same micro-batch order. (Interleaving changes which rank holds which
    block, so the grad norm's sum of squares adds up in another order: equal to 1e-10.)"""
    by_sizes = {}
    for r in results:
        key = re.sub(r"-?(gpipe|1f1b|zbh1)", "", r["run"])
        by_sizes.setdefault(key, []).append(r)
    for key, rows in by_sizes.items():
        for r in rows:
            differ = [n for n in r["crcs"] if r["crcs"][n] != rows[0]["crcs"].get(n)]
            assert not differ, f"{key}: {r['run']} and {rows[0]['run']} differ in {differ[:4]}"


def check_amp(comm, run, ref, steps=5):
    """--amp on pp 2 (float32 flags): losses within 1% of the float64 reference's, the
    activations crossing the boundary in float16."""
    args = flags(run, steps)
    args.dtype, args.amp = "float32", True
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    model, _, losses, norms, _ = train(strategy, args)
    assert all(np.isfinite(norms)), norms
    return {"run": run, "boundary_dtype": str(model.link.dtype), "losses": losses,
            "loss_diff": max_abs([(a - b) / b for a, b in zip(losses, ref[2])])}


def check_amp_overflow(comm, run="pp2-m2-1f1b", steps=3):
    """--amp (float16) on pp 2, an inf put into the last stage's wte gradient (the tied head's,
    a grad hook) at step 1 of 3, as an overflowing head would: the tied sum carries it to the
    first stage and every rank skips that step (scale 4096 -> 2048), the norm NaN; the clip's
    sum leaves the last stage's copy out (inf - inf) with no RuntimeWarning from numpy."""
    args = flags(run, steps)
    args.dtype, args.amp = "float32", True
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    model = strategy.build_model(CONFIG, args.seed, args.dtype)
    opt = strategy.build_optimizer(model, args)
    now = {"poison": False}
    if strategy.stage.last:
        strategy.stage.tied_copies()[0].register_grad_hook(
            lambda p: p.grad.__setitem__((0, 0), np.inf) if now["poison"] else None)
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            now["poison"] = step == 1
            norms.append(float(train_step(strategy, model, opt,
                                          *batch(step, args.batch_size), args)[1]))
    scaler = strategy.amp.scaler
    return {"run": run, "skipped": scaler.skipped, "scale": scaler.scale, "norms": norms,
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, RuntimeWarning)]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=None, help="comma-separated run names (see docstring)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tol", type=float, default=1e-10)
    p.add_argument("--n-layer", type=int, default=CONFIG.n_layer,
                   help="blocks of the model (pp 4 x --pp-virtual 2 needs 8)")
    p.add_argument("--files", default=None, help="the runs whose checkpoints are checked "
                   "(default: the first 2-rank or 8-rank run)")
    p.add_argument("--amp", action="store_true", help="only the mixed-precision check")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arrays live (tests/mpirun.py passes pytest's --device)")
    cli = p.parse_args()
    CONFIG.n_layer = cli.n_layer
    minidist.comm.init()   # MPI_Init, the abort hooks, the watchdog
    trace.enable()         # the events tell which all-reduces backward's hooks started
    backend.set_device(cli.device)   # numpy or cupy, on every rank
    comm = MPI.COMM_WORLD
    if cli.amp:
        ref = train(SingleProcess(), flags("pp1", 5))
        for run in ("pp2-m2-1f1b", "pp2-m2-v2-1f1b", "pp2-m2-zbh1"):
            row = check_amp(comm, run, ref)
            if comm.rank == 0:
                print("AMP " + json.dumps(row), flush=True)
        rows = comm.gather(check_amp_overflow(comm), root=0)
        if comm.rank == 0:
            print("OVERFLOW " + json.dumps(rows), flush=True)
        return
    runs = (cli.runs or DEFAULT_RUNS[comm.size]).split(",")
    if cli.files is None:
        cli.files = {2: runs[0] + ",pp2-m2-v2-1f1b", 8: runs[0]}.get(comm.size, "")
    ref = train(SingleProcess(), flags("pp1", cli.steps))
    results = []
    for name in runs:
        results.append(compare(name, ref, comm, cli))
        if comm.rank == 0:
            print("RESULT " + json.dumps(results[-1]), flush=True)
    check_schedules_agree(results)


if __name__ == "__main__":
    main()
