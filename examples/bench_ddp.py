"""Tokens/s and exposed communication of the three DDP modes, on however many ranks you start.

    mpirun -n 4 python examples/bench_ddp.py                      # the main job's model
    mpirun -n 2 python examples/bench_ddp.py --comm mpi --bucket-mb 4

Every mode trains its own copy of the model on the same global batch (split over the ranks),
through the training loop's own train_step; the modes take turns, `--steps` steps per turn for
`--rounds` rounds, so a noisy shared machine slows them alike. On one rank a plain
SingleProcess run is timed too, as the baseline. Rank 0 prints one JSON line per mode:
{"mode", "ranks", "algo", "tokens_per_s", "ms_per_step", "compute_ms", "exposed_comm_ms",
"comm_mib_per_step", "buckets", ...}: medians over the timed steps, where
    compute_ms         forward + backward of this rank (overlapped: comm threads compete
                       for it)
    exposed_comm_ms    how long the step then waited in sync_grads for the gradients
    comm_mib_per_step  the bytes this rank sent in the last step, in MiB (2**20 bytes)
and ms_per_step is the whole step (also clip, AdamW, the loss all-reduce), slowest rank.
Every flag is checked before MPI starts (a bad one is one `error:` line from rank 0, exit
status 2): --batch-size must split evenly over the ranks.
"""
import json
import math
import time
from types import SimpleNamespace

import numpy as np

from minidist import backend, comm
from minidist.ddp.sync import MODES
from minidist.launcher import world_size_from_env
from minidist.nn import GPTConfig
from minidist.train.args import add_model_args, arch_fields, train_parser
from minidist.train.loop import moe_fields
from minidist.ddp.strategy import DataParallel
from minidist.train.step import train_step
from minidist.strategy.base import SingleProcess
from minidist.train.args import check_at_least, example_parser


# (flag, lowest allowed value, what it is); None (not given) is not checked
AT_LEAST = (("--steps", 1, "timed steps per mode per round"),
            ("--rounds", 1, "turns of timed steps"), ("--warmup", 0, "untimed steps"),
            ("--batch-size", 1, "the global batch, in sequences"),
            ("--n-layer", 1, "transformer blocks"), ("--n-head", 1, "attention heads"),
            ("--n-embd", 1, "the embedding width"), ("--block-size", 1, "the context length"),
            ("--vocab-size", 1, "token ids"), ("--threads", 1, "BLAS threads per rank"))


def parse():
    """(the flags, checked: check_flags; the model's config)."""
    p = add_model_args(example_parser(__doc__))
    p.add_argument("--vocab-size", type=int, default=256, help="the random tokens' vocabulary")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"DDP modes to time, comma-separated, from {', '.join(MODES)}")
    p.add_argument("--comm", default="ring", choices=("ring", "naive", "mpi", "nccl"),
                   help="the all-reduce's algorithm")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP bucket size, MiB (> 0)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=3, help="turns of timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode, first")
    p.add_argument("--threads", type=int, default=None,
                   help="BLAS threads per rank (default: the node's cores over its ranks)")
    args = p.parse_args()
    return args, check_flags(p, args)


def check_flags(p, args):
    """Every flag, before MPI starts and alike on every rank (p.error: one `error:` line from
    rank 0, exit status 2); returns the model's config, made from them."""
    check_at_least(p, args, AT_LEAST)
    for mode in args.modes.split(","):
        if mode not in MODES:
            p.error(f"--modes {args.modes}: {mode!r} is not one of {', '.join(MODES)}")
    if not 0 < args.bucket_mb < math.inf:
        p.error(f"--bucket-mb {args.bucket_mb}: the DDP bucket size must be positive")
    problems = comm.env_problems(args.comm)      # MINIDIST_COMM_WAIT=..., read by comm.init
    if problems:
        p.error("; ".join(problems))
    ranks = world_size_from_env()
    if args.batch_size % ranks:
        p.error(f"--batch-size {args.batch_size}: does not split over {ranks} ranks; give a "
                f"multiple of {ranks}")
    try:
        config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           block_size=args.block_size, vocab_size=args.vocab_size,
                           dropout=args.dropout, attention=args.attention,
                           attention_block=args.attention_block, **arch_fields(args),
                           **moe_fields(args))
    except ValueError as e:             # --dropout 1.5, n_embd not a multiple of n_head, ...
        p.error(f"model flags: {e}")
    return config


def setup(name, strategy, config, args):
    model = strategy.build_model(config, args.seed, args.dtype)
    return {"name": name, "strategy": strategy, "model": model, "times": [], "first": 0,
            "opt": strategy.build_optimizer(model, args)}


def run(run_, step, args, group, timed):
    """One step of the loop's train_step on global batch `step`; the slowest rank's time."""
    rng = np.random.default_rng([args.seed, step])
    x = rng.integers(0, args.vocab_size, (args.batch_size, args.block_size))
    group.barrier()
    start = time.perf_counter()
    train_step(run_["strategy"], run_["model"], run_["opt"], x, np.roll(x, -1, 1), args)
    backend.synchronize()
    buf = np.array([time.perf_counter() - start])
    group.all_reduce(buf, op="max")
    if timed:
        run_["times"].append(float(buf[0]))
    else:
        stats = getattr(run_["strategy"], "stats", None)
        run_["first"] = stats.count if stats is not None else 0


def report(run_, args, group):
    ms = 1e3 * float(np.median(run_["times"]))
    row = {"mode": run_["name"], "ranks": group.size, "algo": args.comm,
           "tokens_per_s": round(args.batch_size * args.block_size / ms * 1e3),
           "ms_per_step": round(ms, 1), "batch_size": args.batch_size,
           "block_size": args.block_size, "params": run_["model"].num_parameters(),
           "threads": backend.blas_threads(), "device": backend.device()}
    strategy = run_["strategy"]
    if isinstance(strategy, DataParallel):
        stats = list(strategy.stats.rows)[run_["first"] - strategy.stats.count:]
        row.update(compute_ms=_median_ms(stats, "compute_s"),
                   exposed_comm_ms=_median_ms(stats, "exposed_s"),
                   comm_mib_per_step=round(stats[-1]["bytes_sent"] / 2**20, 3),
                   buckets=len(getattr(strategy.ddp, "buckets", ())), bucket_mb=args.bucket_mb)
    return row


def _median_ms(stats, key):
    return round(1e3 * float(np.median([s[key] for s in stats])), 1)


def main():
    cli, config = parse()
    # the step's and the optimizer's settings at train_gpt.py's defaults (AdamW, --lr 1e-4;
    # the optimizer is not what this times), then this bench's own flags: set one by one
    # here, the optimizer's --beta1 and --beta2 were missing (an AttributeError on every rank)
    args = SimpleNamespace(**{**vars(train_parser().parse_args(["--lr", "1e-4"])),
                              **vars(cli)})
    backend.setup(threads=args.threads, device=args.device)   # before the first numpy work
    group = comm.init(args.comm)          # MPI_Init, abort hooks, watchdog; the world group
    runs = [setup("single process", SingleProcess(), config, args)] if group.size == 1 else []
    runs += [setup(mode, DataParallel(group, mode, args.bucket_mb), config, args)
             for mode in args.modes.split(",")]
    for r in runs:
        for step in range(args.warmup):
            run(r, step, args, group, timed=False)
    for rnd in range(args.rounds):
        for r in runs:
            for step in range(args.steps):
                run(r, 100 + rnd * args.steps + step, args, group, timed=True)
    for r in runs:
        row = report(r, SimpleNamespace(**vars(args)), group)
        if group.rank == 0:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
