"""Sharded checkpoints under mpiexec: save, resume, reshard, and errors agreed on every rank.

    mpiexec -n 4 python tests/scripts/zero_ckpt_check.py --save /tmp/z --stage 3
    python -c "..."   (tests/test_zero_checkpoint.py: one process loads /tmp/z/ckpt, steps,
                       saves plain)
    mpiexec -n 2 python tests/scripts/zero_ckpt_check.py --load /tmp/z --stage 1

--save DIR: 2 steps at --stage, then DIR/ckpt (sharded), DIR/expected.npz (the full parameters,
gathered to rank 0), DIR/pretrained (save_pretrained from this stage); one more step, and a
fresh strategy resumed from DIR/ckpt takes the same step: bitwise the same shards. Then broken
copies: DIR/missing (rank 2's shard deleted) and DIR/mismatch (rank 1's shard from another
save): loading each must raise CheckpointError on EVERY rank, naming the shard, without a hang.
--load DIR: load DIR/ckpt at --stage on this many ranks: the full parameters equal
DIR/expected.npz bit for bit; one step, compared with DIR/after_1proc.npz (one process took it
from the same checkpoint); then DIR/plain (that process's plain checkpoint) loads here too.
Rank 0 prints `RESULT {json}`; any failure raises and aborts the job.
"""
import argparse
import json
import os
import shutil

import numpy as np

from minidist import backend
import minidist.comm
from minidist.comm import ProcessGroup
from mpi4py import MPI  # after minidist.comm: MPI starts in comm.init(), not here
from minidist.strategy.checkpoint import CheckpointError
from minidist.strategy.checkpoint_dirs import resolve
from minidist.train.args import train_parser
from minidist.train.step import train_step
from minidist.zero.checkpoint import shard_name
from minidist.zero.strategy import ZeroDataParallel
from exact import max_abs
from zero_check import CONFIG, SEED, batch

ARGS = train_parser().parse_args(["--lr", "1e-2", "--batch-size", "8"])


def fresh(comm, stage, name):
    strategy = ZeroDataParallel(ProcessGroup(comm, "ring", name=name), stage)
    model = strategy.build_model(CONFIG, SEED, "float64")
    return strategy, model, strategy.build_optimizer(model, ARGS)


def step(strategy, model, opt, k):
    return train_step(strategy, model, opt, *batch(k, ARGS.batch_size), ARGS)[0]


def shards(strategy):
    return {u.flat.name: u.param_shard.copy() for u in strategy.engine.units}


def expect_error(comm, strategy, model, opt, directory, needle):
    """Loading `directory` must fail on every rank, with a message naming `needle`."""
    try:
        strategy.load(directory, model, opt)
        msg = None
    except CheckpointError as e:
        msg = str(e)
    assert msg is not None and needle in msg, f"rank {comm.rank}: {msg!r}"
    assert all(comm.allgather(msg is not None)), "some rank did not raise"
    return msg


def save_side(cli, comm):
    strategy, model, opt = fresh(comm, cli.stage, "a")
    for k in range(2):
        step(strategy, model, opt, k)
    strategy.save(os.path.join(cli.save, "ckpt"), model, opt, 2, {}, {})
    full = strategy.engine.full_state_dict()
    if comm.rank == 0:
        np.savez(os.path.join(cli.save, "expected.npz"), **full)
    strategy.save_pretrained(model, os.path.join(cli.save, "pretrained"))
    step(strategy, model, opt, 2)
    straight = shards(strategy)
    strategy.save(os.path.join(cli.save, "other"), model, opt, 3, {}, {})
    resumed, model2, opt2 = fresh(comm, cli.stage, "b")
    resumed.load(os.path.join(cli.save, "ckpt"), model2, opt2)
    step(resumed, model2, opt2, 2)
    for name, a in shards(resumed).items():
        assert np.array_equal(a, straight[name]), f"resume differs in {name}"
    return {"resume_bitwise": True, **broken_copies(cli, comm, resumed, model2, opt2)}


def broken_copies(cli, comm, strategy, model, opt):
    n = comm.size
    if comm.rank == 0:          # copies of the checkpoint folders (not the --save dirs)
        ckpt, other = (resolve(os.path.join(cli.save, k)) for k in ("ckpt", "other"))
        for kind in ("missing", "mismatch"):
            shutil.copytree(ckpt, os.path.join(cli.save, kind))
        os.remove(os.path.join(cli.save, "missing", shard_name(2, n)))
        shutil.copy(os.path.join(other, shard_name(1, n)),
                    os.path.join(cli.save, "mismatch", shard_name(1, n)))
    comm.barrier()
    return {kind: expect_error(comm, strategy, model, opt, os.path.join(cli.save, kind),
                               shard_name(r, n))
            for kind, r in (("missing", 2), ("mismatch", 1))}


def load_side(cli, comm):
    strategy, model, opt = fresh(comm, cli.stage, "c")
    strategy.load(os.path.join(cli.load, "ckpt"), model, opt)
    full = strategy.engine.full_state_dict()
    if comm.rank == 0:
        want = np.load(os.path.join(cli.load, "expected.npz"))
        assert all(np.array_equal(full[n], want[n]) for n in want), "reshard changed params"
    step(strategy, model, opt, 2)
    full, diff = strategy.engine.full_state_dict(), 0.0
    if comm.rank == 0:
        want = np.load(os.path.join(cli.load, "after_1proc.npz"))
        diff = max_abs(full[n] - want[n] for n in want)
        assert diff < 1e-10, f"one step after resharding differs by {diff}"
    plain, model2, opt2 = fresh(comm, 2, "d")          # a plain checkpoint into stage 2
    plain.load(os.path.join(cli.load, "plain"), model2, opt2)
    full = plain.engine.full_state_dict()
    if comm.rank == 0:
        assert all(np.array_equal(full[n], want[n]) for n in want), "plain -> ZeRO differs"
    return {"reshard_bitwise": True, "step_diff_vs_1proc": diff, "plain_to_zero2": True}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--save", default=None, metavar="DIR")
    p.add_argument("--load", default=None, metavar="DIR")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arrays live (tests/mpirun.py passes pytest's --device)")
    cli = p.parse_args()
    minidist.comm.init()   # MPI_Init, the abort hooks, the watchdog
    backend.set_device(cli.device)   # numpy or cupy, on every rank
    comm = MPI.COMM_WORLD
    result = save_side(cli, comm) if cli.save else load_side(cli, comm)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"ranks": comm.size, "stage": cli.stage, **result}),
              flush=True)


if __name__ == "__main__":
    main()
