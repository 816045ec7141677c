"""The TensorParallel strategy: a TensorParallelGPT over the mesh's tp group, inside a data-
parallel strategy over its dp group (the `inner` one: DDP, ZeRO-k with --zero, or one process
when dp = 1).

    mpirun -n 2 python examples/train_gpt.py --tp 2
    mpirun -n 4 python examples/train_gpt.py --tp 2 --dp 2 --sequence-parallel
    mpirun -n 4 python examples/train_gpt.py --tp 2 --dp 2 --zero 3

World = dp x tp, Megatron's rank order (tp neighbours share a node: minidist/comm/mesh.py).
All tp ranks of one dp replica read the same rows of the global batch. What it changes from
SingleProcess (minidist/strategy/base.py), delegating the data-parallel part to `inner`:

    build_model         this rank's TensorParallelGPT, then inner.wrap(model) (DDP over dp);
                        under ZeRO-3 built on placeholders, a unit at a time (wrap_unbuilt)
    local_rows, no_sync, global_mean    inner's: rows by dp rank, loss averaged over dp
                        (every tp rank already holds the same loss)
    sync_grads          inner's gradient sync, then under sequence parallelism the
                        replicated parameters' gradients, left partial by backward (each
                        tp rank's positions), summed over tp: one all-reduce of them all,
                        once a step (sum_partial_grads, minidist/tp/state.py; Megatron-LM's
                        finalize_model_grads). Nothing else over tp: f and g did it
    reduce_sum_sq       split parameters' squares summed over tp, replicated ones counted
                        once (every tp rank holds the same copy), then inner's reduction
    save_plan / load    the full model and optimizer state (whole_state: inner's, then
                        gathered over tp) written by rank 0 in the single-process format: a
                        checkpoint from any tp resumes on any other tp, or on one process
                        (also under --ep, with or without ZeRO). Under ZeRO without --ep: one
                        checkpoint folder holding ZeRO's sharded files of each tp rank's
                        part in tp<r>-of-<tp>/, each recording how its parameters were cut
                        (any layout reads them back whole: minidist/strategy/readers.py);
                        under --cp too, ZeRO's group then dp x cp (inner.zero_strategy()
                        finds it)
A data-parallel strategy plugs in as `inner` through `wrap(model)` (DataParallel and
ZeroDataParallel have it).
Tests: tests/test_tensor_parallel.py.
"""
import os
import argparse

from minidist.comm import trace
from minidist.tp.model import TensorParallelGPT, check_tp_sizes
from minidist.tp.state import (TpPiece, gather_optimizer_state, partial_params,
                               sum_partial_grads, sum_sq_over_tp)
from minidist.strategy import checkpoint, checkpoint_dirs, saving
from minidist.strategy.base import ModelParallel, data_axes
from minidist.zero.checkpoint import load_sharded, shard_plan


def tp_problems(args):
    """Sentences saying what does not fit with --tp (checked on every rank alone, before any
    communication, by minidist/train/strategy.py check_layout)."""
    problems = check_tp_sizes(args, args.tp, names=("--n-head", "--n-embd", "--tp"))
    if args.sequence_parallel and args.block_size % args.tp:
        problems.append(f"--sequence-parallel splits --block-size {args.block_size} over tp "
                        f"{args.tp} ranks: it must be a multiple of {args.tp}")
    return problems


class TensorParallel(ModelParallel):
    """This rank's TensorParallelGPT over mesh.tp; `inner` holds it over dp."""

    def __init__(self, mesh, sequence_parallel, inner):
        super().__init__(mesh, mesh.tp, inner)
        self.sequence_parallel = bool(sequence_parallel)
        self._partial = []          # the gradients sync_grads sums over tp (partial_params)

    def build_model(self, config, seed, dtype, weights=None):
        """This rank's TensorParallelGPT, held by inner. Under ZeRO-3 (inner.builds_by_unit)
        made on placeholders, each unit's tp shards drawn and sharded over dp in turn
        (ZeroDataParallel.wrap_unbuilt): no rank holds its whole tp part."""
        by_unit = self.inner.builds_by_unit()
        model = TensorParallelGPT(config, self.group, seed, dtype, self.sequence_parallel,
                                  weights, materialize=not by_unit)
        model.set_checkpointing(self.ckpt_activations)
        self.model = model
        self._replicated = [p for p in model.parameters() if p.tp_split is None]
        if by_unit:
            wrapped = self.inner.wrap_unbuilt(model, seed, dtype, weights)
        else:
            wrapped = self.inner.wrap(self.amp.cast_model(model) if self.amp else model)
        # sequence parallelism: these gradients stay partial in backward, summed in sync_grads
        self._partial = partial_params(model, self.sequence_parallel)
        return wrapped

    def build_optimizer(self, model, args, tp=None):
        """inner's, told the tp group (Muon gathers each split matrix's update whole, for
        its NS on one tp rank)."""
        return self.inner.build_optimizer(model, args, self.group)

    def sync_grads(self, model):
        """inner's gradient sync over dp (DDP's all-reduce, ZeRO's reduce-scatter), then under
        sequence parallelism the replicated parameters' partial gradients summed over tp, in
        the arrays the optimizer reads (inner's local_grads), in one all-reduce: the dp mean
        and the tp sum commute."""
        self.inner.sync_grads(model)
        if self._partial:
            sum_partial_grads(self.inner.local_grads(self._partial), self.group)
        self.count_synced()

    def reduce_sum_sq(self, local):
        """Global sum of squares from this rank's: the split part summed over tp, the
        replicated part (the same on every tp rank) added once (minidist/tp/state.py), then
        inner's reduction."""
        total = sum_sq_over_tp(self.model, self.group, local, self._replicated_grads(),
                               self.amp)
        return self.inner.reduce_sum_sq(total)

    def _replicated_grads(self):
        """The replicated parameters' gradient elements that this rank's optimizer norms:
        inner's local_grads (their .grad arrays, or under ZeRO the pieces of them inside
        this rank's flat gradient shards; the flat layout is the same on every tp rank, so
        those pieces are too)."""
        return self.inner.local_grads(self._replicated)

    # sampling runs the split model: every tp rank of the replicas that sample (dp rank 0;
    # under ZeRO-3 every dp rank, whose blocks are gathered collectively): inner decides

    def notes(self, training=True):
        local, full = self.model.parameter_counts()
        dp, tp = data_axes(self.mesh, self.expert_ranks()), self.mesh.shape["tp"]
        pad = self.model.transformer.wte.weight.tp_split.padding(tp)
        return self.inner.notes(training) + [        # inner's: amp, recompute, ZeRO's, cp's, ep's
            f"tensor parallel: tp {tp} x {dp} ({self.group.algo_text()}), sequence parallel "
            f"{'on' if self.sequence_parallel else 'off'}; this rank holds {local:,} of the "
            f"model's {full:,} parameters" + (f"; vocabulary padded with {pad} zero rows to "
                                              f"a multiple of {tp}" if pad else "")]

    # ---- the full model, gathered; checkpoints ----------------------------------------------
    def full_state_dict(self):
        """The whole model (name -> host array) on the ranks of ZeRO's rank 0 (under ZeRO:
        dp rank 0, and cp rank 0 under --cp; on every rank otherwise): gathered over ZeRO's
        group (dp, or dp x cp) first, then over tp. Collective."""
        zero = self.inner.zero_strategy()
        return self.model.full_state_dict(
            zero.engine.full_state_dict(root=0) if zero is not None else None)

    def save_pretrained(self, model, directory, dtype="float32"):
        """GPT-2's format (minidist/nn/pretrained.py), the whole model, from rank 0."""
        from minidist.nn.pretrained import save_state_pretrained
        state = self.full_state_dict()
        if self.rank == 0:
            save_state_pretrained(model.config, state, directory, dtype=dtype)
        self.mesh.world.barrier()

    def _zero_group(self):
        """The group over which ZeRO shards this rank's whole part: inner's dp group, or under
        --cp the dp x cp group of the ZeRO inside ContextParallel (under hybrid sharding the
        shard group of either); None when ZeRO does not
        hold it (DDP; --ep, whose experts it holds apart). Not None: sharded checkpoints."""
        zero = self.inner.zero_strategy()
        return None if zero is None else zero.shard_group

    def _part(self):
        """Under ZeRO: this tp rank's folder of ZeRO's sharded files in a checkpoint."""
        return f"tp{self.group.rank}-of-{self.group.size}"

    def _tp_record(self):
        """A TP x ZeRO part's "tp" manifest section: this tp rank, the tp size and how each
        split parameter is cut, so that any layout reads the parts back whole."""
        return {"rank": self.group.rank, "size": self.group.size,
                "splits": {n: p.tp_split.to_dict() for n, p in self.model.named_parameters()
                           if p.tp_split is not None}}

    def whole_state(self, model, optimizer):
        """The whole model and optimizer state as one process holds them: inner's whole state
        of this rank's part (ZeRO: gathered over dp; expert parallelism: every expert gathered
        over ep), then the split parameters (and their AdamW moments) gathered over tp; on
        the ranks where inner returns it ((None, None) elsewhere). Collective."""
        params, sd = self.inner.whole_state(self.model, optimizer)
        if params is None:
            return None, None
        return (self.model.full_state_dict(params),                 # collective over tp
                gather_optimizer_state(self.model, self.group, sd))

    def save_plan(self, model, optimizer, step, rng_states, extra):
        """The whole model and optimizer state (whole_state), written by rank 0 as one
        process's (minidist/strategy/checkpoint.py). Under ZeRO (not under --ep): one
        checkpoint holding ZeRO's sharded files of each tp rank's part
        (minidist/zero/checkpoint.py), each rank its shards. Collective."""
        group = self._zero_group()
        if group is not None:
            return shard_plan(model, optimizer, group, step, rng_states, extra,
                              part=self._part(), tp=self._tp_record(),
                              writes=self.inner.zero_strategy().writes_checkpoint())
        params, opt_sd = self.whole_state(model, optimizer)
        if self.rank != 0:
            return saving.SavePlan()
        meta = checkpoint.make_meta(model.config, checkpoint.model_dtype(self.model),
                                    optimizer, step, rng_states, extra)
        meta["optimizer"] = self.inner.optimizer_type(optimizer)        # one process's name
        return checkpoint.plain_plan(params, opt_sd, meta)

    def load(self, directory, model, optimizer):
        """Every rank reads its tp shards of the checkpoint. Under ZeRO without --ep, ZeRO
        cuts its flat shards by name: from a TP x ZeRO checkpoint of the same tp, its tp
        rank's part (only the bytes of its shards are read); from any other (another tp, one
        process, any layout), each array cut to this rank's tp shard as it is read (TpPiece),
        one at a time. Otherwise the shards are handed to inner as whole arrays by name.
        `optimizer` None: the parameters alone (no optimizer array read). Returns the meta."""
        group = self._zero_group()
        engine = None if group is None else self.inner.zero_strategy().engine
        folder = checkpoint_dirs.resolve(directory)
        # every rank agrees on the verdict, not only its tp rank's ZeRO group: a bad part of
        # one tp rank must stop every rank, with its message, before any shard changes
        agree = None if group is None else self.mesh.world
        if group is not None and os.path.isdir(os.path.join(folder, self._part())):
            return load_sharded(os.path.join(folder, self._part()), model, optimizer, group,
                                world=agree, engine=engine)
        if group is not None:
            return load_sharded(folder, model, optimizer, group,
                                keep=TpPiece(self.model, self.group), world=agree,
                                engine=engine)
        # this rank's tp shards cut as each array is read: never every whole array at once;
        # only this rank's parameters (under --ep its own experts, not the other ranks')
        params, opt_sd, meta = checkpoint.load(
            folder, keep=TpPiece(self.model, self.group),
            only={n for n, _ in self.model.named_parameters()},
            keys=checkpoint.optimizer_keys(optimizer))
        checkpoint.check_fits(meta["folder"], meta, model.config,
                              checkpoint.model_dtype(self.model),
                              self.inner.optimizer_type(optimizer))
        with checkpoint.does_not_fit(meta["folder"]):
            self.inner.load_whole_state(self.model, optimizer, params, opt_sd)
        return meta

    def summary(self):
        """One line: bytes this rank sent on the tp group per step (forward + backward)."""
        sent = self.sent_per_step()
        return (f"tensor parallel over {self.group.size} ranks ({self.group.algo_text()}, "
                f"sequence parallel {'on' if self.sequence_parallel else 'off'}): "
                f"{sent / 2**20:.2f} MiB sent per rank per step on the tp group")

    def finish(self, args, log):
        after = self.sent_after / max(self.steps, 1)
        log.print0(self.summary() + (
            f"; and {after / 2**20:.3f} MiB in the optimizer's step (Muon's update "
            "all-gathers and reduce-scatters, the clip's norm)" if args.optimizer == "muon"
            else ""))
        if self.inner.reports_memory:             # ZeRO's table: rank 0's group, tp rank 0
            log.print0("ZeRO's memory table below is tp rank 0's: its part of the parameters, "
                       "the ranks of its data-parallel group")
        self.inner.finish(argparse.Namespace(**{**vars(args), "trace": None}), log)
        if args.trace:                                     # one trace for the whole mesh
            trace.write_chrome_trace(args.trace, self.mesh.world)
            log.print0(f"trace of every collective written to {args.trace} "
                       "(open it in https://ui.perfetto.dev or chrome://tracing)"
                       + trace.kept_note())
