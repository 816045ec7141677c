"""Train a GPT on one process (parallel strategies land in their own issues).

    python examples/train_gpt.py                        # Python stdlib sources, ~5 min on 2 cores
    python examples/train_gpt.py --data input.txt --steps 2000 --save ckpt
    python examples/train_gpt.py --resume ckpt --steps 3000

Flags: python examples/train_gpt.py --help; the loop is minidist/train/loop.py.
"""
from minidist.train.args import train_parser
from minidist.train.loop import train

if __name__ == "__main__":
    train(train_parser().parse_args())
