"""Shared by the tests of examples/train_gpt.py with --ep (tests/test_ep_train.py,
tests/test_ep_pp_checkpoint.py): the tiny MoE model's flags and the --log-json rows read back."""
import json


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--lr", "1e-2", "--eval-iters", "2", "--log-every", "1",
        "--steps", "3", "--eval-every", "0", "--dtype", "float64", "--sample", "20",
        "--moe-experts", "4", "--moe-top-k", "2"]


def _rows(path):
    return [json.loads(line) for line in open(path)]
