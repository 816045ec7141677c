"""open_data_shared (minidist/train/data_open.py) on every rank of a job: which ranks
tokenized the text, and the error every rank raises when one rank's --data is missing.
For tests/test_data.py.

    mpiexec -n 3 python tests/scripts/data_open_check.py --data FILE --cache-dir DIR \\
        --out DIR [--missing-on-rank R] [--other FILE --other-on-rank R]

Writes --out/rank<R>.json for each rank: {"built", "train_tokens"} or {"error"} (files: the
ranks' stdout lines interleave).
"""
import argparse
import json
import os

from minidist import backend, comm
from minidist.train.data import DataError
from minidist.train.data_open import open_data_shared

p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
p.add_argument("--cache-dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--missing-on-rank", type=int, default=None)
p.add_argument("--other", default=None, help="another text, read by --other-on-rank")
p.add_argument("--other-on-rank", type=int, default=None)
p.add_argument("--device", default="cpu")
args = p.parse_args()
backend.set_device(args.device)
world = comm.init()
if world.rank == args.missing_on_rank:
    args.data += ".not-on-this-node"
if world.rank == args.other_on_rank:
    args.data = args.other
args.tokenizer = args.init_from = None
try:
    data = open_data_shared(args, world)
    row = {"built": data.built, "train_tokens": data.meta["train_tokens"]}
except DataError as e:
    row = {"error": str(e)}
with open(os.path.join(args.out, f"rank{world.rank}.json"), "w") as f:
    json.dump(row, f)
