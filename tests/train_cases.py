"""Shared by the training loop's tests (tests/test_train.py, tests/test_train_resume.py): the
tiny model's flags, its parsed arguments and the --log-json rows read back."""
import json

from minidist.train.args import train_parser
from mpirun import device_flags


TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--lr", "1e-2", "--eval-iters", "2", "--sample", "0",
        "--log-every", "1"]


def _args(device, corpus, tmp, *extra):
    """train_gpt's flags: TINY on `device` (the device fixture: pytest's --device)."""
    return train_parser().parse_args(TINY + [*device_flags(device), "--data", corpus,
                                             "--cache-dir", str(tmp / "cache"), *extra])


def _rows(path):
    return [json.loads(line) for line in open(path)]
