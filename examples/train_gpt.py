"""Train a GPT on one process, or on every rank of an MPI job (data parallel by default).

    mpirun -n 4 python examples/train_gpt.py            # the main job: DDP over 4 ranks
    python examples/train_gpt.py                        # Python stdlib sources, one process
    mpirun -n 2 python examples/train_gpt.py --grad-accum 2 --ddp bucketed --comm mpi
    mpirun -n 4 python examples/train_gpt.py --tp 2 --zero 1         # TP inside, ZeRO across
    mpirun -n 4 python examples/train_gpt.py --pp 2 --dp 2           # 1F1B stages, DDP across
    python examples/train_gpt.py --data input.txt --steps 2000 --save ckpt --resume auto

Where to read what happens:
    minidist/train/strategy.py  make_strategy: the composition, TP -> PP -> CP -> DDP/ZeRO
    minidist/train/step.py      one optimizer step, the same for every strategy, in one screen
    minidist/train/loop.py      the loop around it: schedule, logs, evaluation, checkpoints
Flags: python examples/train_gpt.py --help (with their defaults). A bad flag, data file,
checkpoint or output path is one `error:` line and exit status 2 (--traceback shows where),
before step 0. Ctrl-C stops every rank at the step boundary (saving it with --save; exit 130);
a loss that is not finite stops the run without saving. Text from a checkpoint:
python examples/sample.py --resume ckpt --prompt "def ".
"""
import os

from minidist.launcher import (bound_threads, interrupted_while_loading, placement,
                               set_thread_env, world_size_from_env)
from minidist.train import preemption

# a scheduler's SIGTERM from the first instant on is one line and exit 75, "requeue me" (143
# without --save); loading numpy and MPI takes a second or more: noted now, ended once MPI
# has started
LOADING = preemption.WhileLoading()

# BLAS reads its thread count when numpy loads it: 4 ranks sharing 2 cores must not start
# 2 threads each, so this comes before anything imports numpy (--threads also applies live).
THREADS_EXPORTED = "OPENBLAS_NUM_THREADS" in os.environ     # the user's count: kept
set_thread_env()

try:        # (a second or so, longer on a cluster's file system: Ctrl-C here is one line)
    import warnings

    # mpi4py warns of a thread level it cannot read once per rank as it loads; the flag
    # checks name MPI4PY_RC_THREAD_LEVEL in the run's one error line instead
    warnings.filterwarnings("ignore", message="mpi4py.rc.thread_level")

    from minidist import backend, comm
    from minidist.train.args import train_parser
    from minidist.strategy import save_lock
    from minidist.strategy.checkpoint import CheckpointError
    from minidist.train.cli import agree_on_flags, flag_problem, run_main
    from minidist.train.bpe import TokenizerError
    from minidist.train.data import DataError
    from minidist.train.loop import train
    from minidist.train.saves import claim_save
except KeyboardInterrupt:
    interrupted_while_loading()


def main(args):
    # every flag's range and combination, the files and the device, before any work; on
    # this rank alone (a path or a GPU one node lacks), so several ranks agree below
    problem = flag_problem(args)
    several = world_size_from_env() > 1 or args.zero
    if problem is not None and (not several or comm.env_problems("ring", None)):
        raise problem         # one process, or a MINIDIST_* variable: the job's, every rank's
    if problem is None:
        backend.setup(threads=args.threads, device=args.device)  # BLAS threads; numpy or cupy
    world = None                       # one process: no MPI at all
    if several:
        # MPI_Init; an uncaught exception or an early exit on one rank aborts the whole job;
        # a collective waiting longer than --comm-timeout aborts it too, naming who is missing
        world = comm.init(args.comm if problem is None else "ring",
                          timeout=args.comm_timeout if problem is None else None,
                          sync_comm=args.sync_comm)
        agree_on_flags(world, problem)   # any rank's problem stops every rank, named once
        if args.threads is None and not THREADS_EXPORTED:
            # ranks the launcher bound to cores of their own use them all (not cores // ranks)
            bound = bound_threads(world.all_gather_object(placement()), world.rank)
            if bound:
                backend.set_blas_threads(bound)
                if world.rank == 0:
                    print(f"note: the launcher bound each rank to cores of its own: {bound} "
                          "BLAS thread(s) on rank 0, one a core (--threads N sets them)")
    LOADING.stop_now()    # a SIGTERM while loading or starting MPI: exit 75 now, every rank
    # --save: this run's alone (rank 0 holds its lock until the run ends), seen by every rank
    held_save = claim_save(world, args.save)
    try:
        return train(args, world)
    finally:
        save_lock.release(held_save)


if __name__ == "__main__":
    run_main(main, parser=train_parser,
             user_errors=(CheckpointError, DataError, TokenizerError, comm.LaunchMismatch))
