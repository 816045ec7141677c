"""The seam between the training step and a parallel strategy, and what strategies share.

Every strategy package (minidist/{ddp,zero,tp,pp,cp,ep}/strategy.py) builds on this module; it
imports nothing from minidist/train/ (tests/test_layers.py checks the direction). The step
(minidist/train/step.py) calls, for every strategy alike:

    local_rows(x, y, rows)    this rank's rows of the GLOBAL batch (x, y, the rows' numbers)
    start_step()              counters for the end-of-run summary
    no_sync()                 context for micro-batches that only accumulate gradients
    forward_backward(model, x, y, scale, measure)   one micro-batch: (loss, activation bytes)
                              (a pipeline runs its schedule here)
    sync_grads(model)         e.g. DDP's all-reduce / ZeRO's reduce-scatter
    local_grads(params)       the arrays the optimizer reads as these parameters' gradients
    reduce_sum_sq(local)      this rank's sum of squared gradients -> the global one (clip)
    after_step()              after the optimizer step (ZeRO: all-gather the new parameters)
    zero_grad(opt)            ready for the next step (DDP: zero its buckets in place)
    end_step(activation_bytes)
    global_mean(value)        a float or 0-d device array averaged over the replicas, left on
                              the device (no host sync)
and around the steps: build_model(config, seed, dtype), build_optimizer(model, args, tp)
(AdamW, or Muon: `tp` the tensor-parallel group its split matrices are gathered over),
any_rank(flag), comm_bytes(), save_plan / job_group / save (minidist/strategy/saving.py),
load, notes(), finish(args, log),
whole_state / load_whole_state / optimizer_type (a pipeline's checkpoints),
takes_part_in_sampling(), reports_memory, rank, world_size, zero_strategy(), expert_ranks().

`SingleProcess` is the reference (one process, the whole model, no communication) and the
innermost piece of every composition: DataParallel (ddp/) and ZeroDataParallel (zero/) are
SingleProcess plus the data-parallel part. `ModelParallel` is the base of TensorParallel (tp/),
PipelineParallel (pp/), ContextParallel (cp/) and ExpertParallel (ep/): each splits every
replica's work over its own group and passes the rest to `inner`, the data-parallel strategy.
The composition that nests them: minidist/train/strategy.py make_strategy. Memory options, for
every strategy alike, given to the innermost one's constructor and read by the ones around it:
`amp` (None, or MixedPrecision: minidist/train/amp.py) and `ckpt_activations`
(GPT.set_checkpointing).
Tests: tests/test_train.py.
"""
import contextlib

import numpy as np

from minidist import backend
from minidist.backend import xp_of
from minidist.comm import trace
from minidist.nn import GPT
from minidist.optim import AdamW
from minidist.nn.config import packed_widths
from minidist.optim.muon import Muon, whole_shape
from minidist.strategy import checkpoint, memory, saving


def dp_rows(arrays, rank, size):
    """Rows [r*B/N, (r+1)*B/N) of each array of a global batch of B rows (x, y, the rows'
    numbers): data-parallel rank r's share."""
    n = len(arrays[0]) // size
    if n * size != len(arrays[0]):
        raise ValueError(f"a global batch of {len(arrays[0])} rows does not split into {size} "
                         "equal shards (--batch-size, --dp)")
    return tuple(a[rank * n:(rank + 1) * n] for a in arrays)


def all_reduce_number(group, value, op, like):
    """`value` (a float or a 0-d device array) reduced over `group` (op "sum", "avg" or "max"),
    as a 0-d float64 on the device of the array `like`: nothing waits for the GPU here (the
    loop converts the loss when it logs)."""
    buf = xp_of(like).array(value, dtype="float64").reshape(1)
    group.all_reduce(buf, op=op)
    return buf[0]


def any_rank_of(group, flag):
    """Whether the host bool `flag` is true on any rank of `group` (a one-element all-reduce,
    max), for the loop's stop/diverged agreement every step. The buffer is host memory
    (numpy), so nothing waits for the GPU, on an NCCL group too: a group hands a host buffer
    to the MPI library's all-reduce there (minidist/comm/algos.py, algo_for_buffer)."""
    buf = np.array([float(flag)])
    group.all_reduce(buf, op="max")
    return bool(buf[0])


def data_axes(mesh, ep):
    """The log lines' words for the mesh's dp axis, which holds dp x ep ranks (--ep's ranks
    are carved out of dp, minidist/train/strategy.py): `dp D`, or `dp D x ep E`."""
    return f"dp {mesh.shape['dp'] // ep}" + (f" x ep {ep}" if ep > 1 else "")


def make_optimizer(named_params, args, views=None):
    """The optimizer --optimizer names over `named_params`: AdamW, or Muon for the blocks'
    matrices (AdamW for the rest; minidist/optim/muon.py) seeing them by `views`
    (matrix_views; None: each parameter is one whole matrix here)."""
    if args.optimizer == "muon":
        return Muon(named_params, **optimizer_settings(args), **(views or {}))
    return AdamW(named_params, **optimizer_settings(args))


def optimizer_settings(args):
    """The optimizer's hyperparameters from the flags, as keyword arguments: AdamW's (lr,
    betas: --beta1, --beta2; weight decay), and under --optimizer muon Muon's momentum and
    Newton-Schulz steps. The per-parameter optimizers (make_optimizer) and ZeRO's sharded
    ones take the same."""
    out = {"lr": args.lr, "betas": (args.beta1, args.beta2),
           "weight_decay": args.weight_decay}
    if args.optimizer == "muon":
        out.update(momentum=args.muon_momentum, ns_steps=args.muon_ns_steps)
    return out


def tp_splits(model):
    """{name: Split} of a tensor-parallel model's split parameters (minidist/tp/layers.py)."""
    return {n: p.tp_split for n, p in model.named_parameters() if p.tp_split is not None}


def matrix_views(model, tp=None):
    """How Muon sees `model`'s matrices whole, as its keyword arguments: `tp`, the
    tensor-parallel group (None: none), `splits` {name: Split} of the parameters split over
    it (their update is gathered whole first), and `packed` {name: widths} of the weights
    whose last axis packs several matrices (c_attn's q|k|v, SwiGLU's gate|up:
    nn/config.py packed_widths), each orthogonalised on its own."""
    splits = tp_splits(model) if tp is not None else {}
    packed = {}
    for name, p in model.named_parameters():
        widths = packed_widths(model.config, name, whole_shape(p.shape, splits.get(name)))
        if len(widths) > 1:
            packed[name] = widths
    return {"tp": tp, "splits": splits, "packed": packed}


class SingleProcess:
    rank, world_size = 0, 1
    reports_memory = False              # measure activations every step for finish()

    def __init__(self, amp=None, ckpt_activations=False):
        self.amp, self.ckpt_activations = amp, bool(ckpt_activations)
        self.bytes_before = trace.bytes_sent()     # the process's, before this run (a
                                                   # test suite's own collectives: not its)

    def build_model(self, config, seed, dtype, weights=None):
        """The model, its parameters `seed`'s draws or `weights` (read(name) gives a whole
        host array: --init-from), cast for --amp and wrapped by this strategy. Where it
        builds_by_unit (ZeRO-3, also inside --cp, --ep) the model is made on placeholders and
        wrap_unbuilt gives it its numbers a unit at a time (minidist/zero/strategy.py)."""
        by_unit = self.builds_by_unit()
        model = GPT(config, seed=seed, dtype=dtype, weights=weights, materialize=not by_unit)
        model.set_checkpointing(self.ckpt_activations)
        if by_unit:
            return self.wrap_unbuilt(model, seed, dtype, weights)
        return self.wrap(self.amp.cast_model(model) if self.amp else model)

    def build_optimizer(self, model, args, tp=None):
        """AdamW, or --optimizer muon's Muon (`tp`: the tensor-parallel group over which the
        model's split matrices are gathered whole; a TP strategy passes it); under --amp over
        float32 master weights."""
        views = matrix_views(model, tp)

        def make(named_params):
            return make_optimizer(named_params, args, views)
        if self.amp:
            return self.amp.optimizer(model.named_parameters(), make)
        return make(model.named_parameters())

    def wrap(self, model):
        """This strategy's hold on a model (built here, or by a strategy around it: tensor
        parallelism builds, DDP or ZeRO wraps): here, nothing."""
        return model

    def builds_by_unit(self):
        """Does this strategy take this rank's part built on placeholders, and give it its
        numbers a unit at a time (wrap_unbuilt: ZeRO-3, minidist/zero/strategy.py; --cp,
        --ep around it)? Here, no."""
        return False

    # ---- one step (minidist/train/step.py) ---------------------------------------------------
    def local_rows(self, *arrays):
        return arrays

    def start_step(self):
        """Before a step's first micro-batch: per-step counters of the end-of-run summary."""

    def no_sync(self):
        """Context for the micro-batches whose gradients only accumulate (no communication)."""
        return contextlib.nullcontext()

    def forward_backward(self, model, x, y, scale, measure):
        """One micro-batch: forward, then backward of `scale` x loss. Returns (the loss as a
        0-d float64 on the device, the activation bytes its graph held if `measure`)."""
        with trace.compute("forward"):
            _, loss = model(x, y)
        held = memory.activation_bytes(loss, model.parameters()) if measure else 0
        with trace.compute("backward"):
            self.backward(loss, scale)
        return loss.data.astype("float64"), held

    def backward(self, loss, scale=1.0):
        """Backpropagate `scale` x loss, times the loss scale under float16 --amp."""
        if self.amp:
            return self.amp.backward(loss, scale)
        self.scaled_loss(loss, scale).backward()

    def scaled_loss(self, loss, scale=1.0):
        """The tensor `backward(loss, scale)` starts from: `scale` x loss (x the loss scale
        under --amp)."""
        if self.amp:
            return self.amp.scale_loss(loss, scale)
        return loss * scale if scale != 1.0 else loss

    def sync_grads(self, model):
        pass

    def local_grads(self, params):
        """The arrays this rank's optimizer reads as `params`' gradients once sync_grads has
        run: here each .grad (zeros for one backward left without); ZeRO: the pieces of its
        gradient shards. For other strategies' sums over their own groups (a pipeline's tied
        wte, tensor parallelism's replicated parameters)."""
        for p in params:
            if p.grad is None:
                p.grad = xp_of(p.data).zeros(p.shape, p.grad_dtype)
        return [p.grad for p in params]

    def reduce_sum_sq(self, local):
        """The global sum of squared gradients from this rank's: here, this rank's."""
        return local

    def after_step(self):
        """After the optimizer step."""

    def zero_grad(self, opt):
        opt.zero_grad()

    def end_step(self, activation_bytes):
        """After the step: the largest activation bytes measured in it."""

    def global_mean(self, value):
        return value

    # ---- around the steps ------------------------------------------------------------------
    def any_rank(self, flag):
        """Whether `flag` is true on any rank of the job (preemption: all save together)."""
        return bool(flag)

    def comm_bytes(self):
        """Bytes this rank sent since the run began."""
        return trace.bytes_sent() - self.bytes_before

    def notes(self, training=True):
        """Lines for the log: how this run computes (precision, activation checkpointing).
        `training` False (--eval-only): the EP and CP lines leave out the gradients'
        averaging, --amp's its masters and loss scale (the other lines describe the layout,
        and stay)."""
        lines = [self.amp.describe(training)] if self.amp else []
        if self.ckpt_activations:
            lines.append("activation checkpointing: each block keeps its input and is "
                         "recomputed in backward (same numbers, ~1/3 more compute)")
        return lines

    def takes_part_in_sampling(self):
        """Whether this rank runs the end-of-training sample (rank 0 prints it)."""
        return self.rank == 0

    # ---- checkpoints: planned here, written and committed by minidist/strategy/saving.py ---
    def save_plan(self, model, optimizer, step, rng_states, extra):
        """What this rank writes of a checkpoint of the state after `step` (a SavePlan of
        host copies): here the whole model and optimizer. Collective in the strategies
        that gather or shard (every rank of job_group calls it)."""
        return checkpoint.save_checkpoint_plan(model, optimizer, step, rng_states, extra)

    def job_group(self):
        """The group of every rank of the job, which commits a save together (as any_rank
        agrees): None here, one process."""
        return None

    def save(self, directory, model, optimizer, step, rng_states, extra):
        """A checkpoint into the next numbered folder of `directory`, complete on return:
        save_plan, written, committed. Returns the folder on rank 0. Collective."""
        plan = self.save_plan(model, optimizer, step, rng_states, extra)
        return saving.save_now(directory, step, plan, self.job_group())

    def load(self, directory, model, optimizer):
        """The checkpoint `directory` into `model` and `optimizer`; returns its meta. Every
        strategy's load takes `optimizer` None: the parameters alone (--eval-only: no
        optimizer is built, and none of its state is read or allocated)."""
        return checkpoint.load_checkpoint(directory, model, optimizer)

    # ---- whole arrays by name, for a strategy around this one (a pipeline's checkpoints) --
    def whole_state(self, model, optimizer):
        """(params, optimizer state_dict): `model`'s parameters as host arrays by name and
        the optimizer's state_dict, as one process holds them; here on every rank (ZeRO:
        gathered to its rank 0, (None, None) elsewhere)."""
        return ({n: backend.to_host(a).copy() for n, a in model.state_dict().items()},
                optimizer.state_dict())

    def load_whole_state(self, model, optimizer, params, opt_sd):
        """The inverse of whole_state: `params` and `opt_sd` (by name) into model and
        optimizer (ZeRO: this rank's shards cut from them); `optimizer` None: the
        parameters alone."""
        model.load_state_dict(params)
        if optimizer is not None:
            optimizer.load_state_dict(opt_sd)

    def optimizer_type(self, optimizer):
        """The optimizer's name in a checkpoint's state.json (ZeRO: one process's name);
        None for no optimizer (a weights-only load: checkpoint.check_fits compares none)."""
        return None if optimizer is None else type(optimizer).__name__

    def zero_strategy(self):
        """The ZeroDataParallel strategy that shards this rank's whole part of the model, for
        a model-parallel strategy around it that saves ZeRO's sharded files of its part
        (TensorParallel): None here, under DDP and around other strategies (expert
        parallelism holds its experts apart); ZeRO: itself; ContextParallel: inner's (the
        parameters are replicated over cp: ZeRO shards them whole over dp x cp)."""
        return None

    def expert_ranks(self):
        """The ranks the MoE experts are split over (--ep): 1 here; ExpertParallel: its
        group's; a model-parallel strategy around it: inner's (`data_axes` names them)."""
        return 1

    def finish(self, args, log):
        if args.trace:
            log.print0(f"--trace {args.trace}: one process sends nothing, so there is no trace")


class ModelParallel(SingleProcess):
    """A strategy that splits each replica's work over its own `group` and leaves the
    data-parallel part to `inner` (DDP, ZeRO or one replica): the step's calls go through to
    inner, amp and activation checkpointing are inner's, and the bytes this rank sends on
    `group` are counted for the summary."""

    def __init__(self, mesh, group, inner):
        super().__init__(inner.amp, inner.ckpt_activations)
        self.mesh, self.group, self.inner = mesh, group, inner
        self.reports_memory = inner.reports_memory
        self.rank, self.world_size = mesh.world.rank, mesh.world.size
        self.steps, self.sent, self._mark = 0, 0, 0
        self.sent_after = 0             # on `group` after the gradient sync (the optimizer's)
        self.model = None               # this rank's part of the model, once built

    def build_optimizer(self, model, args, tp=None):
        return self.inner.build_optimizer(model, args, tp)

    def expert_ranks(self):
        return self.inner.expert_ranks()

    def local_rows(self, *arrays):
        return self.inner.local_rows(*arrays)

    def start_step(self):
        self._mark = trace.bytes_sent(self.group.name)
        self.inner.start_step()

    def no_sync(self):
        return self.inner.no_sync()

    def sync_grads(self, model):
        """inner's gradient sync; this group's traffic (forward and backward) is done by now."""
        self.inner.sync_grads(model)
        self.count_synced()

    def count_synced(self):
        """The step's bytes on `group` until now (forward, backward, the gradient sync) into
        the summary's per-step count; what follows, until end_step, is the optimizer's."""
        self.steps += 1
        synced = trace.bytes_sent(self.group.name)
        self.sent += synced - self._mark
        self._mark = synced             # end_step counts the rest as sent_after

    def reduce_sum_sq(self, local):
        return self.inner.reduce_sum_sq(local)

    def local_grads(self, params):
        return self.inner.local_grads(params)

    def after_step(self):
        self.inner.after_step()

    def zero_grad(self, opt):
        self.inner.zero_grad(opt)

    def end_step(self, activation_bytes):
        self.sent_after += trace.bytes_sent(self.group.name) - self._mark
        self.inner.end_step(activation_bytes)

    def global_mean(self, value):
        return self.inner.global_mean(value)

    def any_rank(self, flag):
        return any_rank_of(self.mesh.world, flag)

    def job_group(self):
        return self.mesh.world

    def takes_part_in_sampling(self):
        return self.inner.takes_part_in_sampling()

    def optimizer_type(self, optimizer):
        return self.inner.optimizer_type(optimizer)

    def sent_per_step(self):
        """Bytes this rank sent on `group` per step, on average (summary())."""
        return self.sent / max(self.steps, 1)
