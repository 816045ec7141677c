"""What a training run says before step 0 (train/loop.py calls describe_run once the model
and the strategy are made): the lines a user reads to see that the run is the one they meant.

    data: <source> (<train / val tokens>, cache <folder>)
    model: <N> parameters (<this rank's share>), <config>, <dtype> on <device>, ...
    memory: <GiB> a rank by the planner (...); <the ranks on this host> <GiB> of <GiB> free
    note: ...                  busy cores for the BLAS threads; a GPU run staged through host
    optimizer: Muon for ...    with --optimizer muon
    <the strategy's lines>     --amp, --ckpt-activations, how the model is split
    --stop-at N: ...           the log counts to the stop, the schedule to --steps

Tests: tests/test_cli_runs.py (its RUNS read the model line), tests/test_muon.py (the optimizer
line), tests/test_comm.py (host_staging_note), tests/test_backend.py (busy_cores_note).
"""
import math

from minidist import backend
from minidist.comm.staging import cuda_aware_mpi, host_staging_note
from minidist.launcher import busy_cores_note
from minidist.nn.config import gpt_param_specs
from minidist.optim.muon import takes_muon
from minidist.train.inputs import recorded_flags
from minidist.train.resume import lr_schedule


def describe_run(args, strategy, log, model, data, fits=None):
    """The start-up lines, from rank 0 (`log.print0`): the data; the model, the whole
    model's parameters and this rank's share when it is split (TP, PP); `fits`, the memory
    line (memory_check.check_memory: the planner's bill, what is free); the notes on where
    the time may go (busy cores, GPU buffers through host memory); Muon's split of the
    parameters; the strategy's own lines (Strategy.notes); what --stop-at does to the log."""
    full = sum(math.prod(shape) for shape, _ in gpt_param_specs(model.config).values())
    here = model.num_parameters()
    share = f" ({here:,} on this rank, {100 * here / full:.0f}%)" if here != full else ""
    log.print0(f"data: {data.source} ({data.describe()})")
    log.print0(f"model: {full:,} parameters{share}, {model.config}, {args.dtype} on "
               f"{backend.device()}, {backend.blas_threads()} BLAS thread(s), "
               f"{strategy.world_size} process(es); unigram entropy of the data "
               f"{data.unigram_entropy:.4f} nats/token")
    if fits:
        log.print0(fits)
    busy = None if args.threads else busy_cores_note(backend.blas_threads())
    if busy and backend.device() == "cpu":     # (the default count; a GPU's step is not BLAS)
        log.print0(f"note: {busy}")
    staged = None if backend.device() != "cuda" or strategy.world_size == 1 else \
        host_staging_note(args.comm, cuda_aware_mpi())
    if staged:
        log.print0(f"note: {staged}")
    if args.optimizer == "muon" and not args.eval_only:    # (nothing steps under it)
        mats = [shape for name, (shape, _) in gpt_param_specs(model.config).items()
                if takes_muon(name, shape)]
        n = sum(math.prod(shape) for shape in mats)
        state = ("ZeRO's flat v spans them too, kept zero" if args.zero else "a matrix keeps "
                 "its momentum only, 4 bytes a parameter less than AdamW's m and v")
        log.print0(f"optimizer: Muon for the blocks' {len(mats)} matrices ({n:,} parameters, "
                   f"{100 * n / full:.0f}%; momentum {args.muon_momentum}, "
                   f"{args.muon_ns_steps} Newton-Schulz steps), AdamW for the other "
                   f"{full - n:,}; {state}")
    if not args.eval_only:
        log.print0(run_line(args))
    for line in strategy.notes(training=not args.eval_only):   # --amp, recompute, the split
        log.print0(line)
    if args.stop_at and args.stop_at < args.steps and not args.eval_only:
        # (the log's step N/total counts to the stop: 60/60 read as a shortened schedule)
        log.print0(f"--stop-at {args.stop_at}: the log counts to step {args.stop_at}; the lr "
                   f"schedule spans --steps {args.steps} (--resume goes on from the stop)")


def run_line(args):
    """The run's hyperparameters in one line, as the schedule resolves them (first-use walk
    41: a sweep's logs named none of them; the step lines show the scheduled rate)."""
    schedule = lr_schedule(vars(args))
    shape = (f"wsd, decay over the last {schedule.decay}" if args.lr_schedule == "wsd"
             else "cosine")
    tokens = args.batch_size * args.block_size
    return (f"run: {args.optimizer}, lr {args.lr:g} -> {schedule.min_lr:g} ({shape}, warmup "
            f"{schedule.warmup} of {args.steps} steps), weight decay {args.weight_decay:g}, "
            f"betas ({args.beta1:g}, {args.beta2:g}), "
            f"grad clip {args.grad_clip:g}; global batch {args.batch_size} x "
            f"{args.block_size} = {tokens:,} tokens/step (grad-accum {args.grad_accum}); "
            f"seed {args.seed}")


def run_record(args, strategy):
    """What ran, for a sweep's logs (first-use walk 41: none said which run it was): every
    flag as a checkpoint records it, the ranks and the BLAS threads (they move float32's last
    digits)."""
    return {"flags": recorded_flags(vars(args)), "ranks": strategy.world_size,
            "blas_threads": backend.blas_threads()}
