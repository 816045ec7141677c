"""Dropout in every layout against one process, float64, on 4 ranks.

    mpiexec -n 4 python tests/scripts/dropout_check.py                   # every run below
    mpiexec -n 4 python tests/scripts/dropout_check.py --runs dp4,pp2xdp2

The masks are keyed by (step, site, the row's number in the global batch)
(minidist/autograd/dropout_keys.py), so with --dropout 0.1 every layout trains one process's
numbers: data parallelism (DDP, ZeRO), --grad-accum, pipelines (their micro-batches and
schedules; with tiled attention and with selective recompute, which draw the weights'
numbers again in a micro-batch's backward), tensor and sequence parallelism, context
parallelism (the ring's tiles and the residual stream by global position; also inside
pipeline stages), activation recompute, and their compositions.
Every rank also trains the reference: one process, the whole global batch, --grad-accum 1, no
recompute (one run per depth). Each run builds its strategy from train_gpt's flags
(make_strategy) and trains through the loop's train_step (tests/scripts/exact.py); losses,
gradient norms and every parameter (gathered as a checkpoint gathers them) must equal the
reference's to --tol. The reference must differ from the same run without dropout, so
dropout did act. Rank 0 prints one `RESULT {json}` line per run for tests/test_dropout_keys.py;
any failure raises and aborts the job.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import max_abs, run_steps, start, whole_params, worst_over_ranks  # noqa: E402

from minidist.comm import ProcessGroup  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.strategy.base import SingleProcess  # noqa: E402
from minidist.train.args import train_parser  # noqa: E402
from minidist.train.strategy import make_strategy  # noqa: E402

PP2 = ["--pp", "2", "--micro-batches", "2"]
RUNS = {"dp4": [],                                             # DDP, overlapped
        "dp4+accum2": ["--grad-accum", "2"],
        "dp4+zero3": ["--zero", "3"],
        "dp4+zero2+accum2+recompute": ["--zero", "2", "--grad-accum", "2",
                                       "--ckpt-activations"],
        "pp2xdp2": PP2,
        "pp2xdp2+gpipe+recompute": [*PP2, "--schedule", "gpipe", "--ckpt-activations"],
        "pp2xdp2+zbh1+zero1": [*PP2, "--schedule", "zb-h1", "--zero", "1"],
        "pp2xdp2+v2": [*PP2, "--pp-virtual", "2", "--n-layer", "4"],
        "pp2xdp2+tiled": [*PP2, "--attention", "tiled", "--attention-block", "2"],
        # selective recompute: each micro-batch's backward draws its forward's masks again,
        # later forwards having moved the keys on (attention.py Redo)
        "pp2xdp2+zbh1+selective": [*PP2, "--schedule", "zb-h1", "--attention", "recompute"],
        "pp2xdp2+v2+selective": [*PP2, "--pp-virtual", "2", "--n-layer", "4", "--attention",
                                 "recompute"],
        "tp2xdp2": ["--tp", "2"],
        "tp2xdp2+sp+accum2": ["--tp", "2", "--sequence-parallel", "--grad-accum", "2"],
        "tp2xpp2+sp": ["--tp", "2", *PP2, "--sequence-parallel"],
        "tp2xpp2+sp+selective": ["--tp", "2", *PP2, "--sequence-parallel", "--attention",
                                 "recompute"],
        "tp2xpp2+recompute+accum2": ["--tp", "2", *PP2, "--ckpt-activations",
                                     "--grad-accum", "2"],
        "cp4": ["--cp", "4"],
        "cp2xdp2+zero3+accum2+recompute": ["--cp", "2", "--zero", "3", "--grad-accum", "2",
                                           "--ckpt-activations"],
        "cp2xtp2+naive": ["--cp", "2", "--tp", "2", "--cp-split", "naive"],
        "cp2xtp2+sp+naive": ["--cp", "2", "--tp", "2", "--sequence-parallel", "--cp-split",
                             "naive"],
        "cp2xtp2+sp+recompute": ["--cp", "2", "--tp", "2", "--sequence-parallel",
                                 "--ckpt-activations"],
        "cp2xpp2": ["--cp", "2", *PP2],
        "cp2xpp2+gpipe+recompute": ["--cp", "2", *PP2, "--schedule", "gpipe",
                                    "--ckpt-activations"]}
SEED = 11


def flags(name, dropout=0.1):
    return train_parser().parse_args([
        "--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "8",
        "--batch-size", "16", "--steps", "3", "--lr", "1e-2", "--grad-clip", "0.05",
        "--dtype", "float64", "--seed", str(SEED), "--dropout", str(dropout), *RUNS[name]])


def config_of(args):
    return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                     block_size=args.block_size, vocab_size=30, dropout=args.dropout,
                     attention=args.attention, attention_block=args.attention_block)


def reference(name, dropout=0.1):
    """One process, the whole global batch, no --grad-accum, no recompute: (model, losses,
    norms)."""
    args = flags(name, dropout)
    args.grad_accum, args.ckpt_activations = 1, False
    model, _, losses, norms, _ = run_steps(SingleProcess(), args, config_of(args), SEED,
                                           "float64")
    return model, losses, norms


def run(name, refs, comm, tol):
    args = flags(name)
    if args.n_layer not in refs:
        refs[args.n_layer] = reference(name)
        _, plain, _ = reference(name, dropout=0.0)
        assert min(abs(a - b) for a, b in zip(refs[args.n_layer][1], plain)) > 1e-6, \
            "dropout changed no loss"
    ref, r_losses, r_norms = refs[args.n_layer]
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    model, opt, losses, norms, _ = run_steps(strategy, args, config_of(args), SEED, "float64")
    params, want = whole_params(strategy, model, opt), dict(ref.named_parameters())
    d_par = max_abs(v - want[n].data for n, v in params.items())
    d_loss = max_abs([float(a) - float(b) for a, b in zip(losses, r_losses)])
    d_norm = max_abs([float(a) - float(b) for a, b in zip(norms, r_norms)])
    names = comm.gather(sorted(params), root=0)
    row = {"run": name, "loss_diff": d_loss, "norm_diff": d_norm, "param_diff": d_par,
           "compared": len(set().union(*names)) if comm.rank == 0 else len(params),
           "ref_params": len(want), "losses": [float(v) for v in losses]}
    worst = worst_over_ranks(comm, max_abs([d_loss, d_norm, d_par]))
    assert worst < tol, (name, row, worst)                       # (a NaN fails too)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=",".join(RUNS))
    cli, comm = start(p)
    refs = {}
    for name in cli.runs.split(","):
        row = run(name, refs, comm, cli.tol)
        if comm.rank == 0:
            print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
