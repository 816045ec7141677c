"""ZeRO-1/2/3 on N ranks against one process on the same global batches, in float64, in one
mpiexec run; then the memory ledger and the bytes sent per step, against theory.

    mpiexec -n 4 python tests/scripts/zero_check.py                  # stages 1, 2, 3
    mpiexec -n 4 python tests/scripts/zero_check.py --clip 0.05 --grad-accum 2
    mpiexec -n 3 python tests/scripts/zero_check.py --ckpt-activations --no-prefetch --algo mpi
    mpiexec -n 4 python tests/scripts/zero_check.py --stages "" --memory --comm --amp
    mpiexec -n 4 python tests/scripts/zero_check.py --shard 2 --clip 0.05 --grad-accum 2
    mpiexec -n 4 python tests/scripts/zero_check.py --overlap-gather --stages 1,2 --grad-accum 2

Every rank trains the single-process reference itself (SingleProcess, the whole global batch),
then for each stage trains ZeroDataParallel through the loop's own train_step and checks:
losses and grad norms equal to the reference to --tol; every rank's parameter shards equal to
the same slice of the reference's flattened units (and the padding zero); at stage 3 the
parameters gathered to rank 0 equal the reference. The model (n_embd 18, vocab 31) makes every
unit's size odd at N = 4, so padding is exercised. Rank 0 prints `RESULT {json}` per stage.
--memory: one step of DDP and of each stage, float64; the ledger row (as --log-json reports
it) on every rank, and the ZeRO paper's prediction: `MEMORY {json}`; the loss after one update
equal to DDP's. --amp: the same with mixed precision (2 + 2 + 12 bytes per parameter; the loss
within 1e-3 of DDP's under mixed precision).
--comm: reduce-scatter and all-gather bytes each rank sent in one step vs the closed form:
`COMM {json}`. --shard K: hybrid sharding (each K ranks one sharded replica,
ZeroDataParallel's shard_size), the same checks, and the bytes each rank sent across the
replicas: one all-reduce of its shards per step, 2(R-1)/R of them on the ring. Each RESULT
also counts the reduce-scatters backward's hooks started before sync_grads waited (the fewest
over the steps): every unit's, at stage 1 only in a step's last micro-batch.
--overlap-gather (stages 1, 2): the all-gathers after each step run in the background, each
unit waited for by the next forward; the parameters are NaN placeholders after the last step
(no forward has waited), and the shards and the gathered state_dict equal the reference.
Any failure raises, and the abort handler ends the whole job.
"""
import argparse
import json
from types import SimpleNamespace

import numpy as np

from minidist import backend
import minidist.comm
from minidist.comm import ProcessGroup, trace
from minidist.comm.ring import ring_bytes
from mpi4py import MPI  # after minidist.comm: MPI starts in comm.init(), not here
from minidist.nn import GPTConfig
from minidist.strategy import memory
from minidist.train.amp import MixedPrecision
from minidist.ddp.strategy import DataParallel
from minidist.train.step import train_step
from minidist.strategy.base import SingleProcess
from minidist.zero.strategy import ZeroDataParallel

import exact

CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=18, block_size=8, vocab_size=31)
SEED = 7


def train(strategy, args, dtype="float64"):
    """args.steps steps of train_step; returns (model, opt, losses, norms, last mem row)."""
    return exact.run_steps(strategy, args, CONFIG, SEED, dtype)


def batch(step, rows):
    return exact.batch(step, rows, CONFIG, SEED)


def shard_diff(strategy, ref_model):
    """Largest |shard - the same slice of the reference's flat unit| on this rank (NaN if
    any entry is); checks the padding (the flat buffer's tail) is zero."""
    ref = dict(ref_model.named_parameters())
    diffs = []
    for u in strategy.engine.units:
        f = u.flat                                  # the layout; u holds the shards
        flat = f.flatten([ref[n].data for n in f.names])
        diffs.append(u.param_shard - flat[f.lo:f.hi])
        tail = max(f.numel, f.lo) - f.lo           # where the padding starts in this shard
        assert not np.any(u.param_shard[tail:]), f"padding of {f.name} is not zero"
    return exact.max_abs(diffs)


def compare(args, comm, ref, stage):
    group = ProcessGroup(comm, args.algo, name=f"zero{stage}")
    overlap = args.overlap_gather and stage < 3
    strategy = ZeroDataParallel(group, stage, prefetch=args.prefetch,
                                ckpt_activations=args.ckpt_activations, shard_size=args.shard,
                                overlap_gather=overlap)
    trace.clear_events()
    model, _, losses, norms, _ = train(strategy, args)
    in_flight = strategy.engine.gathers_in_flight()        # when the last step returned
    if overlap:   # on a group of their own: the loss's mean on the dp group does not wait
        assert strategy.gather_group.comm is not strategy.group.comm
        assert trace.bytes_sent(strategy.gather_group.name, "all_gather") > 0
    # --overlap-gather: after the last step no forward has waited for the gathers yet, so
    # every parameter still points at a NaN placeholder (nothing reads it half-gathered);
    # stage 3's are placeholders between steps anyway
    placeholders = all(bool(np.isnan(p.data).all()) for p in model.parameters())
    assert placeholders == (overlap or stage == 3), \
        f"stage {stage}: parameters NaN after the step: {placeholders}, overlap {overlap}"
    across = replica_bytes(strategy, args.steps, args.algo)
    early = started_in_backward(strategy)
    scatters = issued_in_backward(strategy.shard_group.name, "reduce_scatter")
    ref_model, ref_losses, ref_norms = ref
    diff = exact.worst_over_ranks(comm, shard_diff(strategy, ref_model))
    full = strategy.engine.full_state_dict()
    if comm.rank == 0:
        want = dict(ref_model.named_parameters())
        diff = exact.max_abs([diff] + [a - want[n].data for n, a in full.items()])
        assert list(full) == list(want), "full_state_dict: names or order differ"
    result = {"stage": stage, "ranks": group.size, "algo": args.algo, "steps": args.steps,
              "grad_accum": args.grad_accum, "clip": args.clip,
              "ckpt_activations": args.ckpt_activations, "prefetch": args.prefetch,
              "loss_diff": exact.max_abs(np.subtract(losses, ref_losses)),
              "norm_diff": exact.max_abs(np.subtract(norms, ref_norms)),
              "param_diff": diff, "norms": norms,
              "padding": [u.flat.padding for u in strategy.engine.units],
              "shard_ranks": strategy.shard_group.size, "across_replicas": across,
              "across_in_backward": early, "units": len(strategy.engine.units),
              "scatters_in_backward": comm.allreduce(scatters, op=MPI.MIN),
              "overlap_gather": overlap,
              "gathers_in_flight": comm.allreduce(in_flight, op=MPI.MAX)}
    for key in ("loss_diff", "norm_diff", "param_diff"):
        assert result[key] <= args.tol, (stage, key, result)
    if args.clip:
        assert max(norms) > args.clip, f"--clip {args.clip} never clipped: {norms}"
    group.destroy()
    return result


def replica_bytes(strategy, steps, algo):
    """Hybrid sharding: the bytes this rank sent to the other replicas in `steps` steps, which
    must be one all-reduce of its gradient shards per unit and step (on the ring: the
    ring's count, 2(R-1)/R of them; comm/ring.py ring_bytes); None when not hybrid."""
    replicas = strategy.replicas
    if replicas is None:
        return None
    sent = trace.bytes_sent(replicas.name)
    if algo == "ring":
        want = steps * sum(ring_bytes("all_reduce", u.grad_shard.size, u.grad_shard.itemsize,
                                      replicas.rank, replicas.size)
                           for u in strategy.engine.units)
        assert sent == want, ("bytes across replicas", sent, want)
    return sent


def started_in_backward(strategy):
    """Hybrid sharding (trace on): per step, how many of the all-reduces across the replicas
    were issued before the step's "wait for gradients" (sync_grads) began, i.e. overlapped
    with backward; the fewest over the steps (None when not hybrid)."""
    if strategy.replicas is None:
        return None
    return issued_in_backward(strategy.replicas.name, "all_reduce")


def issued_in_backward(group, op):
    """Per step, how many `op`s on `group` (a name) were issued before the step's "wait for
    gradients" (sync_grads) began: started by backward's hooks. The fewest over the steps."""
    return exact.issued_before_waits(trace.events(),
                                     lambda e: e["group"] == group and e["op"] == op)


def measure(args, comm, stage, amp=False, dtype="float64"):
    """One or two steps at `stage` (0 = DDP); this rank's ledger row and bytes sent in the
    last step, by op."""
    group = ProcessGroup(comm, args.algo, name=f"mem{stage}{'amp' * amp}")
    policy = MixedPrecision() if amp else None
    strategy = (DataParallel(group, amp=policy) if stage == 0
                else ZeroDataParallel(group, stage, amp=policy))
    run = SimpleNamespace(**{**vars(args), "steps": 1, "grad_accum": 1, "log_json": "yes"})
    model, opt, losses, _, _ = train(strategy, run, dtype)
    ops = ("all_reduce", "reduce_scatter", "all_gather")
    before = {op: trace.bytes_sent(group.name, op) for op in ops}
    loss, _, mem = train_step(strategy, model, opt, *batch(1, args.batch_size), run)
    sent = {op: trace.bytes_sent(group.name, op) - b for op, b in before.items()}
    n = model.num_parameters()
    predicted = memory.zero_model_states(n, group.size, stage, amp=amp,
                                         itemsize=np.dtype(dtype).itemsize)
    out = {"stage": stage, "amp": amp, "mem": mem, "predicted": predicted, "sent": sent,
           "n_params": n, "loss": loss, "strategy": strategy}
    group.destroy()
    return out


def check_memory(args, comm, amp=False):
    """Measured (the ledger) vs predicted per stage, every rank; shards ~1/N of DDP's."""
    dtype = "float32" if amp else "float64"
    rows = {s: measure(args, comm, s, amp, dtype) for s in (0, 1, 2, 3)}
    for s, r in rows.items():
        for k in ("params", "grads", "optimizer"):
            got, want = r["mem"][k], r["predicted"][k]
            assert abs(got / want - 1) < 0.03, (s, k, got, want)
    n, base = comm.size, rows[0]["mem"]
    for s, kind in ((1, "optimizer"), (2, "grads"), (3, "params")):
        ratio = rows[s]["mem"][kind] / base[kind]
        assert abs(ratio * n - 1) < 0.03, (s, kind, ratio)
    tol = 1e-3 if amp else 1e-10      # the loss after one update, each stage vs DDP's
    assert all(abs(r["loss"] - rows[0]["loss"]) < tol for r in rows.values()), \
        {s: r["loss"] for s, r in rows.items()}
    table = {s: {"measured": r["mem"], "predicted": r["predicted"]} for s, r in rows.items()}
    return {"ranks": n, "amp": amp, "dtype": dtype, "n_params": rows[0]["n_params"],
            "by_rank": comm.gather(table, root=0)}


def check_comm(args, comm):
    """Per-rank bytes of one step vs the ring's closed forms (N-1)/N x bytes per call."""
    n, out = comm.size, {}
    for stage in (0, 1, 2, 3):
        r = measure(args, comm, stage)
        eng, sent = getattr(r["strategy"], "engine", None), r["sent"]
        total = sum(sent.values())
        if stage == 0:
            psi = 8 * r["n_params"]
            want = 2 * (n - 1) * psi // n      # all-reduce = reduce-scatter + all-gather
            assert abs(total - want) <= 64 * 8, (stage, total, want)
        else:
            assert sent["all_reduce"] <= 64, sent     # only the loss and the norm, 8 B each
            total -= sent["all_reduce"]
            flats = [u.flat for u in eng.units]
            psi = 8 * sum(f.padded for f in flats)
            blocks = [f for f in flats if f.module is not None]
            gathers = psi if stage < 3 else 8 * (sum(f.padded for f in flats if
                                                     f.module is None) +
                                                 blocks[0].padded * (2 * len(blocks) - 2))
            want = (n - 1) * (psi + gathers) // n
            assert r["sent"]["reduce_scatter"] == (n - 1) * psi // n, (stage, r["sent"])
            assert total == want, (stage, total, want)
        out[stage] = {"bytes_sent": total, "params_bytes": psi, "ratio_to_params": total / psi}
    for stage in (1, 2, 3):
        out[stage]["vs_ddp"] = out[stage]["bytes_sent"] / out[0]["bytes_sent"]
    return {"ranks": n, "n_layer": CONFIG.n_layer, "algo": args.algo, "stages": out}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--algo", default="ring")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0, help="max grad norm (0: no clipping)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ckpt-activations", action="store_true")
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false")
    p.add_argument("--memory", action="store_true")
    p.add_argument("--amp", action="store_true", help="the memory check with --amp too")
    p.add_argument("--comm", action="store_true")
    p.add_argument("--tol", type=float, default=1e-10)
    p.add_argument("--shard", type=int, default=None,
                   help="hybrid sharding: ranks per sharded replica (ZeRO's shard_size)")
    p.add_argument("--overlap-gather", action="store_true",
                   help="stages 1, 2: the all-gathers after each step in the background "
                   "(--overlap-param-gather)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arrays live (tests/mpirun.py passes pytest's --device)")
    cli = p.parse_args()
    minidist.comm.init()   # MPI_Init, the abort hooks, the watchdog
    trace.enable()         # the events tell which collectives backward's hooks started
    backend.set_device(cli.device)   # numpy or cupy, on every rank
    comm = MPI.COMM_WORLD
    args = SimpleNamespace(**vars(cli), lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95,
                           grad_clip=cli.clip,
                           log_json=None, optimizer="adamw")
    stages = [int(s) for s in cli.stages.split(",") if s]
    if stages:
        ref = SingleProcess(ckpt_activations=cli.ckpt_activations)
        ref_model, _, ref_losses, ref_norms, _ = train(ref, args)
        for stage in stages:
            result = compare(args, comm, (ref_model, ref_losses, ref_norms), stage)
            if comm.rank == 0:
                print("RESULT " + json.dumps(result), flush=True)
    for flag, amp in ((cli.memory, False), (cli.amp, True)):
        if flag:
            result = check_memory(args, comm, amp)
            if comm.rank == 0:
                print("MEMORY " + json.dumps(result), flush=True)
    if cli.comm:
        result = check_comm(args, comm)
        if comm.rank == 0:
            print("COMM " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
