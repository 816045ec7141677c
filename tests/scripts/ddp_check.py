"""DDP on N ranks against one process on the same global batches, in float64, in one mpiexec run.

    mpiexec -n 4 python tests/scripts/ddp_check.py                      # every mode x algo
    mpiexec -n 2 python tests/scripts/ddp_check.py --grad-accum 2
    mpiexec -n 4 python tests/scripts/ddp_check.py --clip 0.05 --algos ring
    mpiexec -n 4 python tests/scripts/ddp_check.py --algos ring --modes overlapped \
        --trace /tmp/ddp_trace.json

Every rank also trains the single-process reference itself (SingleProcess, the whole global
batch), then for each (algorithm, mode) trains a DDP model through the loop's own train_step
and checks: losses, grad norms and final parameters equal to the reference to --tol; the
parameters bitwise equal on all ranks; the gradient bytes each step sent, from the trace
counters, equal to the ring's 2(N-1)/N x gradient bytes (summed over ranks: exactly 2(N-1) x).
Rank 0 prints one `RESULT {json}` line per combination for tests/test_ddp_exact.py. With --trace,
a float32 overlapped step is traced and every rank must show an all-reduce that started before
its backward ended. Any failure raises, and the abort handler ends the whole job.
"""
import argparse
import json
import zlib
from types import SimpleNamespace

import numpy as np

from minidist import backend
import minidist.comm
from minidist.comm import ProcessGroup, trace
from mpi4py import MPI  # after minidist.comm: MPI starts in comm.init(), not here
from minidist.nn import GPTConfig
from minidist.ddp.strategy import DataParallel
from minidist.strategy.base import SingleProcess

from exact import max_abs, run_steps

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)
SEED = 7


def train(strategy, args, dtype="float64", config=CONFIG):
    """args.steps steps of the loop's train_step; returns (model, losses, norms)."""
    model, _, losses, norms, _ = run_steps(strategy, args, config, SEED, dtype)
    return model, losses, norms


def max_diff(model, ref):
    """The largest difference of any parameter entry from the reference's (NaN if any is)."""
    ref = dict(ref.named_parameters())
    return max_abs(p.data - ref[n].data for n, p in model.named_parameters())


def check_replicas_equal(model, comm):
    """Every rank's parameters are bitwise those of rank 0."""
    crc = 0
    for _, p in model.named_parameters():
        crc = zlib.crc32(np.ascontiguousarray(p.data).tobytes(), crc)
    crcs = comm.allgather(crc)
    assert len(set(crcs)) == 1, f"parameters differ across ranks: {crcs}"


def check_bytes(strategy, comm):
    """Gradient bytes sent per step: ring theory per rank, exactly 2(N-1) x summed over ranks."""
    n, grad = strategy.world_size, strategy.ddp.grad_bytes()
    sent = [row["bytes_sent"] for row in strategy.stats.rows]
    totals = comm.allreduce(np.array(sent, dtype=np.int64))
    assert all(t == 2 * (n - 1) * grad for t in totals), (totals, grad)
    # uneven ring chunks move a few elements between ranks; the naive algorithm's root sends
    # (N-1) x bytes itself, so the per-rank check is for the ring-shaped algorithms only
    calls = len(strategy.ddp.params) if strategy.mode == "naive" else len(strategy.ddp.buckets)
    slack = 2 * calls * strategy.ddp.params[0].data.itemsize
    if strategy.group.algo != "naive":
        assert all(abs(s - 2 * (n - 1) / n * grad) <= slack for s in sent), (sent, grad)
    return sent[-1]


def compare(args, comm, ref, algo, mode):
    group = ProcessGroup(comm, algo, name=f"dp-{algo}-{mode}")
    strategy = DataParallel(group, mode=mode, bucket_mb=args.bucket_mb)
    model, losses, norms = train(strategy, args)
    ref_model, ref_losses, ref_norms = ref
    result = {"algo": algo, "mode": mode, "ranks": strategy.world_size,
              "grad_accum": args.grad_accum, "clip": args.clip, "steps": args.steps,
              "loss_diff": max_abs(np.subtract(losses, ref_losses)),
              "norm_diff": max_abs(np.subtract(norms, ref_norms)),
              "param_diff": max_diff(model, ref_model), "norms": norms,
              "bytes_sent": check_bytes(strategy, comm), "grad_bytes": strategy.ddp.grad_bytes(),
              "buckets": len(getattr(strategy.ddp, "buckets", ()))}
    for key in ("loss_diff", "norm_diff", "param_diff"):
        assert result[key] <= args.tol, (algo, mode, key, result)
    assert comm.allgather(norms) == [norms] * comm.Get_size(), "grad norms differ by rank"
    check_replicas_equal(model, comm)
    if args.clip:
        assert max(norms) > args.clip, f"--clip {args.clip} never clipped: norms {norms}"
    group.destroy()
    return result


def check_overlap(args, comm, path):
    """Float32 overlapped steps, traced: on every rank, in at least one of the steps, an
    all-reduce issued by a grad hook started running before that step's backward ended. (One
    step would do on an idle machine; ranks time-sliced on shared cores may miss one.)"""
    config = GPTConfig(n_layer=4, n_head=2, n_embd=128, block_size=64, vocab_size=64)
    group = ProcessGroup(comm, "ring", name="dp-trace")
    strategy = DataParallel(group, mode="overlapped", bucket_mb=0.1)
    trace.enable()
    train(strategy, SimpleNamespace(**{**vars(args), "steps": 3, "batch_size": 4 * comm.size}),
          dtype="float32", config=config)
    trace.write_chrome_trace(path, group)
    events = trace.events()
    steps = []
    for bw in (e for e in events if e["op"] == "backward"):
        reduces = [e for e in events if e["op"] == "all_reduce" and e["group"] == "dp-trace"
                   and e["async"] and bw["start"] <= e["issued"] <= bw["end"]]
        steps.append({"backward_ms": (bw["end"] - bw["start"]) * 1e3, "issued": len(reduces),
                      "started_inside": sum(e["start"] < bw["end"] for e in reduces)})
    assert all(s["issued"] for s in steps), f"hooks issued no all-reduce in backward: {steps}"
    inside = comm.allgather(max(s["started_inside"] for s in steps))
    assert min(inside) > 0, f"no all-reduce ran during backward on some rank: {inside}"
    return {"trace": path, "buckets": len(strategy.ddp.buckets), "steps": steps,
            "started_inside_by_rank": inside}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--algos", default="ring,naive,mpi")
    p.add_argument("--modes", default="naive,bucketed,overlapped")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0, help="max grad norm (0: no clipping)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=0.004, help="several buckets here")
    p.add_argument("--tol", type=float, default=1e-10)
    p.add_argument("--trace", default=None, metavar="FILE")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arrays live (tests/mpirun.py passes pytest's --device)")
    cli = p.parse_args()
    minidist.comm.init()   # MPI_Init, the abort hooks, the watchdog
    backend.set_device(cli.device)   # numpy or cupy, on every rank
    comm = MPI.COMM_WORLD
    args = SimpleNamespace(steps=cli.steps, batch_size=cli.batch_size, lr=1e-2,
                           weight_decay=0.1, beta1=0.9, beta2=0.95,
                           grad_accum=cli.grad_accum, grad_clip=cli.clip,
                           log_json=None, clip=cli.clip, bucket_mb=cli.bucket_mb, tol=cli.tol,
                           optimizer="adamw")
    ref = train(SingleProcess(), args)
    for algo in cli.algos.split(","):
        for mode in cli.modes.split(","):
            result = compare(args, comm, ref, algo, mode)
            if comm.rank == 0:
                print("RESULT " + json.dumps(result), flush=True)
    if cli.trace:
        result = check_overlap(args, comm, cli.trace)
        if comm.rank == 0:
            print("OVERLAP " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
