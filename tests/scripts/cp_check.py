"""Context parallelism (ring attention) on 2 or 4 ranks against one process, float64.

    mpiexec -n 2 python tests/scripts/cp_check.py                      # cp2, cp2 naive
    mpiexec -n 4 python tests/scripts/cp_check.py --runs cp4,cp4+naive,cp2xdp2,cp2xtp2
    mpiexec -n 2 python tests/scripts/cp_check.py --runs cp2+ckpt,cp2+naive+ckpt

Every rank also trains the single-process reference (SingleProcess, the whole global batch);
each run builds its strategy from train_gpt's own flags (make_strategy) and trains through
the loop's train_step (tests/scripts/exact.py). Checks: losses, grad norms and parameters
equal the reference to --tol; the bytes each rank sent on the cp group equal the formula of
minidist/cp/ring.py (a "+ckpt" run's recompute included); the activations each rank keeps,
without and with --ckpt-activations. Rank 0 prints `RESULT {json}` lines for
tests/test_context_parallel.py. Any failure raises and the abort handler ends the job.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import batch, run_steps  # noqa: E402

from minidist import backend  # noqa: E402
import minidist.comm  # noqa: E402
from minidist.comm import trace  # noqa: E402
from mpi4py import MPI  # noqa: E402  (after minidist.comm: MPI starts in comm.init())
from minidist.cp.ring import ring_bytes  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.strategy import memory  # noqa: E402
from minidist.train.args import train_parser  # noqa: E402
from minidist.comm import ProcessGroup  # noqa: E402
from minidist.strategy.base import SingleProcess  # noqa: E402
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
        "cp2xdp2+zero3+accum": ["--dp", "2", "--zero", "3", "--grad-accum", "2"]}
CKPT = "+ckpt"      # any run + "+ckpt": with --ckpt-activations (the ring forward runs again
                    # inside backward); the reference stays one process without recompute


def flags(name):
    cp = name.split("+")[0].split("x")[0][2:]
    ckpt = ["--ckpt-activations"] if name.endswith(CKPT) else []
    c = CONFIG
    return train_parser().parse_args([
        "--cp", cp, "--n-layer", str(c.n_layer), "--n-head", str(c.n_head), "--n-embd",
        str(c.n_embd), "--block-size", str(c.block_size), "--dropout", "0",
        "--attention-block", str(c.attention_block), "--batch-size", "4", "--steps", "3",
        "--lr", "1e-2", "--grad-clip", "0.05", "--dtype", "float64", "--seed", str(SEED),
        *RUNS[name.removesuffix(CKPT)], *ckpt])


def full_params(strategy, model):
    """name -> host array of the whole model (gathered over tp under TensorParallel)."""
    if hasattr(strategy, "full_state_dict"):
        return strategy.full_state_dict()
    engine = getattr(strategy.inner, "engine", None)
    if engine is not None:                              # ZeRO: gathered on rank 0 ({} elsewhere)
        return engine.full_state_dict(root=0)
    return {n: np.asarray(backend.to_host(p.data)) for n, p in model.named_parameters()}


def step_ring_bytes(args, config, mesh):
    """Bytes one rank sends on the cp group in one step (minidist/cp/ring.py's formula)."""
    n = mesh.shape["cp"]
    rows = args.batch_size // mesh.shape["dp"] // args.grad_accum
    S = rows * (config.block_size // n) * (config.n_embd // mesh.shape["tp"]) * 8  # float64
    return ring_bytes(S, n, args.ckpt_activations) * config.n_layer * args.grad_accum


def run(name, ref, comm, tol):
    args = flags(name)
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    mesh = strategy.mesh
    sent0 = trace.bytes_sent("cp")
    model, _, losses, norms, _ = run_steps(strategy, args, CONFIG, SEED, "float64")
    sent = (trace.bytes_sent("cp") - sent0) / args.steps
    params = full_params(strategy, model)
    r_model, r_losses, r_norms = ref
    d_loss = max(abs(float(a) - float(b)) for a, b in zip(losses, r_losses))
    d_norm = max(abs(float(a) - float(b)) for a, b in zip(norms, r_norms))
    d_par = max(float(np.abs(params[n] - np.asarray(p.data)).max())
                for n, p in r_model.named_parameters()) if params else 0.0
    row = {"run": name, "loss_diff": d_loss, "norm_diff": d_norm, "param_diff": d_par,
           "bytes_sent": sent, "theory_sent": step_ring_bytes(args, CONFIG, mesh),
           "losses": [float(v) for v in losses]}
    worst = comm.allreduce(max(d_loss, d_norm, d_par), op=MPI.MAX)
    assert worst < tol, (name, row)
    assert sent == row["theory_sent"], (name, row)
    return row


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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=None, help="default: cp2,cp2+naive (2 ranks)")
    p.add_argument("--tol", type=float, default=1e-10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cli = p.parse_args()
    minidist.comm.init()
    backend.set_device(cli.device)
    comm = MPI.COMM_WORLD
    check_mesh(comm)
    runs = cli.runs.split(",") if cli.runs else ["cp2", "cp2+naive"]
    ref_args = flags("cp2")
    model, _, losses, norms, _ = run_steps(SingleProcess(), ref_args, CONFIG, SEED, "float64")
    for name in runs:
        row = run(name, (model, losses, norms), comm, cli.tol)
        if comm.rank == 0:
            print("RESULT " + json.dumps(row), flush=True)
    row = activations(comm)
    if comm.rank == 0:
        print("MEMORY " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
