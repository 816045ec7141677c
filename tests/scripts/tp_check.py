"""Tensor parallelism on 2 or 4 ranks against one process, float64, in one mpiexec run.

    mpiexec -n 2 python tests/scripts/tp_check.py                # gradchecks, tp 2, tp 2 + SP,
                                                                 # memory, bytes, files, refusals
    mpiexec -n 4 python tests/scripts/tp_check.py --runs tp4,tp2xdp2,tp2xdp2+sp,tp4+sp
    mpiexec -n 2 python tests/scripts/tp_check.py --only gradcheck

Every rank also trains the single-process reference (SingleProcess, the whole global batch,
dropout 0.1, clipping at 0.05 so every step clips); each run builds its strategy from
train_gpt's own flags (make_strategy) and trains through the loop's train_step. Checks: losses,
grad norms and gathered parameters equal the reference to --tol; replicated parameters
bitwise equal across tp ranks. Rank 0 prints `RESULT {json}` lines for
tests/test_tensor_parallel.py. Any failure raises and the abort handler ends the job.
"""
import argparse
import json
import os
import sys
import tempfile
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_probes  # noqa: E402
from exact import max_abs, run_steps, worst_over_ranks  # noqa: E402

from minidist import backend
import minidist.comm  # noqa: E402
from minidist.comm import trace  # noqa: E402
from mpi4py import MPI  # noqa: E402  (after minidist.comm: MPI starts in comm.init())
from minidist.nn import GPTConfig  # noqa: E402
from minidist.nn.safetensors import load_file  # noqa: E402
from minidist.strategy import checkpoint  # noqa: E402
from minidist.train.args import train_parser  # noqa: E402
from minidist.comm import ProcessGroup  # noqa: E402
from minidist.strategy.base import SingleProcess  # noqa: E402
from minidist.train.strategy import make_strategy  # noqa: E402

# vocab 30: tp 2 splits it evenly, tp 4 pads it to 32 (two zero rows on the last rank)
CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=8, vocab_size=30, dropout=0.1)
SEED = 7
# Dropout masks are keyed by the rows' places in the global batch
# (minidist/autograd/dropout_keys.py): every run, dp and grad-accum included, draws one
# process's
RUNS = {"tp2": [], "tp2+sp": ["--sequence-parallel"],
        "tp2+sp+ckpt": ["--sequence-parallel", "--ckpt-activations"],
        "tp4": [], "tp4+sp": ["--sequence-parallel"],
        "tp2xdp2": ["--dp", "2"],
        "tp2xdp2+sp": ["--dp", "2", "--sequence-parallel", "--grad-accum", "2"],
        "tp2xdp2+zero1": ["--dp", "2", "--zero", "1"],
        "tp2xdp2+zero2+sp": ["--dp", "2", "--zero", "2", "--sequence-parallel",
                             "--grad-accum", "2"],
        "tp2xdp2+zero3": ["--dp", "2", "--zero", "3"],
        "tp2xdp2+zero3+sp+ckpt": ["--dp", "2", "--zero", "3", "--sequence-parallel",
                                  "--ckpt-activations"]}


def flags(name, *extra):
    """train_gpt's flags for run `name`: --tp from the name, the rest from RUNS."""
    tp = name.split("+")[0].split("x")[0][2:]
    c = CONFIG
    return train_parser().parse_args([
        "--tp", tp, "--n-layer", str(c.n_layer), "--n-head", str(c.n_head), "--n-embd",
        str(c.n_embd), "--block-size", str(c.block_size), "--dropout", str(c.dropout),
        "--batch-size", "8", "--steps", "3", "--lr", "1e-2", "--grad-clip", "0.05",
        "--dtype", "float64", "--seed", str(SEED), *RUNS.get(name, []), *extra])  # last wins


def config_of(args):
    return GPTConfig(**{**CONFIG.to_dict(), "dropout": args.dropout})


def train(strategy, args):
    return run_steps(strategy, args, config_of(args), args.seed, args.dtype)[:4]


def max_diff(a, b):
    assert list(a) == list(b), (list(a)[:4], list(b)[:4])
    return max_abs(np.asarray(a[n]) - np.asarray(b[n]) for n in a)


def host_state(model):
    return {n: np.asarray(p.data) for n, p in model.named_parameters()}


def check_replicas_equal(model, mesh):
    """Replicated parameters bitwise the same on every rank of the tp group; every
    parameter (shard) bitwise the same on every rank of the dp group."""
    crc_rep = crc_all = 0
    for _, p in model.named_parameters():
        crc_all = zlib.crc32(np.ascontiguousarray(p.data).tobytes(), crc_all)
        if p.tp_split is None:
            crc_rep = zlib.crc32(np.ascontiguousarray(p.data).tobytes(), crc_rep)
    crcs = mesh.tp.comm.allgather(crc_rep)
    assert len(set(crcs)) == 1, f"replicated parameters differ across tp ranks: {crcs}"
    crcs = mesh.dp.comm.allgather(crc_all)
    assert len(set(crcs)) == 1, f"parameters differ across dp replicas: {crcs}"


def compare(name, refs, comm, tol, tmp):
    args = flags(name)
    if args.dropout not in refs:          # the single-process run with the same dropout
        refs[args.dropout] = train(SingleProcess(), flags("tp1", "--dropout",
                                                          str(args.dropout)))
    ref = refs[args.dropout]
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    model, opt, losses, norms = train(strategy, args)
    ref_model, ref_opt, ref_losses, ref_norms = ref
    full = strategy.full_state_dict()              # on the ranks of dp rank 0 under ZeRO
    param_diff = worst_over_ranks(MPI.COMM_WORLD, max_diff(full, host_state(ref_model))
                                  if full else 0.0)
    result = {"run": name, "ranks": comm.size, "tp": strategy.group.size,
              "dp": strategy.mesh.shape["dp"], "steps": args.steps,
              "loss_diff": max_abs(np.subtract(losses, ref_losses)),
              "norm_diff": max_abs(np.subtract(norms, ref_norms)),
              "param_diff": param_diff, "norms": norms,
              "losses": losses}
    for key in ("loss_diff", "norm_diff", "param_diff"):
        assert result[key] <= tol, (name, key, result)
    assert min(norms) > args.grad_clip, f"{name}: clipping never happened: {norms}"
    check_replicas_equal(model, strategy.mesh)
    if name == "tp2":
        result.update(check_files(strategy, model, opt, ref, args, tmp))
    return result


def check_files(strategy, model, opt, ref, args, tmp):
    """save_pretrained writes the full model (== the reference's file); --save writes a
    single-process checkpoint that one process and a TP run both load."""
    ref_model, ref_opt = ref[0], ref[1]
    mine, theirs = os.path.join(tmp, "tp_pretrained"), os.path.join(tmp, "ref_pretrained")
    model.save_pretrained(mine, dtype="float64")
    if strategy.rank == 0:
        ref_model.save_pretrained(theirs, dtype="float64")
    MPI.COMM_WORLD.Barrier()
    a, b = load_file(os.path.join(mine, "model.safetensors"))[0], \
        load_file(os.path.join(theirs, "model.safetensors"))[0]
    assert {n: v.shape for n, v in a.items()} == {n: v.shape for n, v in b.items()}
    pretrained_diff = max_diff(a, b)
    assert open(os.path.join(mine, "config.json")).read() == \
        open(os.path.join(theirs, "config.json")).read()
    ckpt = os.path.join(tmp, "tp_ckpt")
    strategy.save(ckpt, model, opt, args.steps, {"dropout": model.dropout_keys.state_dict()}, {})
    one = SingleProcess()          # the checkpoint in one process: parameters and Adam state
    m1 = one.build_model(config_of(args), SEED + 1, "float64")
    o1 = one.build_optimizer(m1, args)
    checkpoint.load_checkpoint(ckpt, m1, o1)
    ckpt_diff = max_diff(host_state(m1), host_state(ref_model))
    sa, sb = o1.state_dict()["state"], ref_opt.state_dict()["state"]
    adam_diff = max_abs(max_diff({k: v for k, v in sa[n].items() if k != "step"},
                                 {k: v for k, v in sb[n].items() if k != "step"}) for n in sb)
    again = make_strategy(args, ProcessGroup.world(args.comm))     # and back into a fresh tp run
    m2 = again.build_model(config_of(args), SEED + 1, "float64")
    o2 = again.build_optimizer(m2, args)
    again.load(ckpt, m2, o2)
    reload_diff = max_diff(m2.full_state_dict(), host_state(ref_model))
    adam_back = max_abs(o2.state[n][k] - opt.state[n][k]
                        for n in opt.state for k in ("exp_avg", "exp_avg_sq"))
    out = {"pretrained_diff": pretrained_diff, "ckpt_diff": ckpt_diff, "adam_diff": adam_diff,
           "reload_diff": reload_diff, "adam_reload_diff": adam_back}
    assert all(v <= 1e-10 for v in out.values()), out
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=None, help="default: tp2,tp2+sp,tp2+sp+ckpt (2 ranks)")
    p.add_argument("--only", default=None,
                   help="gradcheck | memory | activations | traffic | refusals")
    p.add_argument("--tol", type=float, default=1e-10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arrays live (tests/mpirun.py passes pytest's --device)")
    cli = p.parse_args()
    minidist.comm.init()   # MPI_Init, the abort hooks, the watchdog
    backend.set_device(cli.device)   # numpy or cupy, on every rank
    comm = MPI.COMM_WORLD
    tmp = comm.bcast(tempfile.mkdtemp(prefix="tp_check_") if comm.rank == 0 else None)

    def emit(tag, row):
        if comm.rank == 0:
            print(f"{tag} " + json.dumps(row), flush=True)

    extras = ["gradcheck", "memory", "activations", "traffic", "refusals"] \
        if comm.size == 2 else []
    for what in ([cli.only] if cli.only else extras):
        trace.reset_counters()
        for row in getattr(tp_probes, what)(comm, CONFIG, flags):
            emit(what.upper(), row)
    if cli.only:
        return
    runs = cli.runs.split(",") if cli.runs else (["tp2", "tp2+sp", "tp2+sp+ckpt"]
                                                 if comm.size == 2 else
                                                 ["tp4", "tp2xdp2", "tp2xdp2+sp", "tp4+sp",
                                                  "tp2xdp2+zero1", "tp2xdp2+zero2+sp",
                                                  "tp2xdp2+zero3", "tp2xdp2+zero3+sp+ckpt"])
    refs = {}
    for name in runs:
        emit("RESULT", compare(name, refs, comm, cli.tol, tmp))


if __name__ == "__main__":
    main()
