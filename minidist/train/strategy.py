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
Memory options, for every strategy alike (set by make_strategy from --amp and
--ckpt-activations, used by the SingleProcess methods strategies inherit):
    amp                       None, or MixedPrecision (minidist/train/amp.py): build_model
                              casts the model to 16 bits, build_optimizer keeps float32
                              master weights, backward() scales the loss
    ckpt_activations          build_model turns on GPT.set_checkpointing
    backward(loss, n_accum)   what forward_backward calls: (loss / n_accum [x loss scale])
    max_across_ranks          None, or f(0/1 overflow flag) -> max over ranks (amp)
    notes()                   log lines on precision and checkpointing
    wrap(model)               a data-parallel strategy's hold on a model another strategy
                              built (TensorParallel builds, DDP wraps); SingleProcess: as is
    takes_part_in_sampling()  ranks that run the end-of-training sample (model-parallel
                              strategies: all ranks holding a part of one replica)
DataParallel (DDP) lives in minidist/ddp/strategy.py, TensorParallel (--tp) in
minidist/tp/strategy.py, ZeroDataParallel (--zero) in minidist/zero/strategy.py,
PipelineParallel (--pp, with --tp and --dp inside it) in minidist/pp/strategy.py.
Tests: tests/test_train.py.
"""
from minidist.nn import GPT
from minidist.optim import AdamW
from minidist.train import checkpoint, memory


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
    if args.comm == "nccl":
        _nccl_device(args)
    if args.pp > 1:            # pipeline (x tensor x data) parallelism: minidist/pp/strategy.py
        from minidist.pp.strategy import make_pipeline_parallel
        return _memory_options(make_pipeline_parallel(args, world), args)
    if args.tp > 1:            # tensor x (DDP or ZeRO) parallelism: minidist/tp/strategy.py
        from minidist.tp.strategy import make_tensor_parallel
        return _memory_options(make_tensor_parallel(args, world), args)
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
    if args.zero:              # ZeRO-1/2/3 over dp = world: minidist/zero/strategy.py
        from minidist.zero.strategy import make_zero
        return _memory_options(make_zero(args, world), args)
    if world == 1:
        return _memory_options(SingleProcess(), args)
    from minidist.comm import DeviceMesh, trace
    from minidist.ddp.strategy import DataParallel
    if args.trace:
        trace.enable()
    mesh = DeviceMesh(dp=dp, tp=1, pp=1, algo=args.comm)   # installs the abort handler
    return _memory_options(DataParallel(mesh.dp, mode=args.ddp, bucket_mb=args.bucket_mb),
                           args)


def _nccl_device(args):
    """--comm nccl moves data GPU to GPU: each rank's GPU must be chosen before any group
    builds its NCCL communicator (the loop's set_device comes later). Without CuPy and a GPU
    it is refused on every rank, before any communication."""
    from minidist import backend
    if args.device == "cpu" or backend.cupy_module() is None:
        raise SystemExit("--comm nccl moves data GPU to GPU: it needs CuPy and a GPU per rank "
                         "(pip install -e '.[cuda]'; --device cuda or auto). On CPUs use "
                         "--comm ring, naive or mpi.")
    backend.set_device(args.device)


def _memory_options(strategy, args):
    """--amp and --ckpt-activations: independent of how the work is split, so every strategy
    takes them (mixed precision: minidist/train/amp.py; checkpointing: autograd/recompute.py)."""
    if args.amp and args.dtype != "float32":
        raise SystemExit(f"--amp computes in 16 bits with float32 master weights; it does not "
                         f"combine with --dtype {args.dtype} (leave --dtype at float32)")
    if args.amp:
        from minidist.train.amp import MixedPrecision
        strategy.amp = MixedPrecision()
    strategy.ckpt_activations = bool(args.ckpt_activations)
    return strategy


def _refuse_unbuilt(args):
    if args.micro_batches not in (None, 1) and args.pp == 1:
        raise SystemExit(
            f"--micro-batches {args.micro_batches} splits the batch for a pipeline (--pp > 1); "
            "with one stage, accumulate gradients with --grad-accum instead.")


class SingleProcess:
    rank, world_size = 0, 1
    sum_sq_across_ranks = None
    max_across_ranks = None
    amp = None
    ckpt_activations = False

    def build_model(self, config, seed, dtype):
        model = GPT(config, seed=seed, dtype=dtype).set_checkpointing(self.ckpt_activations)
        return self.amp.cast_model(model) if self.amp else model

    def build_optimizer(self, model, args):
        def adamw(named_params):
            return AdamW(named_params, lr=args.lr, betas=(0.9, 0.95),
                         weight_decay=args.weight_decay)
        if self.amp:
            return self.amp.optimizer(model.named_parameters(), adamw, self.max_across_ranks)
        return adamw(model.named_parameters())

    def backward(self, loss, n_accum=1):
        """Backpropagate one micro-batch's loss / n_accum (times the loss scale under --amp)."""
        if self.amp:
            return self.amp.backward(loss, 1.0 / n_accum)
        (loss * (1.0 / n_accum) if n_accum > 1 else loss).backward()

    def notes(self):
        """Lines for the log: how this run computes (precision, activation checkpointing)."""
        lines = [self.amp.describe()] if self.amp else []
        if self.ckpt_activations:
            lines.append("activation checkpointing: each block keeps its input and is "
                         "recomputed in backward (same numbers, ~1/3 more compute)")
        return lines

    def wrap(self, model):
        """What this strategy does to a model someone else built (TensorParallel builds
        the model; a data-parallel strategy wraps it): here, nothing."""
        return model

    def takes_part_in_sampling(self):
        """Whether this rank runs the end-of-training sample (rank 0 prints it)."""
        return self.rank == 0

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
            self.backward(loss, n_accum)
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
