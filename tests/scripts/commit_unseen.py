"""World rank 0 commits a save only with every rank's files as it sees them whole
(minidist/strategy/saving.py, Save.commit), on two real ranks. Each rank works in a folder
of its own (`--node-dirs A,B`: rank r in the r-th), where `ck` names the same folder at the
first save (B/ck is a symlink to A/ck): step 1 is committed. At step 2 rank 1's shard does
not reach rank 0 whole, as on a --save the nodes do not share:

    --case unseen      rank 1's ck is now an empty folder of its own disk: rank 1 does not
                       see the temporary folder rank 0 made, and its write fails
    --case elsewhere   rank 1's ck is now a folder of its own disk that holds a folder of
                       the temporary's name (so rank 1's own check, write_file's, passes):
                       its shard is not in A/ck at all
    --case truncated   rank 1's shard is cut to half its bytes once written: rank 0 sees
                       part of it

Every rank raises the same CheckpointError; run_main (minidist/train/cli.py) makes it one
`error:` line from rank 0 and exit 2, as in examples/train_gpt.py. For tests/test_async_save.py.

    mpiexec -n 2 python tests/scripts/commit_unseen.py --node-dirs A,B --case elsewhere
"""
import argparse
import os

from minidist import backend, comm
from minidist.strategy import saving
from minidist.strategy.checkpoint import CheckpointError
from minidist.train.cli import run_main


def plan(world, step):
    """Rank r's shard (its values on --device, copied to the host as a save plan does);
    rank 0 also describes the checkpoint's manifest."""
    w = backend.get_xp().full(10, float(10 * step + world.rank))
    name = f"shard-{world.rank:05d}-of-{world.size:05d}.safetensors"
    return saving.SavePlan(files=[saving.arrays_file(name, {"w": saving.host_copy(w)})],
                           manifests=[saving.Manifest("", world.size)] if world.rank == 0
                           else [])


def main(args):
    world = comm.init("ring")
    backend.set_device(args.device)
    nodes = args.node_dirs.split(",")
    os.chdir(nodes[world.rank])
    if world.rank == 1:                                 # the first save: one shared folder
        os.symlink(os.path.abspath(os.path.join(nodes[0], "ck")), "ck")
    world.barrier()
    saving.save_now("ck", 1, plan(world, 1), world)
    if world.rank == 0:
        print("committed step 1", flush=True)
    save = saving.begin("ck", 2, plan(world, 2), world)
    if world.rank == 1 and args.case != "truncated":
        os.remove("ck")                                 # a ck of rank 1's own disk
        os.makedirs(save.tmp if args.case == "elsewhere" else "ck")
    save.write()
    if world.rank == 1 and args.case == "truncated":
        shard = os.path.join(save.tmp, "shard-00001-of-00002.safetensors")
        os.truncate(shard, os.path.getsize(shard) // 2)
    save.commit()
    print(f"rank {world.rank}: step 2 committed", flush=True)    # (never: commit raises)


if __name__ == "__main__":         # (tests/scripts/save_late.py imports plan)
    cli = argparse.ArgumentParser()
    cli.add_argument("--node-dirs", required=True)
    cli.add_argument("--case", choices=("unseen", "elsewhere", "truncated"), required=True)
    cli.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    run_main(main, cli.parse_args(), user_errors=(CheckpointError,))
