"""The ExpertParallel strategy: the experts of every MoE block sharded over the ep ranks, the
tokens sent to them and back by all-to-all (minidist/ep/exchange.py), inside data parallelism.

    mpirun -n 2 python examples/train_gpt.py --moe-experts 4 --ep 2
    mpirun -n 4 python examples/train_gpt.py --moe-experts 4 --ep 2 --dp 2 [--zero 3]
    mpirun -n 4 python examples/train_gpt.py --moe-experts 4 --ep 2 --tp 2
    mpirun -n 4 python examples/train_gpt.py --moe-experts 4 --ep 2 --pp 2
    mpirun -n 4 python examples/train_gpt.py --moe-experts 4 --ep 2 --cp 2

The mesh: ep is carved out of the data-parallel ranks. World = dp x ep x tp, tp fastest
(DeviceMesh(dp=dp*ep, tp=tp): its dp group is the dense data-parallel group D = dp x ep):

    global rank = tp_rank + tp * (ep_rank + ep * dp_rank)

    dp=2, ep=2:   rank   0  1  2  3      ep groups:  [0,1] [2,3]   (experts split, tokens move)
                  ep     0  1  0  1      edp groups: [0,2] [1,3]   (replicas of one expert half)
                  dp     0  0  1  1      dense group: [0,1,2,3]    (DDP of everything else)

Every rank of D reads its own rows of the global batch (as DDP). The dense parameters are
replicated over D: the `inner` DDP (or ZeRO) averages their gradients over D, skipping the
experts' (`expert_parallel` parameters). Each rank holds E/ep experts; its experts'
gradients already hold the contributions of every ep rank's tokens (the combine's backward
brought them), so the strategy sums them over the dp replicas of those experts (edp) and
divides by |D|: the gradient of the mean loss over D, exactly what one process computes.
Under DDP that sum is a DDP gradient sync of its own over edp (minidist/ddp/sync.py), in
--ddp's mode: overlapped, each bucket of experts' all-reduce starts from backward's hooks.
Also: reduce_sum_sq (grad clipping) counts each expert once (their squares summed over ep),
global_mean is inner's. With --tp, TensorParallel (minidist/tp/strategy.py) is the outer
strategy and this one its inner; the experts are not split by tp (every tp rank of a replica
runs the same experts on the same tokens).
Checkpoints: one process's format, ZeRO's shards and every expert gathered
(minidist/ep/checkpoint.py whole_state; under --tp, TensorParallel gathers its pieces around
it; under --pp, each stage's whole state is this one's, gathered over the stages by
minidist/pp/checkpoint.py), so a run resumes on any --ep, with or without ZeRO, TP and PP,
or on one process.
With --zero k, `inner` is ZeRO-k over the dense group: the experts stay out of its flat
shards (minidist/zero/flat.py skips `expert_parallel` parameters) and are ZeRO-1 over their
replicas, edp (minidist/ep/optim.py: optimizer state 1/dp, gradients reduce-scattered,
parameters all-gathered after the step), clipped by the same global norm, skipped with
ZeRO's step on an overflow under --amp. With --zero-shard K (hybrid sharding) the dense
shards are over each K neighbouring ranks of D (a shard group: with K = ep, one replica's
ep ranks) and averaged across the groups; the experts, already split over ep, stay ZeRO-1
over edp. Under ZeRO-3 the model (or TP's, PP's part) is built on placeholders
(wrap_unbuilt): the dense units drawn a unit at a time by ZeRO-3, this rank's experts a
block at a time here, the other ranks' experts never (tests/test_zero_build.py).
--dropout: masks are keyed by the rows' places in the global batch
(minidist/autograd/dropout_keys.py), so they are one process's, with any --grad-accum.
--ckpt-activations: each block's forward, its all-to-alls included, runs again inside
backward (GPT.run_block carries the router losses out of the checkpoint).
--pp: inside each stage, this stage's experts over its ep group (PipelineParallel's inner);
the clipping norm takes each stage's experts once over ep before the sum over stages.
--cp, --sequence-parallel: each rank holds part of every sequence and sends its own tokens;
the routing is over the whole sequence (minidist/nn/moe_split.py), and the experts' replicas
edp are dp x cp ranks (expert_groups).
--comm nccl: the all-to-alls are NCCL's grouped sends and receives, the routing's host ids
MPI's (minidist/comm/nccl.py; not run: NCCL needs a GPU per rank). Refused: E not a multiple
of ep.
Tests: tests/test_expert_parallel.py, tests/test_ep_exact.py (tests/scripts/ep_check.py).
"""
import contextlib

import numpy as np

from minidist.backend import to_device, xp_of
from minidist.comm import trace
from minidist.ddp.sync import gradient_sync
from minidist.ep import checkpoint as ep_checkpoint
from minidist.ep.exchange import attach_experts
from minidist.ep.optim import (DenseAndExperts, expert_blocks, expert_engine,
                               experts_optimizer)
from minidist.strategy import checkpoint, memory, saving
from minidist.strategy.base import ModelParallel, all_reduce_number, matrix_views
from minidist.tp.state import unscaled_sum_sq
from minidist.zero.checkpoint import load_sharded


def moe_problems(args):
    """Sentences saying what does not combine with --moe-experts, on one process or many.
    (Under --comm nccl the routing's host arrays, minidist/nn/moe_split.py's expert ids, go
    through MPI: minidist/comm/group.py.)"""
    if not args.moe_experts and args.ep > 1:
        weights = getattr(args, "resume", None) or getattr(args, "init_from", None)
        return [f"--ep needs a Mixture of Experts, and the model of {weights} is dense: "
                "leave --ep out" if weights else
                "--ep needs a Mixture of Experts: add --moe-experts E"]
    return []


def ep_problems(args):
    """Sentences saying what does not fit with --ep (checked on every rank alone, before any
    communication, by minidist/train/strategy.py check_layout, which also checks the sizes:
    dp x ep x tp = the processes, the batch over dp x ep x --grad-accum)."""
    problems = []
    if args.moe_experts % args.ep:
        problems.append(f"--moe-experts {args.moe_experts} is not a multiple of --ep {args.ep}")
    return problems


def expert_groups(mesh, ep):
    """(ep group, edp group) out of the mesh's dp group, the dense group D = dp x ep: the ep
    ranks that split the experts, and the replicas of this rank's experts: the dp ranks of
    its ep rank, times the cp ranks under --cp (each runs the experts on its own part of the
    sequences), out of mesh.dpcp (dp x ep x cp). Collective."""
    d, c, cp = mesh.dp_rank, mesh.cp_rank, mesh.shape["cp"]  # d: 0 .. dp ep-1
    return (mesh.dp.split(d // ep, key=d % ep, name="ep"),
            mesh.dpcp.split(d % ep, key=c + cp * (d // ep), name="edp"))


class ExpertParallel(ModelParallel):
    """This rank's experts over the `group` (ep); `inner` (DDP over dp x ep) for the rest;
    the experts' gradients summed over `edp` (their replicas)."""

    def __init__(self, mesh, group, edp, inner):
        super().__init__(mesh, group, inner)
        self.edp, self.experts = edp, []
        self.optimizer = None           # under ZeRO: dense + experts (build_optimizer)
        self.expert_engine = None       # under ZeRO: the experts' ZeRO-1 over edp
        self.expert_sync = None         # under DDP: the experts' DDP over edp (wrap)
        self.edp_sent, self._edp_mark = 0, 0    # bytes on edp in the steps (summary())

    def wrap(self, model):
        """This rank's experts on `model` (the rest dropped, the exchange set), then inner's
        DDP (or ZeRO) over the dense parameters; under ZeRO the experts' own ZeRO-1 over
        their replicas (minidist/ep/optim.py); under DDP the experts' own DDP gradient sync
        over their replicas, in inner's --ddp mode and bucket size (minidist/ddp/sync.py:
        overlapped, its buckets' all-reduces start from backward's hooks), summing over
        edp and dividing by the dense group's size (module docstring)."""
        self.model = model
        self.experts = attach_experts(model, self.group)
        return self._sync_experts(self.inner.wrap(model))

    def builds_by_unit(self):
        """inner's: ZeRO-3 takes the model (or TP's part) built on placeholders."""
        return self.inner.builds_by_unit()

    def wrap_unbuilt(self, model, seed, dtype, weights=None):
        """wrap's, for a model on placeholders (ZeRO-3 inside): this rank's experts kept
        (the others never hold numbers), inner's wrap_unbuilt gives the dense parameters
        theirs a unit at a time (--amp: every parameter a 16-bit placeholder), then this
        rank's experts get theirs, a block at a time, as the model holds them (its
        initial_state: a tp shard under --tp), with --amp's float32 masters, as wrap's
        model built whole and cast had them: their ZeRO-1 over edp keeps them whole."""
        self.model = model
        self.experts = attach_experts(model, self.group)
        model = self.inner.wrap_unbuilt(model, seed, dtype, weights)
        for named in expert_blocks(model).values():
            state = model.initial_state({n for n, _ in named}, seed, dtype, weights)
            if self.amp:
                xp = xp_of(self.experts[0].data)
                for n, a in state.items():
                    self.amp.keep_master(n, to_device(np.asarray(a, np.float32), xp))
            model.load_state_dict(state, strict=False)     # (cast to the 16-bit type)
        return self._sync_experts(model)

    def _sync_experts(self, model):
        """After inner's hold on `model`: under ZeRO the experts' own ZeRO-1 over edp, under
        DDP their gradient sync over edp. Returns `model`."""
        if self._zero():
            self.expert_engine = expert_engine(model, self.edp,
                                               training=self.inner.training)
        elif self.experts and self.edp.size > 1:
            self.expert_sync = gradient_sync(self.experts, self.edp, self.inner.mode,
                                             self.inner.bucket_mb, self.inner.group.size)
        return model

    def build_optimizer(self, model, args, tp=None):
        """inner's optimizer (DDP: over every parameter of this rank, experts included); under
        ZeRO, its sharded one plus one over the experts' shards (minidist/ep/optim.py)."""
        if not self._zero():
            return self.inner.build_optimizer(model, args, tp)
        opt = DenseAndExperts(self.inner.build_optimizer(model, args, tp),
                              experts_optimizer(self.expert_engine, args, self.amp,
                                                matrix_views(model, tp)),
                              self.amp)
        self.optimizer = opt            # finish(): the memory table measures both parts
        if self.amp is not None:        # the other ranks' experts' float32 copies (both
            self.amp.masters.clear()    # optimizers took shards of their own)
        return opt

    def _zero(self):
        return getattr(self.inner, "engine", None) is not None

    @contextlib.contextmanager
    def no_sync(self):
        """inner's; the experts' sync holds back too: under DDP their buckets' hooks start
        nothing; under ZeRO the experts' engine starts each MoE block's reduce-scatter over
        edp only in the step's last micro-batch (ZeRO-1's accumulating,
        minidist/zero/zero.py)."""
        experts = self.expert_engine.accumulating() if self._zero() else \
            self.expert_sync.no_sync() if self.expert_sync else contextlib.nullcontext()
        with self.inner.no_sync(), experts:
            yield

    def start_step(self):
        super().start_step()
        self._edp_mark = trace.bytes_sent(self.edp.name)

    def end_step(self, activation_bytes):
        """+ the bytes the experts' gradients (and under ZeRO their gathered shards) sent on
        edp this step, which neither inner's summary nor the ep group's counts."""
        super().end_step(activation_bytes)
        self.edp_sent += trace.bytes_sent(self.edp.name) - self._edp_mark

    def sync_grads(self, model):
        """inner's DDP over the dense parameters; the experts' gradients summed over edp and
        divided by the dense group's size (module docstring); under ZeRO their edp shards."""
        super().sync_grads(model)
        dense = self.inner.group.size
        if self._zero():               # reduce-scattered over edp (averaged: / dp), / ep
            self.expert_engine.sync_grads()
            for u in self.expert_engine.units:
                u.grad_shard /= self.group.size
            return
        if self.expert_sync is not None:   # summed over edp (overlapped: the all-reduces
            self.expert_sync.sync_grads()  # backward began), / dense
            return
        for p in self.experts:             # one replica (edp of 1): / dense only
            if p.grad is None:                              # no tokens this step: zeros
                p.grad = xp_of(p.data).zeros(p.shape, p.grad_dtype)
            p.grad /= dense

    def local_grads(self, params):
        """The arrays this rank's optimizer reads as `params`' gradients after sync_grads:
        the dense ones inner's (.grad, or ZeRO's pieces of its shards); this rank's experts'
        under DDP their .grad (summed over edp), under ZeRO the pieces of the experts'
        engine's gradient shards over edp (minidist/ep/optim.py), which inner's flat shards
        leave out. Cut alike on every tp rank (the experts are not split by tp), so
        TensorParallel's coalesced sum over tp under --sequence-parallel reaches them too
        (minidist/tp/state.py partial_params)."""
        if not self._zero():
            return self.inner.local_grads(params)
        experts = [p for p in params if p.expert_parallel]
        return (self.inner.local_grads([p for p in params if not p.expert_parallel])
                + (self.expert_engine.grad_pieces(experts) if experts else []))

    def reduce_sum_sq(self, local):
        """The global sum of squares, each expert counted once, unscaled in float32 under
        --amp as the optimizer sums. ZeRO: `local` is its dense shards' and its expert
        shards' (DenseAndExperts adds them: every array local_grads gives is in it, as
        TensorParallel's clip expects); inner sums it over D = ep x edp (each element once).
        Hybrid sharding (--zero-shard): the dense shards repeat in every shard group, so
        inner sums them over its shard group, and the experts' shards (ZeRO-1 over edp) are
        summed over D apart. DDP: `local`
        counts the dense gradients (equal on every rank) and this rank's experts: one sum
        over ep of dense / ep + experts, so that every rank gets the same bits (the
        replicas' clip factors, so their parameters, stay bit-identical: a checkpoint holds
        one copy)."""
        if self._zero():
            if self.inner.replicas is None:   # every rank's shards, each once: one sum over D
                return self.inner.reduce_sum_sq(local)
            experts = unscaled_sum_sq([u.grad_shard for u in self.expert_engine.units],
                                      self.amp)
            with np.errstate(invalid="ignore"):     # --amp: inf - inf is nan, an overflow
                dense = local - experts
            like = self.inner.engine.units[0].param_shard
            return (self.inner.reduce_sum_sq(dense)
                    + all_reduce_number(self.inner.group, experts, "sum", like))
        mine = unscaled_sum_sq([p.grad for p in self.experts], self.amp)
        # a pipeline stage may hold no MoE block (--moe-every): no experts, the same sum
        like, ep = (self.experts or self.model.parameters())[0].data, self.group.size
        with np.errstate(invalid="ignore"):         # --amp: inf - inf is nan, an overflow
            dense = (local - mine) / ep
        total = all_reduce_number(self.group, dense + mine, "sum", like)
        return self.inner.reduce_sum_sq(total)

    def zero_grad(self, opt):
        """inner's (DDP: its buckets zeroed in place; ZeRO: both engines' buffers), and under
        DDP the experts' sync's (its buckets zeroed in place too; naive: .grad dropped)."""
        super().zero_grad(opt)
        if self._zero():               # the experts' .grad: views into their engine's buffers
            return
        if self.expert_sync is not None:
            self.expert_sync.zero_grad()
            return
        for p in self.experts:
            p.grad = None

    def after_step(self):
        """inner's (ZeRO: all-gather, or drop, its parameters); the experts' updated shards
        all-gathered over edp."""
        self.inner.after_step()
        if self._zero():
            self.expert_engine.after_step()

    def save_plan(self, model, optimizer, step, rng_states, extra):
        """One process's checkpoint (minidist/strategy/checkpoint.py), so any --ep, or one
        process, resumes it: whole_state gathers it to world rank 0, whose plan writes it.
        Collective."""
        params, opt_sd = self.whole_state(model, optimizer)
        if self.rank != 0:
            return saving.SavePlan()
        meta = checkpoint.make_meta(model.config, checkpoint.model_dtype(model), optimizer,
                                    step, rng_states, extra)
        meta["optimizer"] = self.optimizer_type(optimizer)         # one process's name
        return checkpoint.plain_plan(params, opt_sd, meta)

    def load(self, directory, model, optimizer):
        """Under ZeRO each engine cuts its own shards by name straight from the checkpoint
        (minidist/zero/checkpoint.py load_sharded: the dense ones over dp x ep, this rank's
        experts' over their replicas edp), one array at a time. Under DDP every rank reads the
        dense parameters and its own experts (`only`: the other ranks' experts are not read)
        and keeps them. `optimizer` None: the parameters alone (no optimizer array read).
        Returns meta."""
        if self._zero():
            dense, experts = (None, None) if optimizer is None else \
                (optimizer.dense, optimizer.experts)
            meta = self.inner.load(directory, model, dense)
            load_sharded(directory, model, experts, self.edp, leading_groups=True,
                         world=self.mesh.world,    # one edp group's failure stops every rank
                         engine=self.expert_engine)
            return meta
        params, opt_sd, meta = checkpoint.load(
            directory, only={n for n, _ in model.named_parameters()},
            keys=checkpoint.optimizer_keys(optimizer))
        checkpoint.check_fits(meta["folder"], meta, model.config,
                              checkpoint.model_dtype(model), self.optimizer_type(optimizer))
        with checkpoint.does_not_fit(meta["folder"]):
            self.load_whole_state(model, optimizer, params, opt_sd)
        return meta

    def whole_state(self, model, optimizer):
        """The whole model and optimizer state, every expert gathered, on dense rank 0
        (minidist/ep/checkpoint.py). Collective."""
        return ep_checkpoint.whole_state(self, model, optimizer)

    def load_whole_state(self, model, optimizer, params, opt_sd):
        ep_checkpoint.load_whole_state(self, model, optimizer, params, opt_sd)

    def optimizer_type(self, optimizer):
        """One process's optimizer name (AdamW, or MasterWeightOptimizer under --amp; None
        for no optimizer, a weights-only load)."""
        return self.inner.optimizer_type(optimizer.dense if self._zero() and
                                         optimizer is not None else optimizer)

    def takes_part_in_sampling(self):
        """Every rank: the MoE layers' all-to-alls need the whole ep group (each rank samples
        the same tokens; rank 0 prints them)."""
        return True

    def expert_ranks(self):
        return self.group.size

    def notes(self, training=True):
        s, ep = self.mesh.shape, self.group.size
        n = len(self.experts)
        return self.inner.notes(training) + [
            f"expert parallel: ep {ep} x dp {s['dp'] // ep} x tp {s['tp']}"
            + "".join(f" x {axis} {s[axis]}" for axis in ("cp", "pp") if s[axis] > 1)
            + "; this rank holds "
            f"{n} expert parameter tensors ({sum(p.size for p in self.experts):,} values)"
            + (f"; dense gradients averaged over the {self.inner.group.size} dp x ep"
               + (" x cp" if s["cp"] > 1 else "") + " ranks" if training else "")]

    def summary(self):
        sent = self.sent_per_step()
        edp = "" if self.edp.size == 1 else (
            f"; {self.edp_sent / max(self.steps, 1) / 2**20:.2f} MiB on the edp group of "
            f"{self.edp.size} (the experts' gradients over their replicas: "
            + ("reduce-scattered in backward, the shards all-gathered after the step)"
               if self._zero() else self.edp_sync_text() + ")"))
        algo = self.group.algo_text("the all-to-alls")     # hier splits all-reduces alone
        return (f"expert parallel over {self.group.size} ranks ({algo}): "
                f"{sent / 2**20:.2f} MiB sent per rank per step on the ep group (all-to-all)"
                + edp)

    def edp_sync_text(self):
        """How DDP's experts' sync ran: words for summary()."""
        sync = self.expert_sync
        if sync is None:                # (a pipeline stage without an MoE block)
            return "none on this rank, which holds no expert"
        if sync.mode == "naive":
            return "all-reduced tensor by tensor after backward"
        n = len(sync.buckets)
        buckets = f"{n} bucket{'s' if n > 1 else ''}"
        return (f"all-reduced in {buckets}, started from backward's hooks"
                if sync.mode == "overlapped" else f"all-reduced in {buckets} after backward")

    def finish(self, args, log):
        log.print0(self.summary())
        if self._zero():                 # its memory table predicts the experts apart
            n = sum(p.data.size for p in self.experts)
            self.inner.finish(args, log, experts=memory.ExpertStates(n, self.edp.size,
                                                                     self.optimizer))
        else:
            self.inner.finish(args, log)
