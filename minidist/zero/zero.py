"""ZeRO (Rajbhandari et al., 2020): data parallelism that shards the model state over the dp
group instead of replicating it. Stages 1, 2 and 3 side by side, each a small step from the
one before; what every rank holds, with N ranks:

                parameters              gradients                       optimizer state
    DDP         full                    full, all-reduced               full
    stage 1     full                    full, reduce-scattered          1/N (its shard)
    stage 2     full                    1/N: reduce-scattered unit by   1/N
                                        unit during backward
    stage 3     1/N: gathered per       1/N                             1/N
                block, just in time

Everything works on FlatUnits (minidist/zero/flat.py): the root (wte = the tied head, wpe,
ln_f) and one unit per block, each one flat buffer padded to a multiple of N, rank r owning
flat[lo:hi) = [r*S, (r+1)*S). The engine keeps what it holds for each in a ZeroUnit (the
layout and its shards, buffers, hook count, gather slot). The optimizer (optim.py) runs
AdamW on those shards; zero_engine (engine.py) picks the stage's class.

Stage 1, one step:
    backward        grads accumulate in each unit's full flat gradient buffer (param.grad is a
                    view into it, as in DDP's buckets); in the step's last micro-batch, when
                    a unit's last gradient is complete (grad hook), its reduce_scatter(
                    grad[lo:hi], grad, avg) starts in the background while backward goes on:
                    this rank's shard of the averaged gradient (Megatron-LM's distributed
                    optimizer overlaps it the same way)
    sync_grads      waits for them
    step            AdamW on param[lo:hi] with m, v of S elements, then after_step:
                    all_gather(param, param[lo:hi]): every rank has the new full parameters
Stage 2 (minidist/zero/stage2.py): when a unit's last gradient is complete (grad hook), its
    gradients are copied into a transient flat buffer and dropped, and its reduce-scatter
    starts (async) while backward goes on with earlier blocks; when it is done, grad_shard +=
    buffer[lo:hi] and the buffer goes. At most `max_inflight` + 1 buffers are alive (the
    newest starts before the oldest is waited for). The unit is the bucket.
Stage 3: only param[lo:hi] is kept; each block's parameters are gathered just before it runs
    and again before its backward, into one of two shared buffers (minidist/zero/stage3.py).
Hybrid sharding (`replicas`, --zero-shard): `group` is then a shard group of K ranks, and
the engine also averages each gradient shard over `replicas`, the ranks holding the same
shard in the other groups, as each unit's last reduce-scatter of the step lands (under the
rest of backward, once a third is in flight; `accumulating()` holds back the micro-batches
before the last).
Bytes each rank sends per step (ring, Psi = padded parameter bytes): DDP 2(N-1)/N Psi; stages
1, 2 reduce-scatter + all-gather, the same; stage 3, 3(N-1)/N Psi in the paper (1.5x), here
(N-1)/N (Psi + root + (2L-2)/L blocks): the root and the last two blocks are gathered once.
Why not DDP's Bucket: its buffers have no padding and live for the whole run, which is what
stage 2 must not keep; the unit plays the bucket, its hook counting is the same idea.
Tests: tests/test_zero.py, tests/scripts/zero_check.py (4 ranks == 1 process in float64 for
each stage, memory and communication against theory).
"""
import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

from minidist.backend import to_host, xp_of
from minidist.zero.flat import FlatUnit


@dataclass(eq=False)
class ZeroUnit:
    """What the engine holds for one unit: `flat`, the layout (FlatUnit: names, shapes,
    offsets, padding, this rank's [lo, hi)), and the arrays, each a padded flat buffer or
    this rank's S-element slice [lo, hi) of one:

        param_shard   the parameters' [lo, hi): what AdamW updates in place. Stages 1, 2: a
                      view into `full`; stage 3: the only copy of the parameters kept
        full          stages 1, 2: all the parameters (each parameter's .data is a view)
        grad_shard    the averaged gradient's [lo, hi). Stage 1: a view into grad_full
        grad_full     stage 1: every gradient (each parameter's .grad is one of grad_views)
        ready         parameters whose gradient this backward has completed (stage 1: in
                      the step's last micro-batch)
        slot          stage 3: the GatherBuffer this unit's parameters are gathered into
        master        stage 3 building a model on placeholders under --amp: the float32
                      master shard drawn with the unit, until the optimizer takes it
    """
    flat: FlatUnit
    param_shard: Any
    full: Any = None
    grad_shard: Any = None
    grad_full: Any = None
    grad_views: list = field(default_factory=list)
    ready: int = 0
    slot: Any = None
    master: Any = None

    def __repr__(self):
        """Short, for a debugger (`p u` printed every array the unit holds, hundreds of
        lines: first-use walk of 2026-11-30): the unit, this rank's range, what it holds."""
        held = [name for name in ("param_shard", "full", "grad_shard", "grad_full", "master")
                if getattr(self, name) is not None]
        slot = "" if self.slot is None else f"; its slot holds {self.slot!r}"
        return (f"ZeroUnit({self.flat.name!r}: this rank's [{self.flat.lo}, {self.flat.hi}) "
                f"of {self.flat.padded:,}, {self.ready} of {len(self.flat.params)} gradients "
                f"ready, holding {', '.join(held)}{slot})")


class ZeroStage1:
    """Optimizer state sharded; full parameters and full gradients on every rank."""
    stage = 1

    def __init__(self, model, group, flats, replicas=None, gather_group=None, training=True):
        self.module, self.group, self.replicas = model, group, replicas
        self.training = training     # False (--eval-only): no gradient buffers, no masters
        self.transient_peak = 0      # bytes of short-lived buffers (stage 2 and 3), at most
        self.units = [self._shard_params(f) for f in flats]
        self.blocks = [u for u in self.units if u.flat.module is not None]
        self.root = [u for u in self.units if u.flat.module is None]
        self.gather_group = gather_group     # --overlap-param-gather: after_step's, apart
        self._gathering = {}         # gather_group: id(unit) -> its all-gather in flight
        if gather_group is not None:
            model.set_block_hooks(self)      # the next forward waits for each unit
        # where a script's own loop is in the step (check_step_ready): a backward since
        # the last sync_grads; an optimizer step since the last after_step; an optimizer
        # step since the last zero_grad (stages 2, 3: ZeroStage2._grad_ready)
        self.unsynced, self.stepped, self.grads_used = False, False, False
        self._init_grads()

    # ---- parameters: one full flat buffer per unit; model parameters are views into it -----
    def _shard_params(self, flat):
        full = flat.flatten()
        self.group.broadcast(full, 0)                # every rank starts from rank 0's model
        flat.point_params_at(full)
        return ZeroUnit(flat, param_shard=full[flat.lo:flat.hi], full=full)   # a view

    def check_step_ready(self, who):
        """Called by the optimizer's step (`who`: its class name): a RuntimeError naming the
        engine call a script's own loop missed, where the step would read gradients not
        yet averaged (no sync_grads since a backward) or follow a step whose shards were
        never gathered (no after_step): first-use walk 29 found both training other
        numbers silently (ZeRO-3), or failing a step later with other advice."""
        if self.stepped:
            raise RuntimeError(f"ZeRO-{self.stage}: {who}.step again before engine."
                               "after_step(): the last step's updated shards were never "
                               "gathered into the parameters (call engine.after_step() "
                               "after each optimizer step)")
        if self.unsynced:
            raise RuntimeError(f"ZeRO-{self.stage}: {who}.step before engine.sync_grads(): "
                               "the gradient shards are not averaged over the ranks yet "
                               "(call engine.sync_grads() after the step's last backward)")
        self.stepped = self.grads_used = True

    def after_step(self):
        """The updated shards to every rank: all_gather in place, unit by unit. With a
        gather_group they run there in the background (Megatron-LM's
        --overlap-param-gather) while the step ends and the next one's forward begins; each
        unit's parameters point at NaN placeholders (flat.py) until the block hook that
        needs them waits for its gather, so nothing can read them half-gathered."""
        self.stepped = False
        if self.gather_group is None:
            for u in self.units:
                self.group.all_gather(u.full, u.param_shard)
            return
        for u in self.units:
            u.flat.release_params()
            self._gathering[id(u)] = self.gather_group.all_gather(u.full, u.param_shard,
                                                                  async_op=True)

    def wait_for(self, u):
        """gather_group: u's all-gather done, its parameters views into `full` again."""
        work = self._gathering.pop(id(u), None)
        if work is not None:
            work.wait()
            u.flat.point_params_at(u.full)

    def gathers_in_flight(self):
        """gather_group: the units whose all-gather has not finished yet (what a test sees
        of the overlap when a step returns)."""
        return sum(not work.is_completed() for work in self._gathering.values())

    def wait_params(self):
        """Every unit's parameters whole (gather_group: the gathers still in flight
        waited for). What reads them outside a forward calls this first: checkpoints
        (zero/checkpoint.py), full_state_dict, sync_grads before the optimizer writes."""
        for u in self.units:
            self.wait_for(u)

    # ---- gather_group: the model's block hooks (GPT.set_block_hooks), as stage 3's --------
    def before_root(self):
        """Before embed and head: the root units' gathers waited for."""
        for u in self.root:
            self.wait_for(u)

    def before_block(self, i):
        """Before block i: its unit's gather waited for (the later ones still run)."""
        self.wait_for(self.blocks[i])

    def after_block(self, i, y):
        return y

    def free(self):
        """Between steps: drop gathered copies of parameters (stage 3); here, with
        a gather_group, finish the gathers still in flight."""
        self.wait_params()

    # ---- gradients: full flat buffers, each reduce-scattered when backward completes it ---
    def _init_grads(self):
        for u in self.units if self.training else []:
            u.grad_full = xp_of(u.full).zeros(u.flat.padded, u.flat.grad_dtype)
            u.grad_shard = u.grad_full[u.flat.lo:u.flat.hi]
            u.grad_views = u.flat.views(u.grad_full)
        self._scattering = {}        # id(unit) -> its reduce-scatter this step
        self._next = 0               # how many units, last to first, have started theirs
        self._pending = []           # units whose reduce-scatter is in flight, oldest first
        self._across = []            # hybrid: the all-reduces across the replicas started
        self._deferring = False      # inside accumulating(): not the step's last micro-batch
        self._hooks = [p.register_grad_hook(functools.partial(self._grad_complete, u))
                       for u in self.units for p in u.flat.params]
        self.zero_grad()

    def zero_grad(self):
        self.grads_used = False
        for u in self.units if self.training else []:
            u.grad_full.fill(0)
            for p, view in zip(u.flat.params, u.grad_views):
                p.grad = view

    def _grad_complete(self, u, p):
        """Autograd hook: p's gradient for this backward is complete. In the step's last
        micro-batch, once all of u's are, u's reduce-scatter starts (in the background) while
        backward goes on with the blocks below: the unit is DDP's bucket, and the full
        gradients stay (stage 2 is the one that drops them)."""
        self.unsynced = True
        if self._deferring:
            return
        if u.ready == len(u.flat.params):
            raise RuntimeError(f"ZeRO-1: {u.flat.name}'s gradients changed after they were "
                               "complete (a second backward before sync_grads; run the "
                               "micro-batches before a step's last under the strategy's "
                               "no_sync())")
        u.ready += 1
        self._start_ready()

    def _start_ready(self):
        """Start the reduce-scatter of every complete unit whose predecessors have started,
        in one fixed order, the units last to first (the order backward completes them):
        every rank issues them alike whatever order its hooks fire in, as DDP's buckets."""
        while self._next < len(self.units):
            u = self.units[-1 - self._next]
            if u.ready < len(u.flat.params):
                return
            self._start_reduce_scatter(u)
            self._next += 1

    def _start_reduce_scatter(self, u):
        """Rank r's shard of u's gradient averaged over the group, into grad_full[lo:hi].
        Under hybrid sharding the oldest of more than two in flight is waited for here, so
        its all-reduce across the replicas starts under the rest of backward too."""
        for p, view in zip(u.flat.params, u.grad_views):   # a .grad someone replaced
            if p.grad is not view:
                view[...] = 0 if p.grad is None else p.grad
                p.grad = view
        self._scattering[id(u)] = self.group.reduce_scatter(u.grad_shard, u.grad_full,
                                                            op="avg", async_op=True)
        self._pending.append(u)
        while self.replicas is not None and len(self._pending) > 2:
            self._land(self._pending.pop(0))

    def _land(self, u):
        """Wait for u's reduce-scatter; under hybrid sharding start its all-reduce across."""
        self._scattering[id(u)].wait()
        if self.replicas is not None:
            self._across.append(self._average_over_replicas(u))

    def sync_grads(self):
        """Wait for every unit's reduce-scatter (starting those no hook started: a unit
        holding a parameter this backward did not reach); under hybrid sharding each unit's
        all-reduce across the replicas starts as its reduce-scatter lands."""
        self.wait_params()           # (gather_group: a unit no forward used)
        for u in self.units:         # a unit holding a parameter backward did not reach
            u.ready = len(u.flat.params)
        self._start_ready()
        while self._pending:
            self._land(self._pending.pop(0))
        for work in self._across:
            work.wait()
        self.unsynced = False
        self._scattering, self._across, self._next = {}, [], 0
        for u in self.units:
            u.ready = 0

    def _average_over_replicas(self, u):
        """Hybrid sharding: every shard group holds the same shards of its own ranks' average;
        one all-reduce of u's shard across the groups (in flight with the others) makes it
        the average over every data-parallel rank. The gathers never leave the shard group;
        this is the only traffic between groups: 2(R-1)/R of a shard per rank."""
        return self.replicas.all_reduce(u.grad_shard, op="avg", async_op=True)

    @contextlib.contextmanager
    def accumulating(self):
        """Around a micro-batch before the step's last (the strategy's no_sync): the
        gradients only add up in the full buffers, no hook starts a reduce-scatter. Nests (a
        pipeline's micro-batches inside a --grad-accum round): the outer one still holds."""
        previous, self._deferring = self._deferring, True
        try:
            yield
        finally:
            self._deferring = previous

    def grad_pieces(self, params):
        """The pieces of this rank's gradient shards that belong to `params` (views, in unit
        order; after sync_grads they hold the averaged gradient): what this rank's optimizer
        reads of them. A FlatUnit's pieces() (minidist/zero/flat.py) says where they sit."""
        mine, out = {id(p) for p in params}, []
        for u in self.units:
            f = u.flat
            out += [u.grad_shard[f.offsets[i] + a - f.lo:f.offsets[i] + b - f.lo]
                    for i, a, b in f.pieces() if id(f.params[i]) in mine]
        return out

    def held(self):
        """The arrays this rank holds for parameters and gradients (the memory ledger)."""
        return {"params": [u.full for u in self.units],
                "grads": [u.grad_full for u in self.units]}

    def full_state_dict(self, root=0):
        """name -> host array of every full parameter, on rank `root` ({} elsewhere)."""
        self.wait_params()
        out = {}
        for u in self.units:
            full = self._full_params(u)
            if self.group.rank == root:
                out.update((n, to_host(v).copy())
                           for n, v in zip(u.flat.names, u.flat.views(full)))
        order = [n for n, _ in self.module.named_parameters()]
        return {n: out[n] for n in order if n in out}

    def _full_params(self, u):
        return u.full
