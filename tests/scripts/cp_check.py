"""Context parallelism (ring attention) on 2, 4 or 8 ranks against one process, float64.

    mpiexec -n 2 python tests/scripts/cp_check.py                      # cp2, cp2 naive
    mpiexec -n 4 python tests/scripts/cp_check.py --runs cp4,cp4+naive,cp2xdp2,cp2xtp2
    mpiexec -n 2 python tests/scripts/cp_check.py --runs cp2+ckpt,cp2+naive+ckpt
    mpiexec -n 4 python tests/scripts/cp_check.py --runs cp2xtp2+zero3 --resume-runs cp2xtp2+zero3
    mpiexec -n 8 python tests/scripts/cp_check.py --runs cp2xtp2xdp2+zero1

Every rank also trains the single-process reference (SingleProcess, the whole global batch);
each run builds its strategy from train_gpt's own flags (make_strategy) and trains through
the loop's train_step (tests/scripts/exact.py). Checks: losses, grad norms and parameters
equal the reference to --tol; the bytes each rank sent on the cp group equal the formula of
minidist/cp/ring.py (a "+ckpt" run's recompute included); the activations each rank keeps,
without and with --ckpt-activations (on 2 and 4 ranks); with --resume-runs, a run's checkpoint
saved and loaded back (check_reload); on 2 ranks, RingSelfAttention's backward against
float64 central differences across the ranks (`ring_gradcheck`). Rank 0 prints
`RESULT {json}` (and `MEMORY`, `GRADCHECK`) lines for tests/test_cp_exact.py. Any failure
raises and the abort handler ends the job.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import batch, max_abs, run_steps, start  # noqa: E402
from cp_tp_ledger import sp_activations, step_tp_traffic, tp_counted  # noqa: E402
from dist_gradcheck import dist_gradcheck  # noqa: E402

from minidist import backend  # noqa: E402
import minidist.comm  # noqa: E402
from minidist.comm import trace  # noqa: E402
from mpi4py import MPI  # noqa: E402  (after minidist.comm: MPI starts in comm.init())
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite  # noqa: E402
from minidist.cp.context import RingContext  # noqa: E402
from minidist.cp.ring import RingSelfAttention, layout, ring_bytes  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.strategy import memory  # noqa: E402
from minidist.train.args import train_parser  # noqa: E402
from minidist.comm import ProcessGroup  # noqa: E402
from minidist.strategy.base import SingleProcess  # noqa: E402
from minidist.train.step import train_step  # noqa: E402
from minidist.train.strategy import make_strategy  # noqa: E402

# block 16: zig-zag over 4 ranks cuts it in 8 chunks of 2; tiles of 2 cross the chunks
CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=16, vocab_size=30,
                   dropout=0.0, attention_block=2)
SEED = 7
RUNS = {"cp2": [], "cp2+naive": ["--cp-split", "naive"], "cp4": [],
        "cp4+naive": ["--cp-split", "naive"], "cp2xdp2": ["--dp", "2"],
        "cp2xdp2+naive+accum": ["--dp", "2", "--cp-split", "naive", "--grad-accum", "2"],
        "cp2xdp2+zero1": ["--dp", "2", "--zero", "1"], "cp2xdp2+zero2": ["--dp", "2", "--zero",
                                                                         "2"],
        "cp2xdp2+zero3": ["--dp", "2", "--zero", "3"], "cp2xtp2": ["--tp", "2"],
        "cp2xtp2+naive": ["--tp", "2", "--cp-split", "naive"],
        "cp2xdp2+zero3+accum": ["--dp", "2", "--zero", "3", "--grad-accum", "2"],
        # hybrid sharding over dp x cp: each dp replica's 2 cp ranks one sharded replica
        "cp2xdp2+zero3+shard2": ["--dp", "2", "--zero", "3", "--zero-shard", "2"],
        "cp2xdp2+zero2+shard2+accum": ["--dp", "2", "--zero", "2", "--zero-shard", "2",
                                       "--grad-accum", "2"],
        # cp x tp x ZeRO: ZeRO over dp x cp shards each tp rank's part (dp 1 on 4 ranks)
        "cp2xtp2+zero1": ["--tp", "2", "--zero", "1"],
        "cp2xtp2+zero2+naive": ["--tp", "2", "--zero", "2", "--cp-split", "naive"],
        "cp2xtp2+zero3": ["--tp", "2", "--zero", "3"],
        "cp2xtp2+zero3+shard1": ["--tp", "2", "--zero", "3", "--zero-shard", "1"],
        "cp2xtp2+sp+zero2+shard1": ["--tp", "2", "--sequence-parallel", "--zero", "2",
                                    "--zero-shard", "1"],
        # cp x tp x sequence parallelism: (B, T/cp/tp, C) between the blocks' split layers
        "cp2xtp2+sp": ["--tp", "2", "--sequence-parallel"],
        "cp2xtp2+sp+naive": ["--tp", "2", "--sequence-parallel", "--cp-split", "naive"],
        "cp2xtp2+sp+zero1": ["--tp", "2", "--sequence-parallel", "--zero", "1"],
        "cp2xtp2+sp+zero2+naive": ["--tp", "2", "--sequence-parallel", "--zero", "2",
                                   "--cp-split", "naive"],
        "cp2xtp2+sp+zero3": ["--tp", "2", "--sequence-parallel", "--zero", "3"],
        "cp2xtp2xdp2+sp": ["--tp", "2", "--dp", "2", "--sequence-parallel"],      # 8 ranks
        "cp2xtp2xdp2+sp+zero3+accum": ["--tp", "2", "--dp", "2", "--sequence-parallel",
                                       "--zero", "3", "--grad-accum", "2"],
        "cp2xtp2xdp2+zero1": ["--tp", "2", "--dp", "2", "--zero", "1"],      # 8 ranks
        "cp2xtp2xdp2+zero2": ["--tp", "2", "--dp", "2", "--zero", "2"],
        "cp2xtp2xdp2+zero3+accum": ["--tp", "2", "--dp", "2", "--zero", "3", "--grad-accum",
                                    "2"]}
CKPT = "+ckpt"      # any run + "+ckpt": with --ckpt-activations (the ring forward runs again
                    # inside backward); the reference stays one process without recompute
KV = "kv"           # any run + "+kv<K>" (before "+ckpt"): Llama's block with K kv heads (0:
                    # n_head), against one process of that block; k and v travel as K heads


def kv_heads_of(name):
    """(the run's name without "+kv<K>", K or None: GPT-2's block)."""
    parts = name.split("+")
    kv = [int(p[len(KV):]) for p in parts if p.startswith(KV)]
    return "+".join(p for p in parts if not p.startswith(KV)), (kv[0] if kv else None)


def config_of(name):
    """The model of run `name`: CONFIG, or with "+kv<K>" Llama's block with K kv heads."""
    kv = kv_heads_of(name)[1]
    if kv is None:
        return CONFIG
    return GPTConfig(**{**CONFIG.to_dict(), "arch": "llama", "n_kv_head": kv, "bias": False})


def reference(name, refs):
    """One process on the whole global batch of run `name`'s model (one per model): (model,
    optimizer, losses, norms); the common flags are cp2's (plain or of the same block)."""
    kv = kv_heads_of(name)[1]
    if kv not in refs:
        one = flags("cp2" if kv is None else f"cp2+{KV}{kv}")
        refs[kv] = run_steps(SingleProcess(), one, config_of(name), SEED, "float64")[:4]
    return refs[kv]


def reload_into(ranks):
    """--resume-runs (cp x tp x ZeRO runs): after the run, its checkpoint (--save: ZeRO's
    sharded files of each tp part) is loaded back into a fresh strategy of the same layout,
    of ZeRO-1, and of tp 2 without cp (ZeRO reshards over its group: dp x cp ranks there, dp
    here; without cp the tiles' size is the default: the idle flag is refused):
    name -> the flags that change."""
    return {"same": [], "zero1": ["--zero", "1"],
            f"tp2xdp{ranks // 2}+zero3": ["--cp", "1", "--dp", str(ranks // 2), "--zero", "3",
                                            "--grad-accum", "1", "--attention-block", "64"]}


def flags(name, *extra):
    """train_gpt's flags for run `name`: --cp from the name, the rest from RUNS, then `extra`
    (the last of a flag given twice wins)."""
    cp = name.split("+")[0].split("x")[0][2:]
    ckpt = ["--ckpt-activations"] if name.endswith(CKPT) else []
    name, kv = kv_heads_of(name)
    c = CONFIG
    arch = [] if kv is None else ["--arch", "llama", "--n-kv-head", str(kv)]
    return train_parser().parse_args([
        "--cp", cp, "--n-layer", str(c.n_layer), "--n-head", str(c.n_head), "--n-embd",
        str(c.n_embd), "--block-size", str(c.block_size), "--dropout", "0",
        "--attention-block", str(c.attention_block), "--batch-size", "4", "--steps", "3",
        "--lr", "1e-2", "--grad-clip", "0.05", "--dtype", "float64", "--seed", str(SEED),
        *RUNS[name.removesuffix(CKPT)], *arch, *ckpt, *extra])


def full_params(strategy, model):
    """name -> host array of the whole model (gathered over tp under TensorParallel)."""
    if hasattr(strategy, "full_state_dict"):
        return strategy.full_state_dict()
    zero = strategy.zero_strategy()
    if zero is not None:                                # ZeRO: gathered on rank 0 ({} elsewhere)
        return zero.engine.full_state_dict(root=0)
    return {n: np.asarray(backend.to_host(p.data)) for n, p in model.named_parameters()}


def step_ring_bytes(args, config, mesh):
    """Bytes one rank sends on the cp group in one step (minidist/cp/ring.py's formula, S
    the bytes of its k: kv_heads of head size C / n_head, of this tp rank)."""
    n = mesh.shape["cp"]
    rows = args.batch_size // mesh.shape["dp"] // args.grad_accum
    k_width = config.kv_heads * (config.n_embd // config.n_head)
    S = rows * (config.block_size // n) * (k_width // mesh.shape["tp"]) * 8   # float64
    return ring_bytes(S, n, args.ckpt_activations) * config.n_layer * args.grad_accum


def run(name, refs, comm, tol, reload=False):
    args, config = flags(name), config_of(name)
    ref = reference(name, refs)
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    mesh = strategy.mesh
    sent0, tp0 = trace.bytes_sent("cp"), trace.counters("tp")
    model, opt, losses, norms, _ = run_steps(strategy, args, config, SEED, "float64")
    sent = (trace.bytes_sent("cp") - sent0) / args.steps
    tp_ops, tp_sent = tp_counted(tp0, args.steps)
    params = full_params(strategy, model)
    r_model, r_opt, r_losses, r_norms = ref
    d_loss = max_abs([float(a) - float(b) for a, b in zip(losses, r_losses)])
    d_norm = max_abs([float(a) - float(b) for a, b in zip(norms, r_norms)])
    d_par = max_abs([max_abs(params[n] - np.asarray(p.data))
                     for n, p in r_model.named_parameters()]) if params else 0.0
    row = {"run": name, "loss_diff": d_loss, "norm_diff": d_norm, "param_diff": d_par,
           "bytes_sent": sent, "theory_sent": step_ring_bytes(args, config, mesh),
           "losses": [float(v) for v in losses]}
    ok = comm.allreduce(all(d < tol for d in (d_loss, d_norm, d_par)), op=MPI.LAND)
    assert ok, (name, row)                      # NaN fails too (every comparison is False)
    assert sent == row["theory_sent"], (name, row)
    if mesh.shape["tp"] > 1:                    # the tp group's calls and bytes: the formula
        want_ops, want_sent = step_tp_traffic(args, config, strategy, model)
        row.update(tp_sent=tp_sent, tp_theory_sent=want_sent)
        assert tp_ops == want_ops and tp_sent == want_sent, (name, tp_ops, want_ops, row)
    if reload:
        row["reload"] = check_reload(name, strategy, model, opt, (r_model, r_opt), comm)
    return row


def whole(strategy, model, opt):
    """(params, Adam moments) by name, as one process holds them, on world rank 0 (the
    checkpoint's gather: ZeRO's over dp x cp, then tp's); ({}, {}) elsewhere. Collective."""
    params, sd = strategy.whole_state(model, opt)
    if strategy.rank != 0:
        return {}, {}
    return params, {(n, k): v for n, e in sd["state"].items() for k, v in e.items()
                    if k in ("exp_avg", "exp_avg_sq")}


def check_reload(name, strategy, model, opt, ref, comm, make_flags=None):
    """--save of run `name` (sharded: ZeRO's files of each tp part), loaded back into a fresh
    strategy of each reload_into layout: parameters and Adam moments bitwise the saved ones
    (which equal one process's to 1e-10); then one more step of the run and of its reload
    into the same layout log the same loss, bit for bit. make_flags(name, *extra): the
    layouts' flags (default: this script's `flags`; tests/scripts/ulysses_check.py's own)."""
    make_flags = make_flags or flags
    path = comm.bcast(tempfile.mkdtemp(prefix="cp_check_") if comm.rank == 0 else None)
    path = os.path.join(path, "ckpt")
    strategy.save(path, model, opt, 3, {"dropout": model.dropout_keys.state_dict()}, {})
    mine, mine_adam = whole(strategy, model, opt)
    r_model, r_opt = ref
    out = {}
    if comm.rank == 0:
        out["param_diff"] = max_abs([max_abs(mine[n] - np.asarray(p.data))
                                     for n, p in r_model.named_parameters()])
        sb = r_opt.state_dict()["state"]
        out["adam_diff"] = max_abs([max_abs(v - sb[n][k]) for (n, k), v in mine_adam.items()])
        assert len(mine_adam) == 2 * len(sb) and all(v < 1e-10 for v in out.values()), out
    for into, extra in reload_into(comm.size).items():
        args = make_flags(name, *extra)
        again = make_strategy(args, ProcessGroup.world(args.comm))
        m2 = again.build_model(CONFIG, SEED + 1, "float64")
        o2 = again.build_optimizer(m2, args)
        again.load(path, m2, o2)
        back, back_adam = whole(again, m2, o2)
        same = all(np.array_equal(mine[n], back[n]) for n in mine) and back.keys() == \
            mine.keys() and all(np.array_equal(v, back_adam[k]) for k, v in mine_adam.items())
        assert comm.allreduce(same, op=MPI.LAND), (name, into, "reload differs")
        out[into] = "bitwise"
        if into == "same":
            out["next_loss"] = next_losses(strategy, model, opt, again, m2, o2, args)
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(os.path.dirname(path))
    return out


def next_losses(strategy, model, opt, again, m2, o2, args):
    """Step 4 of the run and of its reload: the same loss, bit for bit (asserted)."""
    x, y = batch(3, args.batch_size, CONFIG, SEED)
    a = float(train_step(strategy, model, opt, x, y, args)[0])
    b = float(train_step(again, m2, o2, x, y, args)[0])
    assert a == b, ("resumed step differs", a, b)
    return a


def activations(comm):
    """Activation bytes one forward keeps (memory ledger): a cp rank against one process
    with tiled attention (which, like the ring, keeps q, k, v, y and lse, no (T, T)); then
    both with --ckpt-activations (each block keeps only its input)."""
    x, y = batch(0, 1, CONFIG, SEED)
    tiled = GPTConfig(**{**CONFIG.to_dict(), "attention": "tiled"})
    row = {"ranks": comm.size}
    for ckpt in (False, True):
        args = flags(f"cp{comm.size}" + (CKPT if ckpt else ""))
        ref = SingleProcess(ckpt_activations=args.ckpt_activations).build_model(
            tiled, SEED, "float64")
        one = memory.activation_bytes(ref(x, y)[1], ref.parameters())
        strategy = make_strategy(args, ProcessGroup.world(args.comm))
        model = strategy.build_model(CONFIG, SEED, "float64")
        mine = memory.activation_bytes(model(x, y)[1], model.parameters())
        tail = "_ckpt" if ckpt else ""
        row.update({"one_process" + tail: one, "per_rank" + tail: mine,
                    "ratio" + tail: mine / one})
    return row


def check_mesh(comm):
    """The cp axis of DeviceMesh: each group's members, from every rank's coordinates."""
    from minidist.comm import DeviceMesh
    cp = comm.size // 2 if comm.size == 4 else comm.size
    dp = comm.size // cp
    mesh = DeviceMesh(dp=dp, cp=cp, world=minidist.comm.init())
    got = {axis: sorted(mesh_members(getattr(mesh, axis))) for axis in ("cp", "dp", "dpcp")}
    want_cp = [mesh.rank_of(mesh.dp_rank, 0, 0, c) for c in range(cp)]
    want_dp = [mesh.rank_of(d, 0, 0, mesh.cp_rank) for d in range(dp)]
    assert got == {"cp": want_cp, "dp": want_dp, "dpcp": list(range(comm.size))}, got
    if comm.rank == 0:
        print("MESH " + json.dumps({"dp": dp, "cp": cp, "cp_group_of_0": want_cp}), flush=True)


def mesh_members(group):
    """World ranks of a group's members (allgather over it)."""
    buf = np.zeros(group.size)
    mine = np.array([float(MPI.COMM_WORLD.rank)])
    group.all_gather(buf, mine)
    return [int(v) for v in buf]


def ring_gradcheck(comm, B=2, T=8, n_head=2, C=4):
    """RingSelfAttention (minidist/cp/ring.py) on the world: each rank's (B, T/N, 3C) qkv its
    own, every rank's output in the loss, so the dk and dv a rank computes for another's
    keys must reach that rank (sent home) and be right there. Zig-zag and naive, tiles of 2
    positions; zig-zag also with dropout on the weights (keyed masks: the same every call).
    The largest |backward - central difference| over the ranks, per case."""
    group = ProcessGroup.world()
    n, r = group.size, group.rank
    rng = np.random.default_rng([9, r])
    out = {}
    for split, p in (("zigzag", 0.0), ("naive", 0.0), ("zigzag", 0.25)):
        ring = RingContext(group, split=split, block=2)
        ring.restore([layout(T, n, s, split) for s in range(n)])   # (what RingContext.part sets)
        site = DropoutSite(DropoutKeys(5), "transformer.h.0.attn.attn_dropout") if p else None
        row = dist_gradcheck(f"RingSelfAttention {split} p={p}",
                             lambda t: RingSelfAttention.apply(t, n_head, ring, p, site, None),
                             rng.standard_normal((B, T // n, 3 * C)), comm, "sharded", "sharded")
        out[f"{split} p={p}"] = comm.allreduce(row["max_abs_diff"], op=MPI.MAX)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=None, help="default: cp2,cp2+naive (2 ranks)")
    p.add_argument("--resume-runs", default="", help="runs whose checkpoint is saved and "
                   "loaded back (check_reload)")
    cli, comm = start(p)
    check_mesh(comm)
    runs = cli.runs.split(",") if cli.runs else ["cp2", "cp2+naive"]
    refs = {}
    for name in runs:
        row = run(name, refs, comm, cli.tol, name in cli.resume_runs.split(","))
        if comm.rank == 0:
            print("RESULT " + json.dumps(row), flush=True)
    if comm.size == 2:
        row = ring_gradcheck(comm)
        if comm.rank == 0:
            print("GRADCHECK " + json.dumps(row), flush=True)
    if comm.size in (2, 4):                     # cp 2, cp 4 (8 ranks: the compositions only)
        row = activations(comm)
        if comm.rank == 0:
            print("MEMORY " + json.dumps(row), flush=True)
    if comm.size == 4:                          # cp 2 x tp 2, without and with SP
        x, y = batch(0, 2, CONFIG, SEED)
        row = sp_activations(flags, lambda a: make_strategy(a, ProcessGroup.world(a.comm)),
                             CONFIG, SEED, x, y)
        if comm.rank == 0:
            print("MEMORY_SP " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
