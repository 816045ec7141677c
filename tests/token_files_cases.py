"""Shared by the token-file tests (tests/test_token_files.py, test_init_from_gpt2.py): the
small run's flags, a nanoGPT token file written, and a run trained as train_gpt.py would."""
import numpy as np

from minidist.train.args import train_parser
from minidist.train.cli import check_flags
from minidist.train.loop import train


SMALL = ["--block-size", "16", "--batch-size", "4", "--lr", "1e-2", "--eval-iters", "1",
         "--eval-every", "0", "--sample", "0", "--log-every", "1", "--threads", "1"]


def nanogpt_file(path, tokens):
    np.asarray(tokens, dtype=np.uint16).tofile(path)


def _train(flags):
    args = train_parser().parse_args(flags)
    check_flags(args)                        # as train_gpt.py: takes --init-from's sizes
    return train(args)
