"""Train a GPT on one process, or on every rank of an MPI job (data parallel by default).

    mpirun -n 4 python examples/train_gpt.py            # the main job: DDP over 4 ranks
    python examples/train_gpt.py                        # Python stdlib sources, one process
    mpirun -n 2 python examples/train_gpt.py --grad-accum 2 --ddp bucketed --comm mpi
    mpirun -n 4 python examples/train_gpt.py --tp 2 --zero 1         # TP inside, ZeRO across
    mpirun -n 4 python examples/train_gpt.py --pp 2 --dp 2           # 1F1B stages, DDP across
    python examples/train_gpt.py --data input.txt --steps 2000 --save ckpt --resume auto

Where to read what happens:
    minidist/train/strategy.py  make_strategy: the model split in order, TP -> PP -> DDP/ZeRO
    minidist/train/step.py      one optimizer step, the same for every strategy, in one screen
    minidist/train/loop.py      the loop around it: schedule, logs, evaluation, checkpoints
Flags: python examples/train_gpt.py --help. A bad flag, data file or checkpoint is one
`error:` line and exit status 2 (--traceback shows where).
"""
from minidist.train.args import train_parser
from minidist.train.checkpoint import CheckpointError
from minidist.train.cli import check_flags, run_main
from minidist.train.data import DataError
from minidist.train.loop import train


def main(args):
    check_flags(args)          # every flag's range and combination, before any work
    return train(args)


if __name__ == "__main__":
    run_main(main, train_parser().parse_args(), user_errors=(CheckpointError, DataError))
