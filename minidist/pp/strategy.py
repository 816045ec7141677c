"""The PipelineParallel strategy: GPT cut into --pp stages (minidist/pp/schedule.py),
optionally tensor-parallel inside each stage (--tp), context-parallel inside each stage (--cp:
each stage's attention a ring over its cp group, the ContextParallel strategy as `inner`) and
data-parallel across replicas (--dp: DDP, or ZeRO-1/2/3 with --zero).

    mpirun -n 2 python examples/train_gpt.py --pp 2 --micro-batches 4
    mpirun -n 4 python examples/train_gpt.py --pp 4 --micro-batches 8 --schedule gpipe
    mpirun -n 8 python examples/train_gpt.py --dp 2 --tp 2 --pp 2 --micro-batches 2
    mpirun -n 4 python examples/train_gpt.py --dp 2 --pp 2 --zero 3
    mpirun -n 4 python examples/train_gpt.py --cp 2 --pp 2 --schedule zb-h1

World = dp x cp x tp x pp in Megatron's rank order (minidist/comm/mesh.py). What it changes
from SingleProcess (minidist/strategy/base.py), the data-parallel part left to `inner` (DDP or
ZeRO-k over the dp group, or one replica; with --cp, ContextParallel around DDP or ZeRO over
dp x cp), as TensorParallel and ContextParallel do:

    build_model         this rank's stage: GPTStage, or TensorParallelGPTStage when tp > 1;
                        then inner.wrap(stage) (--cp: the ring attached, minidist/pp/stage.py
                        says where the sequence is split); under ZeRO-3 (also inside --cp, --ep)
                        built on placeholders, a unit at a time (wrap_unbuilt)
    local_rows          inner's: rows by dp rank (every stage and tp rank of a replica: the
                        same rows)
    forward_backward    the schedule (--schedule 1f1b | gpipe | zb-h1, --pp-virtual v) over
                        --micro-batches M, for each --grad-accum round; the last stage
                        seeds each micro-batch's backward with 1/M, so gradients are of the
                        mean loss over the batch;
                        the loss is broadcast from the last stage. DDP stays silent (no_sync)
                        but in the last micro-batch's backward (ZB-H1: its W), where its
                        buckets start; ZeRO-2/3 reduce-scatter each micro-batch's
                        gradients as backward (ZB-H1: W) completes them
    sync_grads          inner's average over dp (once per step), then the tied embedding: the
                        first and last stages' wte gradients summed over their 2-rank group
                        (inner's local_grads: under ZeRO this rank's shard of wte, a flat
                        unit of its own, cut alike on both stages); with --tp and
                        --sequence-parallel the stage's replicated parameters' partial
                        gradients summed over tp, one all-reduce (as TensorParallel's)
    reduce_sum_sq       local squares (the last stage's wte copy left out: the first stage
                        counts it), TP's reduction over tp, summed over pp, then inner's
    save_plan / load    the whole model gathered to rank 0 in the one-process format (under
                        ZeRO first gathered over dp); every rank loads its own parameters (its
                        shards) from it (minidist/pp/checkpoint.py)
Tests: tests/test_pipeline.py, tests/test_pp_zero.py, tests/test_cp_pp.py.
"""
import argparse
import math

import numpy as np

from minidist.backend import xp_of
from minidist.comm import trace
from minidist.pp.microbatches import MicroBatches
from minidist.pp.schedule import (SCHEDULES, bubble_fraction, chunk_layers, measured_bubble,
                                  schedule_function)
from minidist.pp import checkpoint as pp_checkpoint
from minidist.strategy import memory
from minidist.strategy.base import ModelParallel, all_reduce_number, data_axes
from minidist.tp.state import (partial_params, sum_partial_grads, sum_sq_over_tp,
                               unscaled_sum_sq)


def pp_problems(args, micro_batches):
    """Sentences saying what does not fit with --pp (checked on every rank alone, before any
    communication, by minidist/train/strategy.py check_layout)."""
    problems = schedule_problems(args, args.pp, micro_batches, args.pp_virtual)
    if args.pp > args.n_layer:
        problems.append(f"--pp {args.pp} stages for --n-layer {args.n_layer} blocks: every "
                        f"stage needs at least one block (use --pp <= {args.n_layer})")
    return problems


def schedule_problems(args, pp, m, v):
    """--schedule and --pp-virtual against the sizes (interleaving, ZB-H1's split backward)."""
    schedule, problems = args.schedule, []
    if v < 1:
        problems.append(f"--pp-virtual {v}: must be at least 1")
    elif v > 1 and schedule != "1f1b":
        problems.append(f"--pp-virtual {v} needs --schedule 1f1b (it interleaves 1F1B), not "
                        f"--schedule {schedule}")
    elif v > 1 and m % pp:
        problems.append(f"--pp-virtual {v}: --micro-batches {m} must be a multiple of --pp "
                        f"{pp} (the interleaved order runs micro-batches in groups of pp)")
    if pp * v > args.n_layer >= pp:
        problems.append(f"--pp {pp} x --pp-virtual {v} = {pp * v} chunks for --n-layer "
                        f"{args.n_layer} blocks: every chunk needs a block")
    if schedule == "zb-h1" and args.ckpt_activations:
        problems.append("--schedule zb-h1 with --ckpt-activations is not available (W would "
                        "recompute the blocks a second time); use 1f1b")
    return problems


def micro_batches_text(m):
    """"4 micro-batches", "1 micro-batch"."""
    return f"{m} micro-batch" + ("es" if m != 1 else "")


def default_micro_batches(rows, pp, multiple=1):
    """Without --micro-batches: the most micro-batches up to 2 x pp that divide the rows
    (multiples of pp under interleaving)."""
    return max([m for m in range(multiple, 2 * pp + 1, multiple) if rows % m == 0],
               default=multiple)


def embedding_group(mesh):
    """The first and last stages of this rank's (dp, cp, tp) coordinates, as a 2-rank group
    (None on middle stages). Collective over the world: one group per (dp, cp, tp)."""
    dp, cp, tp, pp = (mesh.shape[k] for k in ("dp", "cp", "tp", "pp"))
    mine = None
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                ranks = [mesh.rank_of(d, t, 0, c), mesh.rank_of(d, t, pp - 1, c)]
                g = mesh.world.new_group(ranks, name=f"embedding{ranks}")
                mine = g if g is not None else mine
    return mine


class PipelineParallel(ModelParallel):
    """This rank's stage over mesh.pp (tensor-parallel inside over mesh.tp); `inner` holds it
    over dp."""

    def __init__(self, mesh, micro_batches, schedule, virtual, sequence_parallel, inner):
        if schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {sorted(SCHEDULES)}, not {schedule!r}")
        super().__init__(mesh, mesh.pp, inner)
        self.micro_batches, self.schedule, self.virtual = micro_batches, schedule, virtual
        self.sequence_parallel = sequence_parallel
        self.embedding = embedding_group(mesh) if mesh.shape["pp"] > 1 else None
        self.stats = {"in_flight": 0, "bytes": 0}      # summary(); bytes sent: ModelParallel
        self.partial = []       # --tp --sequence-parallel: the gradients summed over tp

    @property
    def stage(self):
        """This rank's stage (the model ModelParallel holds)."""
        return self.model

    # ---- the model -------------------------------------------------------------------------
    def build_model(self, config, seed, dtype, weights=None):
        from minidist.pp.stage import GPTStage, TensorParallelGPTStage
        layers = chunk_layers(config.n_layer, self.group.size, self.virtual, self.group.rank)
        whole = not self.inner.builds_by_unit()    # ZeRO-3: on placeholders, a unit at a time
        if self.mesh.shape["tp"] > 1:
            stage = TensorParallelGPTStage(config, self.mesh.tp, self.group, layers, seed,
                                           dtype, self.sequence_parallel, weights, whole)
        else:
            stage = GPTStage(config, self.group, layers, seed, dtype, weights, whole)
        stage.set_checkpointing(self.ckpt_activations)
        self.model = stage
        if not whole:                          # each unit of the stage drawn and sharded
            wrapped = self.inner.wrap_unbuilt(stage, seed, dtype, weights)
        else:                                  # DDP or ZeRO across the pipelines, or as it is
            wrapped = self.inner.wrap(self.amp.cast_model(stage) if self.amp else stage)
        if self.mesh.shape["tp"] > 1:          # left partial in backward: sync_grads sums them
            self.partial = partial_params(stage, self.sequence_parallel)
        return wrapped

    def build_optimizer(self, model, args, tp=None):
        """inner's, told the tp group inside the stage, if any (Muon gathers each split
        matrix's update whole)."""
        return self.inner.build_optimizer(model, args,
                                          self.mesh.tp if self.mesh.shape["tp"] > 1 else None)

    def takes_part_in_sampling(self):
        """Sampling runs through every stage (and tp rank) of the first replica; under
        ZeRO-3 through every replica (each block's gather is a collective over dp)."""
        return self.mesh.dp_rank == 0 or self.inner.takes_part_in_sampling()

    def notes(self, training=True):
        from minidist.nn.config import gpt_param_specs
        s, (cp, t, p) = self.stage, (self.mesh.shape[k] for k in ("cp", "tp", "pp"))
        full = sum(math.prod(shape) for shape, _ in gpt_param_specs(s.config).values())
        return self.inner.notes(training) + [        # inner's: amp, recompute, ZeRO's, cp's, ep's
            f"pipeline parallel: pp {p} x tp {t} x {data_axes(self.mesh, self.expert_ranks())}"
            + (f" x cp {cp} (a ring over cp inside each stage)" if cp > 1 else "")
            + f", {self.schedule}"
            + (f" interleaved over {self.virtual} chunks per rank" if self.virtual > 1 else "")
            + f" over {micro_batches_text(self.micro_batches)}; rank 0 is stage 0 of {p} with "
            "blocks " + ", ".join(f"{c.start}..{c.stop - 1}" for c in s.chunks)
            + (" and the embedding" if s.first else "")
            + f": {s.num_parameters():,} of the model's {full:,} parameters"
            + ("; note: fewer micro-batches than stages, so a stage waits while the others "
               "compute (most of the step a bubble): give --micro-batches M, or a batch per "
               "replica M divides (first-use walk 35: --batch-size 5 fell back to 1)"
               if self.micro_batches < p else "")]

    # ---- one step --------------------------------------------------------------------------
    def forward_backward(self, model, x, y, scale, measure):
        """One --grad-accum micro-step of a pipeline: the schedule (--schedule 1f1b | gpipe)
        runs forward and backward of --micro-batches M slices of (x, y) interleaved across
        the stages. The last stage seeds each micro-batch's backward with scale / M, so the
        gradients are of the mean loss. DDP across pipelines stays silent (inner's no_sync)
        in every backward but micro-batch M-1's, whose hooks start its buckets' all-reduces
        (MicroBatches knows which backward is the last; sync_grads waits for them). Returns
        (the mean loss of these rows, broadcast from the last stage; the most activation
        bytes this stage held at once, if `measure`)."""
        m, schedule = self.micro_batches, schedule_function(self.schedule, self.virtual)
        if len(x) % m:
            raise ValueError(f"{len(x)} rows do not split into {m} micro-batches")
        model.expect(len(x) // m, x.shape[1])
        if self.amp and not model.last:     # backward starts from the last stage's scaled loss
            self.amp.scaled_upstream()
        steps = MicroBatches(model, x, y, m, lambda loss: self.backward(loss, scale / m),
                             self.live_bytes if measure else None,
                             lambda loss: self.scaled_loss(loss, scale / m), self.inner.no_sync)
        schedule(model.link, steps)
        self.stats["in_flight"] = max(self.stats["in_flight"], steps.peak_in_flight)
        return self.loss_of_the_stages(steps), steps.peak_bytes

    def end_step(self, activation_bytes):
        """Counters for summary(): the activation peak of this step."""
        self.stats["bytes"] = max(self.stats["bytes"], activation_bytes)
        self.inner.end_step(activation_bytes)

    def live_bytes(self, live):
        """The memory ledger's activation count over every micro-batch in flight: what
        their graphs keep plus the inputs received, each buffer once, parameters excluded."""
        arrays = []
        for inp, out, w_work in live:           # w_work: what a split backward's W needs
            arrays += [] if out is None else list(memory.graph_arrays(out))
            arrays += [] if inp is None else [inp.data]
            arrays += [] if w_work is None else memory.saved_arrays(w_work.contexts())
        return memory.unique_nbytes(arrays, exclude=[p.data for p in self.stage.parameters()])

    def loss_of_the_stages(self, steps):
        """The mean loss over the micro-batches: the last stage's, broadcast; with MoE blocks
        the router losses of the other stages' blocks added (a sum over the stages)."""
        xp, m = model_xp(self.stage), steps.n_micro
        zero = xp.zeros((), "float64")          # the sums stay on the device: no host read
        total = sum(steps.losses, zero) + sum(steps.router_values, zero)
        buf = xp.array(total / m, dtype="float64").reshape(1)
        if self.stage.config.moe_experts:
            self.group.all_reduce(buf, op="sum")
        else:
            self.group.broadcast(buf, root=self.group.size - 1)
        return buf[0]

    def sync_grads(self, model):
        super().sync_grads(model)           # DDP / ZeRO across pipelines: every bucket, once
        if self.embedding is not None:      # tied wte: first stage's + last stage's gradient
            sync_tied_embedding(self.inner.local_grads(model.tied_copies()), self.embedding)
        if self.partial:                    # sequence parallelism: the sum over tp, coalesced
            sum_partial_grads(self.inner.local_grads(self.partial), self.mesh.tp)

    def reduce_sum_sq(self, local):
        """The global sum of squares: the tied wte counted once (on the first stage), tensor
        parallelism's split/replicated rule inside the stage (minidist/tp/state.py), inner's
        over this stage's ranks (DDP: the replicas hold the same, nothing to add; ZeRO: each
        rank holds its shards, summed over dp; expert parallelism: this stage's experts
        counted once over ep), then the sum over stages. The gradients are inner's
        local_grads: .grad, or under ZeRO the pieces of this rank's shards."""
        if self.stage.last and not self.stage.first:
            tied = unscaled_sum_sq(self.inner.local_grads(self.stage.tied_copies()), self.amp)
            with np.errstate(invalid="ignore"):  # --amp: inf - inf is nan, an overflow (skipped)
                local = local - tied
        if self.mesh.shape["tp"] > 1:
            replicated = [p for p in self.stage.parameters() if p.tp_split is None]
            local = sum_sq_over_tp(self.stage, self.mesh.tp, local,
                                   self.inner.local_grads(replicated), self.amp)
        stage = self.inner.reduce_sum_sq(local)     # linear over stages: before the pp sum
        return all_reduce_number(self.group, stage, "sum", self.stage.parameters()[0].data)

    # ---- checkpoints: the whole model, in the one-process format (minidist/pp/checkpoint.py) --
    def save_plan(self, model, optimizer, step, rng_states, extra):
        return pp_checkpoint.save_plan(self, model, optimizer, step, rng_states, extra)

    def load(self, directory, model, optimizer):
        return pp_checkpoint.load(self, directory, model, optimizer)

    # ---- the end of training ---------------------------------------------------------------
    def summary(self):
        """Lines for people, per stage (collective over pp): micro-batches and activation
        bytes in flight, p2p traffic, and with --trace the bubble measured vs theory."""
        p, m, st = self.group.size, self.micro_batches, self.stats
        mine = (st["in_flight"], st["bytes"], self.sent_per_step(), trace.events())
        rows = self.group.gather_object(mine, root=0)
        if self.group.rank != 0:
            return []
        mib = [f"{r[1] / 2**20:.2f}" for r in rows]
        # interleaved: a stage holds (micro-batch, chunk) forwards, up to v per micro-batch
        name, held = ((f"{self.schedule} interleaved, {self.virtual} chunks per stage",
                       "micro-batch chunks") if self.virtual > 1
                      else (self.schedule, "micro-batches"))
        lines = [f"pipeline ({name}, pp {p}, {micro_batches_text(m)}): {held} in "
                 f"flight per stage {[r[0] for r in rows]}"
                 + (f", activations held {' / '.join(mib)} MiB" if any(r[1] for r in rows)
                    else "") + f"; p2p sent per step per stage "
                 f"{' / '.join(f'{r[2] / 2**20:.2f}' for r in rows)} MiB"]
        if trace.enabled():
            measured, per_stage = measured_bubble([r[3] for r in rows])
            lines.append(f"bubble of the last step: {measured:.2f} idle (per stage "
                         f"{' / '.join(f'{b:.2f}' for b in per_stage)}) vs theory "
                         f"{bubble_fraction(self.schedule, p, m, self.virtual):.2f}")
        return lines

    def finish(self, args, log):
        for line in self.summary():
            log.print0(line)
        if self.inner.reports_memory:             # ZeRO's table: rank 0's group, stage 0
            log.print0("ZeRO's memory table below is pipeline stage 0's: its parameters, "
                       "the ranks of its data-parallel group")
        self.inner.finish(argparse.Namespace(**{**vars(args), "trace": None}), log)
        if args.trace:
            trace.write_chrome_trace(args.trace, self.mesh.world)
            log.print0(f"trace of every collective and micro-batch written to {args.trace} "
                       "(open it in https://ui.perfetto.dev or chrome://tracing)"
                       + trace.kept_note())


def model_xp(model):
    return xp_of(model.parameters()[0].data)


def sync_tied_embedding(grads, group):
    """The tied wte's gradient summed over `group`: the first and the last stage of one
    pipeline, each holding a copy (the embedding's and the head's use). `grads`: the arrays
    the optimizer reads as its gradient (the strategy's local_grads: the whole .grad, or under
    ZeRO this dp rank's pieces of it, cut alike on both stages: minidist/zero/flat.py).
    Collective."""
    for g in grads:
        group.all_reduce(g, op="sum")
