"""World rank 0 comes late to each save, as it does copying what it writes while the others
have little or nothing to copy (under DDP rank 0 writes the whole model and its optimizer:
42.7M parameters took it past a 1 s --comm-timeout on two shared cores), on two real ranks
under a 1 s collective timeout. The ranks wait for it untimed (saving.begin's wait_for_all);
before, rank 1 waited in begin's broadcast_object, a watched collective, and the job ended
("world ranks that did not arrive: [0]"). For tests/test_async_save.py.

    MINIDIST_COMM_TIMEOUT=1 mpiexec -n 2 python tests/scripts/save_late.py --save ck
"""
import argparse
import time

from commit_unseen import plan     # (tests/scripts/commit_unseen.py: rank r's shard)
from minidist import backend, comm
from minidist.strategy import saving


def main(args):
    world = comm.init("ring")
    backend.set_device(args.device)
    for step in (1, 2):
        if world.rank == 0:
            time.sleep(3)                  # copying what it writes, 3 s (3 timeouts)
        folder = saving.save_now(args.save, step, plan(world, step), world)
        if world.rank == 0:
            print(f"saved step {step} to {folder}", flush=True)


if __name__ == "__main__":
    cli = argparse.ArgumentParser()
    cli.add_argument("--save", required=True)
    cli.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    main(cli.parse_args())
