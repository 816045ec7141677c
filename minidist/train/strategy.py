"""The seam between the training loop and a parallel strategy.

The loop (minidist/train/loop.py) never asks "am I data parallel?": it calls a Strategy for
every step that a parallel run does differently. `SingleProcess` is the reference: one
process, the whole model, no communication. DDP, ZeRO, tensor and pipeline parallelism
subclass it and override what they change:

    rank, world_size          rank 0 logs, samples and writes files (print0)
    build_model(config, seed, dtype)        the full GPT, or this rank's part of it
    build_optimizer(model, args)            AdamW over the parameters this rank updates
    local_rows(x, y)          this rank's rows of the GLOBAL batch (x, y)
    forward_backward(model, x, y, n_accum, measure)
                              loss summed into grads over n_accum micro-batches; returns
                              (mean loss of these rows, activation bytes or 0)
    sync_grads(model)         e.g. DDP's all-reduce / ZeRO's reduce-scatter
    sum_sq_across_ranks       None, or f(local sum of squares) -> global (clip_grad_norm)
    global_mean(value)        a float averaged over the ranks that hold different rows
    comm_bytes()              bytes this rank sent since the run began
    save(dir, ...) / load(dir, ...)        checkpoints (ZeRO writes per-rank shards)
    finish(args, log)         end of training: a summary line, the --trace file
DataParallel (DDP) lives in minidist/train/data_parallel.py.
Tests: tests/test_train.py.
"""
from minidist.nn import GPT
from minidist.optim import AdamW
from minidist.train import checkpoint, memory


class NotAvailableYet(SystemExit):
    """A flag whose feature has not landed: exits with a polite message, no traceback."""


def world_size_from_env():
    """Processes in this job, read from the launcher's environment (1 without a launcher)."""
    import os
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_UNIVERSE_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def make_strategy(args):
    """The strategy the flags ask for: one process, or data parallelism over every rank
    (dp = world size unless --dp says otherwise). Flags whose feature has not landed are
    refused politely; inconsistent sizes are refused on every rank before any communication."""
    world = world_size_from_env()
    _refuse_unbuilt(args)
    dp = args.dp if args.dp is not None else world
    if dp != world:
        raise SystemExit(
            f"--dp {dp} does not match the {world} MPI process(es) of this job: dp x tp x pp "
            f"must equal the number of processes (tp = pp = 1 here). Run `mpirun -n {dp} "
            f"python examples/train_gpt.py`, or leave --dp out (it defaults to the world size).")
    if args.batch_size % (dp * args.grad_accum):
        raise SystemExit(
            f"--batch-size {args.batch_size} (global, in sequences) does not split into "
            f"dp {dp} x --grad-accum {args.grad_accum} = {dp * args.grad_accum} equal "
            f"micro-batches; choose a multiple of {dp * args.grad_accum}.")
    if world == 1:
        return SingleProcess()
    from minidist.comm import DeviceMesh, trace
    from minidist.train.data_parallel import DataParallel
    if args.trace:
        trace.enable()
    mesh = DeviceMesh(dp=dp, tp=1, pp=1, algo=args.comm)   # installs the abort handler
    return DataParallel(mesh.dp, mode=args.ddp, bucket_mb=args.bucket_mb)


def _refuse_unbuilt(args):
    wanted = []
    for flag, value, default in (("--tp", args.tp, 1), ("--pp", args.pp, 1),
                                 ("--zero", args.zero, 0),
                                 ("--micro-batches", args.micro_batches, 1)):
        if value != default:
            wanted.append(f"{flag} {value}")
    for flag, on in (("--amp", args.amp), ("--ckpt-activations", args.ckpt_activations)):
        if on:
            wanted.append(flag)
    if wanted:
        raise NotAvailableYet(
            f"Sorry: {', '.join(wanted)} is not available yet -- this build trains on one "
            "process or with data parallelism (mpirun -n N). ZeRO, tensor/pipeline "
            "parallelism and mixed precision land in their own issues; run without these "
            "flags.")


class SingleProcess:
    rank, world_size = 0, 1
    sum_sq_across_ranks = None

    def build_model(self, config, seed, dtype):
        return GPT(config, seed=seed, dtype=dtype)

    def build_optimizer(self, model, args):
        return AdamW(model.named_parameters(), lr=args.lr, betas=(0.9, 0.95),
                     weight_decay=args.weight_decay)

    def local_rows(self, x, y):
        return x, y

    def forward_backward(self, model, x, y, n_accum=1, measure=False):
        """Gradients of the mean loss over all rows of (x, y), accumulated over `n_accum`
        equal micro-batches (each loss scaled by 1/n_accum, so grads are of the mean)."""
        if len(x) % n_accum:
            raise ValueError(f"batch of {len(x)} rows does not split into {n_accum} "
                             "equal micro-batches (--grad-accum)")
        rows, total, act = len(x) // n_accum, 0.0, 0
        for i in range(n_accum):
            _, loss = model(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows])
            if measure:
                act = max(act, memory.activation_bytes(loss, model.parameters()))
            total += float(loss.item())
            (loss * (1.0 / n_accum) if n_accum > 1 else loss).backward()
        return total / n_accum, act

    def sync_grads(self, model):
        pass

    def global_mean(self, value):
        return value

    def comm_bytes(self):
        return 0

    def save(self, directory, model, optimizer, step, rng_states, extra):
        checkpoint.save_checkpoint(directory, model, optimizer, step, rng_states, extra)

    def load(self, directory, model, optimizer):
        return checkpoint.load_checkpoint(directory, model, optimizer)

    def finish(self, args, log):
        if args.trace:
            log.print0(f"--trace {args.trace}: one process sends nothing, so there is no trace")
