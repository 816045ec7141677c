"""The ContextParallel strategy: every rank of a cp group runs the whole model on its part of
each sequence (ring attention: minidist/cp/ring.py), inside data parallelism over dp x cp.

    mpirun -n 2 python examples/train_gpt.py --cp 2
    mpirun -n 4 python examples/train_gpt.py --cp 2 --dp 2 [--zero 1]
    mpirun -n 4 python examples/train_gpt.py --cp 2 --tp 2 --cp-split naive

World = dp x cp x tp (minidist/comm/mesh.py: tp fastest, then cp, then dp). All cp (and tp)
ranks of one dp replica read the same rows of the global batch; the model keeps its own
tokens (minidist/cp/context.py). Parameters are replicated over cp, so the gradients are
averaged over the dp x cp ranks: the `inner` data-parallel strategy (DDP, or ZeRO-k with
--zero) runs over the mesh's dpcp group, the simplest correct way. What changes from inner:

    build_model / wrap  the GPT (or the TensorParallelGPT that TensorParallel built) gets a
                        RingContext over mesh.cp, then inner.wrap(model)
    local_rows          rows by dp rank only (inner would split rows over dp x cp)
    global_mean         inner's: the mean over dp x cp of each rank's token-mean loss
With --tp, TensorParallel (minidist/tp/strategy.py) is the outer strategy and this one its
inner. Refused: --pp, --dropout > 0 (the ring has no attention dropout and the masks would
differ from one process's), --ckpt-activations (the recompute in backward runs outside the
ring's forward), --sequence-parallel, --zero with --tp, a block size that does not split.
Tests: tests/test_context_parallel.py, tests/scripts/cp_check.py.
"""
from minidist.comm import trace
from minidist.cp.context import attach_ring
from minidist.cp.ring import check_split
from minidist.ddp.strategy import dp_rows
from minidist.train.cli import UsageError
from minidist.train.strategy import ModelParallel


def cp_problems(args, size):
    """Sentences saying what does not fit with --cp (checked on every rank alone)."""
    cp, tp = args.cp, args.tp
    dp = args.dp if args.dp is not None else max(size // (cp * tp), 1)
    problems = []
    if dp * cp * tp != size:
        problems.append(f"--dp {dp} x --cp {cp} x --tp {tp} = {dp * cp * tp} ranks, but this "
                        f"job has {size} MPI process(es) (--dp defaults to processes / (cp tp))")
    if args.pp > 1:
        problems.append("--cp does not combine with --pp (not built); use --cp with --dp/--tp")
    split = check_split(args.block_size, cp, args.cp_split)
    if split:
        problems.append(split)
    if args.dropout:
        problems.append(f"--dropout {args.dropout}: ring attention has no dropout; use 0")
    if args.ckpt_activations:
        problems.append("--ckpt-activations does not combine with --cp (not built)")
    if args.sequence_parallel:
        problems.append("--sequence-parallel does not combine with --cp (not built)")
    if args.zero and tp > 1:
        problems.append("--zero with --cp and --tp is not built; use DDP (--zero 0)")
    if args.batch_size % (dp * args.grad_accum):
        problems.append(f"--batch-size {args.batch_size} does not split into dp {dp} x "
                        f"--grad-accum {args.grad_accum} equal micro-batches")
    return dp, problems


def make_context_parallel(args, size, world):
    """The strategy for --cp N [--dp D] [--tp T] [--zero k] over the `size` processes."""
    dp, problems = cp_problems(args, size)
    if problems:
        raise UsageError("context parallelism: " + "; ".join(problems))
    from minidist.comm import DeviceMesh
    if args.trace:
        trace.enable()
    mesh = DeviceMesh(dp=dp, cp=args.cp, tp=args.tp, algo=args.comm, world=world)
    if args.zero:
        from minidist.zero.strategy import ZeroDataParallel
        inner = ZeroDataParallel(mesh.dpcp, args.zero)
    else:
        from minidist.ddp.strategy import DataParallel
        inner = DataParallel(mesh.dpcp, mode=args.ddp, bucket_mb=args.bucket_mb)
    strategy = ContextParallel(mesh, args.cp_split, inner)
    if args.tp > 1:
        from minidist.tp.strategy import TensorParallel
        return TensorParallel(mesh, False, strategy)
    return strategy


class ContextParallel(ModelParallel):
    """The ring over mesh.cp on each replica's sequences; `inner` (DDP or ZeRO) averages the
    gradients over the dp x cp ranks."""

    def __init__(self, mesh, split, inner):
        super().__init__(mesh, mesh.cp, inner)
        self.split = split

    def build_model(self, config, seed, dtype):
        return self.wrap(super().build_model(config, seed, dtype))

    def wrap(self, model):
        """The ring over mesh.cp on `model`, then inner's hold on it (DDP over dp x cp)."""
        self.inner.amp, self.inner.ckpt_activations = self.amp, self.ckpt_activations
        block = model.config.attention_block                     # the tile size
        return self.inner.wrap(attach_ring(model, self.group, self.split, block))

    def local_rows(self, x, y):
        """Rows by dp rank: every cp rank of a replica reads the same rows (inner's group is
        dp x cp, so its own split would be wrong here)."""
        return dp_rows(x, y, self.mesh.dp_rank, self.mesh.shape["dp"])

    @property
    def sum_sq_across_ranks(self):
        return self.inner.sum_sq_across_ranks

    @property
    def max_across_ranks(self):
        return self.inner.max_across_ranks

    def any_rank(self, flag):
        return self.inner.any_rank(flag)

    def save(self, directory, model, optimizer, step, rng_states, extra):
        return self.inner.save(directory, model, optimizer, step, rng_states, extra)

    def load(self, directory, model, optimizer):
        return self.inner.load(directory, model, optimizer)

    def notes(self):
        s = self.mesh.shape
        return self.inner.notes() + [
            f"context parallel: cp {s['cp']} x dp {s['dp']} x tp {s['tp']}, --cp-split "
            f"{self.split}; gradients averaged over the {self.inner.group.size} dp x cp ranks"]

    def summary(self):
        sent = self.sent_per_step()
        return (f"context parallel over {self.group.size} ranks ({self.split}): "
                f"{sent / 2**20:.2f} MiB sent per rank per step on the cp group")

    def finish(self, args, log):
        log.print0(self.summary())
        self.inner.finish(args, log)
