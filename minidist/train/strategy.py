"""The seam between the training step and a parallel strategy.

The step (minidist/train/step.py) is written once; it calls a Strategy for what a parallel
run does differently. `make_strategy` below composes them in plain sight (TP, then PP, then
DDP/ZeRO). `SingleProcess` is the reference: one process, the whole model, no communication.
Each strategy package has its own (minidist/{ddp,zero,tp,pp,cp}/strategy.py):

    rank, world_size          rank 0 logs, samples and writes files (print0)
    build_model(config, seed, dtype)        the full GPT, or this rank's part of it
    build_optimizer(model, args)            AdamW over the parameters this rank updates
    local_rows(x, y)          this rank's rows of the GLOBAL batch (x, y)
    no_sync()                 context for micro-batches that only accumulate gradients
    backward(loss, scale)     scale x loss (x the loss scale under float16 --amp)
    start_step() / end_step(activation_bytes)   counters for the end-of-run summary
    sync_grads(model)         e.g. DDP's all-reduce / ZeRO's reduce-scatter
    sum_sq_across_ranks       None, or f(local sum of squares) -> global (clip_grad_norm)
    global_mean(value)        a float or 0-d device array averaged over the ranks that hold
                              different rows, returned on the device (no host sync)
    comm_bytes()              bytes this rank sent since the run began
    save(dir, ...) / load(dir, ...)        checkpoints (ZeRO writes per-rank shards)
    finish(args, log)         end of training: a summary line, the --trace file
    notes()                   log lines on precision, checkpointing and the split
    wrap(model)               a data-parallel strategy's hold on a model another strategy
                              built (TensorParallel builds, DDP or ZeRO wraps); here: as is
    takes_part_in_sampling()  ranks that run the end-of-training sample
    reports_memory            True: the step measures activations for finish()'s table
Class tree: every strategy is a SingleProcess (it inherits the one-process defaults above:
build_model, the amp backward, notes); DataParallel (ddp/) and ZeroDataParallel (zero/) hold
the whole model; ModelParallel (below) is the base of TensorParallel (tp/) and ContextParallel
(cp/), which split each replica over their own group and pass the rest to an inner DDP/ZeRO;
PipelineParallel (pp/) runs its stage with DDP across pipelines.
Memory options, for every strategy alike (set by make_strategy from --amp and
--ckpt-activations): `amp` (None, or MixedPrecision: minidist/train/amp.py) and
`ckpt_activations` (GPT.set_checkpointing).
Tests: tests/test_train.py.
"""
import contextlib

from minidist.comm import trace
from minidist.nn import GPT
from minidist.optim import AdamW
from minidist.train import checkpoint
from minidist.launcher import world_size_from_env
from minidist.train.cli import UsageError



def make_strategy(args, world=None):
    """The strategy the flags ask for, composed in the order the model is split (picotron's
    train.py order):

        1. tensor parallelism inside each layer      --tp   minidist/tp/
        2. pipeline stages across the layers         --pp   minidist/pp/ (--tp inside a stage)
        3. data parallelism across the replicas      --dp   DDP minidist/ddp/, or ZeRO-k with
                                                            --zero k minidist/zero/
    Context parallelism (--cp, minidist/cp/) splits each sequence over the cp ranks inside
    step 3: TP inside, DDP/ZeRO over the dp x cp ranks around it. Expert parallelism (--ep,
    minidist/ep/) shards the MoE experts over ep ranks carved out of step 3's: TP inside,
    DDP or ZeRO over the dp x ep ranks for the rest.
    Every size is checked on this rank alone, so a bad flag stops every rank before any
    communication; then the DeviceMesh (dp x tp x pp) builds the process groups out of
    `world` (comm.init's group; None: one process, or a script that has not called init)."""
    size = world_size_from_env()
    _refuse_unbuilt(args)
    if args.comm == "nccl":
        _nccl_device(args)
    if args.ep > 1:            # experts over ep inside 3 (TP inside): ep/strategy.py
        from minidist.ep.strategy import make_expert_parallel
        strategy = make_expert_parallel(args, size, world)
    elif args.cp > 1:          # 1 inside, the ring over cp, 3 over dp x cp: cp/strategy.py
        from minidist.cp.strategy import make_context_parallel
        strategy = make_context_parallel(args, size, world)
    elif args.pp > 1:          # 2 (with 1 inside each stage and DDP across): pp/strategy.py
        from minidist.pp.strategy import make_pipeline_parallel
        strategy = make_pipeline_parallel(args, size, world)
    elif args.tp > 1:          # 1, then 3 around this rank's part: tp/strategy.py
        from minidist.tp.strategy import make_tensor_parallel
        strategy = make_tensor_parallel(args, size, world)
    else:                      # 3 alone: the whole model on every rank
        strategy = make_data_parallel(args, mesh(args, world, dp=_dp_size(args, size)))
    return _memory_options(strategy, args)


def _dp_size(args, size):
    dp = args.dp if args.dp is not None else size
    if dp != size:
        raise UsageError(
            f"--dp {dp} does not match the {size} MPI process(es) of this job: dp x tp x pp "
            f"must equal the number of processes (tp = pp = 1 here). Run `mpirun -n {dp} "
            f"python examples/train_gpt.py`, or leave --dp out (it defaults to the world size).")
    if args.batch_size % (dp * args.grad_accum):
        raise UsageError(
            f"--batch-size {args.batch_size} (global, in sequences) does not split into "
            f"dp {dp} x --grad-accum {args.grad_accum} = {dp * args.grad_accum} equal "
            f"micro-batches; choose a multiple of {dp * args.grad_accum}.")
    return dp


def mesh(args, world, dp, tp=1, pp=1):
    """The process groups over `world`, or None for one process (no MPI at all)."""
    if dp * tp * pp == 1 and not args.zero:     # ZeRO over one rank still has a group
        return None
    from minidist.comm import DeviceMesh, trace
    if args.trace:
        trace.enable()
    return DeviceMesh(dp=dp, tp=tp, pp=pp, algo=args.comm, world=world)


def make_data_parallel(args, mesh):
    """Step 3 over mesh.dp: ZeRO-k (--zero k), DDP (dp > 1), or nothing (one replica). Also the
    part around a tensor-parallel model (minidist/tp/strategy.py)."""
    if args.zero:
        from minidist.zero.strategy import ZeroDataParallel
        return ZeroDataParallel(mesh.dp, args.zero)
    if mesh is None or mesh.dp.size == 1:
        return SingleProcess()
    from minidist.ddp.strategy import DataParallel
    return DataParallel(mesh.dp, mode=args.ddp, bucket_mb=args.bucket_mb)


def _nccl_device(args):
    """--comm nccl moves data GPU to GPU: each rank's GPU must be chosen before any group
    builds its NCCL communicator (the loop's set_device comes later). Without CuPy and a GPU
    it is refused on every rank, before any communication."""
    from minidist import backend
    if args.device == "cpu" or backend.cupy_module() is None:
        raise UsageError("--comm nccl moves data GPU to GPU: it needs CuPy and a GPU per rank "
                         "(pip install -e '.[cuda]'; --device cuda or auto). On CPUs use "
                         "--comm ring, naive or mpi.")
    backend.set_device(args.device)


def _memory_options(strategy, args):
    """--amp and --ckpt-activations: independent of how the work is split, so every strategy
    takes them (mixed precision: minidist/train/amp.py; checkpointing: autograd/recompute.py)."""
    if args.amp and args.dtype != "float32":
        raise UsageError(f"--amp computes in 16 bits with float32 master weights; it does not "
                         f"combine with --dtype {args.dtype} (leave --dtype at float32)")
    if args.amp:
        from minidist.train.amp import MixedPrecision
        strategy.amp = MixedPrecision()
    strategy.ckpt_activations = bool(args.ckpt_activations)
    return strategy


def _refuse_unbuilt(args):
    from minidist.ep.strategy import moe_problems     # --moe-experts with --pp, --cp, ...
    problems = moe_problems(args)
    if problems:
        raise UsageError("mixture of experts: " + "; ".join(problems))
    if args.micro_batches not in (None, 1) and args.pp == 1:
        raise UsageError(
            f"--micro-batches {args.micro_batches} splits the batch for a pipeline (--pp > 1); "
            "with one stage, accumulate gradients with --grad-accum instead.")


class SingleProcess:
    rank, world_size = 0, 1
    reports_memory = False              # measure activations every step for finish()
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

    def backward(self, loss, scale=1.0):
        """Backpropagate `scale` x loss (1 / --grad-accum), times the loss scale under float16
        --amp (bfloat16 needs none)."""
        if self.amp:
            return self.amp.backward(loss, scale)
        (loss * scale if scale != 1.0 else loss).backward()

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

    def no_sync(self):
        """Context for the micro-batches whose gradients only accumulate (no communication)."""
        return contextlib.nullcontext()

    def start_step(self):
        """Before a step's first micro-batch: per-step counters of the end-of-run summary."""

    def end_step(self, activation_bytes):
        """After the optimizer step: the largest activation bytes measured in this step."""

    def sync_grads(self, model):
        pass

    def global_mean(self, value):
        return value

    def any_rank(self, flag):
        """Whether `flag` is true on any rank of the job (preemption: all save together)."""
        return bool(flag)

    def comm_bytes(self):
        return 0

    def save(self, directory, model, optimizer, step, rng_states, extra):
        checkpoint.save_checkpoint(directory, model, optimizer, step, rng_states, extra)

    def load(self, directory, model, optimizer):
        return checkpoint.load_checkpoint(directory, model, optimizer)

    def finish(self, args, log):
        if args.trace:
            log.print0(f"--trace {args.trace}: one process sends nothing, so there is no trace")


class ModelParallel(SingleProcess):
    """A strategy that splits each replica's work over its own `group` (tensor parallelism:
    minidist/tp/, context parallelism: minidist/cp/) and leaves the data-parallel part to
    `inner` (DDP, ZeRO or one replica, from make_data_parallel): the step's calls go through
    to inner, and the bytes this rank sends on `group` are counted for the summary."""

    def __init__(self, mesh, group, inner):
        self.mesh, self.group, self.inner = mesh, group, inner
        self.reports_memory = inner.reports_memory
        self.rank, self.world_size = mesh.world.rank, mesh.world.size
        self.steps, self.sent, self._mark = 0, 0, 0

    def build_optimizer(self, model, args):
        return self.inner.build_optimizer(model, args)

    def local_rows(self, x, y):
        return self.inner.local_rows(x, y)

    def no_sync(self):
        return self.inner.no_sync()

    def start_step(self):
        self._mark = trace.bytes_sent(self.group.name)
        self.inner.start_step()

    def sync_grads(self, model):
        """inner's gradient sync; this group's traffic (forward and backward) is done by now."""
        self.inner.sync_grads(model)
        self.steps += 1
        self.sent += trace.bytes_sent(self.group.name) - self._mark

    def end_step(self, activation_bytes):
        self.inner.end_step(activation_bytes)

    def global_mean(self, value):
        return self.inner.global_mean(value)

    def comm_bytes(self):
        return trace.bytes_sent()

    def takes_part_in_sampling(self):
        return self.inner.takes_part_in_sampling()

    def sent_per_step(self):
        """Bytes this rank sent on `group` per step, on average (summary())."""
        return self.sent / max(self.steps, 1)
