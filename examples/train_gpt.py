"""Train a GPT on one process, or on every rank of an MPI job (data parallel by default).

    mpirun -n 4 python examples/train_gpt.py            # the main job: DDP over 4 ranks, ~4 min
    python examples/train_gpt.py                        # Python stdlib sources, ~5 min on 2 cores
    mpirun -n 2 python examples/train_gpt.py --grad-accum 2 --ddp bucketed --comm mpi
    python examples/train_gpt.py --data input.txt --steps 2000 --save ckpt
    python examples/train_gpt.py --resume ckpt --steps 3000

Flags: python examples/train_gpt.py --help; the loop is minidist/train/loop.py.
"""
from minidist.train.args import train_parser
from minidist.train.loop import train

if __name__ == "__main__":
    train(train_parser().parse_args())
