"""The ContextParallel strategy: every rank of a cp group runs the whole model on its part of
each sequence (ring attention: minidist/cp/ring.py), inside data parallelism over dp x cp.

    mpirun -n 2 python examples/train_gpt.py --cp 2
    mpirun -n 4 python examples/train_gpt.py --cp 2 --dp 2 [--zero 1]
    mpirun -n 4 python examples/train_gpt.py --cp 2 --tp 2 --cp-split naive
    mpirun -n 4 python examples/train_gpt.py --cp 2 --tp 2 --sequence-parallel
    mpirun -n 4 python examples/train_gpt.py --cp 2 --pp 2 [--schedule gpipe|zb-h1]
    mpirun -n 8 python examples/train_gpt.py --cp 2 --tp 2 --dp 2 --zero 3
    mpirun -n 4 python examples/train_gpt.py --cp 4 --cp-attention ulysses

World = dp x cp x tp (minidist/comm/mesh.py: tp fastest, then cp, then dp). All cp (and tp)
ranks of one dp replica read the same rows of the global batch; the model keeps its own
tokens (minidist/cp/context.py). Parameters are replicated over cp, so the gradients are
averaged over the dp x cp ranks: the `inner` data-parallel strategy (DDP, or ZeRO-k with
--zero) runs over the mesh's dpcp group, the simplest correct way. What changes from inner:

    build_model / wrap  the GPT (or the TensorParallelGPT that TensorParallel built) gets a
                        RingContext over mesh.cp, then inner.wrap(model); under ZeRO-3
                        the model on placeholders, inner.wrap_unbuilt (a unit at a time)
    local_rows          rows by dp rank only (inner would split rows over dp x cp)
    global_mean         inner's: the mean over dp x cp of each rank's token-mean loss
With --tp, TensorParallel (minidist/tp/strategy.py) is the outer strategy and this one its
inner; with --zero too, zero_strategy() hands it the ZeRO inside (sharding each tp rank's
part over dp x cp), whose sharded files it saves per tp rank as without --cp. With --pp,
PipelineParallel (minidist/pp/strategy.py) is: it builds the stage, this strategy gives the
stage the ring (wrap), and the stage runs each micro-batch in the ring's part of the sequence
(minidist/pp/stage.py sequence_part: where the split lives there).
--dropout: every mask is one process's (the ring's tiles and the residual stream find their
numbers by global position: minidist/autograd/dropout_keys.py). --ckpt-activations
works as without cp: each block's checkpoint saves the RingContext's layouts and restores
them, so the recompute inside backward runs the ring forward again
(minidist/autograd/recompute.py; bytes: minidist/cp/ring.py ring_bytes).
With --sequence-parallel too, tp splits each cp rank's T/cp tokens again (minidist/cp/README.md).
A Mixture of Experts routes over the whole sequence (minidist/nn/moe_split.py); with --ep,
ExpertParallel is this strategy's inner.
--cp-attention ulysses: the same, but each attention layer trades tokens for heads by
all-to-all over cp and runs the model's own attention on n_head/cp heads of the whole
sequence (minidist/cp/ulysses.py); nothing else changes.
Refused: a block size that does not split over cp (and over cp x tp with --sequence-parallel);
with ulysses, heads (per tp rank) that do not divide over cp.
Tests: tests/test_context_parallel.py, tests/test_cp_exact.py (tests/scripts/cp_check.py),
tests/test_cp_ulysses.py; with --pp
tests/test_cp_pp.py, tests/scripts/cp_pp_check.py.
"""
from minidist.cp.context import attach_ring
from minidist.cp.ring import check_split
from minidist.strategy.base import ModelParallel, data_axes, dp_rows


def cp_problems(args):
    """Sentences saying what does not fit with --cp (checked on every rank alone, before any
    communication, by minidist/train/strategy.py check_layout)."""
    problems = []
    split = check_split(args.block_size, args.cp, args.cp_split)
    if split:
        problems.append(split)
    n = args.cp * args.tp
    if args.sequence_parallel and args.tp > 1 and args.block_size % n:
        problems.append(f"--sequence-parallel splits each cp rank's --block-size "
                        f"{args.block_size} / cp {args.cp} tokens over tp {args.tp} ranks: "
                        f"--block-size must be a multiple of cp x tp = {n}")
    if getattr(args, "cp_attention", "ring") == "ulysses":
        problems += ulysses_problems(args)
    return problems


def ulysses_problems(args):
    """--cp-attention ulysses: each cp rank takes n_head/tp/cp whole heads."""
    heads, per_tp = args.n_head // max(args.tp, 1), f" / --tp {args.tp}" if args.tp > 1 else ""
    if args.n_head % max(args.tp, 1) == 0 and heads % args.cp:
        return [f"--cp-attention ulysses gives each of the --cp {args.cp} ranks whole heads: "
                f"--n-head {args.n_head}{per_tp} = {heads} heads do not divide by --cp "
                f"{args.cp} (use --cp-attention ring, or heads a multiple of cp)"]
    return []


class ContextParallel(ModelParallel):
    """The ring (`attention` "ring") or Ulysses' all-to-alls ("ulysses") over mesh.cp on each
    replica's sequences; `inner` (DDP or ZeRO) averages the gradients over the dp x cp
    ranks."""

    def __init__(self, mesh, split, inner, attention="ring"):
        super().__init__(mesh, mesh.cp, inner)
        self.split, self.attention = split, attention

    def wrap(self, model):
        """The ring (or Ulysses' all-to-alls) over mesh.cp on `model` (the GPT, the
        TensorParallelGPT that TensorParallel built, or the pipeline stage PipelineParallel
        built), then inner's hold on it (DDP over dp x cp)."""
        self.model = model
        block = model.config.attention_block                     # the tile size
        return self.inner.wrap(attach_ring(model, self.group, self.split, block,
                                           self.attention))

    def builds_by_unit(self):
        """inner's: ZeRO-3 takes the model (or TP's, PP's part) built on placeholders."""
        return self.inner.builds_by_unit()

    def wrap_unbuilt(self, model, seed, dtype, weights=None):
        """wrap's, for a model on placeholders: the ring attached (it holds no numbers),
        then inner's wrap_unbuilt (ZeRO-3: each unit's numbers drawn and sharded)."""
        self.model = model
        block = model.config.attention_block
        return self.inner.wrap_unbuilt(attach_ring(model, self.group, self.split, block,
                                                   self.attention), seed, dtype, weights)

    def local_rows(self, *arrays):
        """Rows by dp rank: every cp rank of a replica reads the same rows (inner's group is
        dp x cp, so its own split would be wrong here)."""
        return dp_rows(arrays, self.mesh.dp_rank, self.mesh.shape["dp"])

    def save_plan(self, model, optimizer, step, rng_states, extra):
        return self.inner.save_plan(model, optimizer, step, rng_states, extra)

    def load(self, directory, model, optimizer):
        return self.inner.load(directory, model, optimizer)

    def whole_state(self, model, optimizer):
        """inner's (parameters are replicated over cp: ZeRO's shards are over dp x cp)."""
        return self.inner.whole_state(model, optimizer)

    def load_whole_state(self, model, optimizer, params, opt_sd):
        self.inner.load_whole_state(model, optimizer, params, opt_sd)

    def zero_strategy(self):
        """inner's ZeRO (None under DDP): it shards this rank's whole part over dp x cp, so
        TensorParallel around this one saves and loads its sharded files as without --cp."""
        return self.inner.zero_strategy()

    def notes(self, training=True):
        """The layout, and how attention is computed: the ring's tiles in every forward (the
        model's --attention only where the ring is not active: the end's sample), or
        Ulysses' all-to-alls around the model's --attention on n_head/cp heads."""
        s, ep, config = self.mesh.shape, self.expert_ranks(), self.model.config
        sample = (f" (--attention {config.attention}: the end's sample only)"
                  if config.attention in ("materialized", "recompute") else "")
        how = ("ring attention in tiles of "
               f"{config.attention_block} tokens in training and evaluation" + sample)
        if self.attention == "ulysses":
            H = config.n_head // s["tp"]
            tp = " (this tp rank's)" if s["tp"] > 1 else ""
            how = (f"Ulysses attention: an all-to-all per layer to {H // s['cp']} of the {H} "
                   f"heads{tp} over the whole sequence (--attention {config.attention}), "
                   "another back")
        return self.inner.notes(training) + [
            f"context parallel: cp {s['cp']} x {data_axes(self.mesh, ep)} x tp {s['tp']}, "
            f"--cp-split {self.split}; "
            + (f"gradients averaged over the {self.mesh.dpcp.size} dp x "
               + ("ep x " if ep > 1 else "") + "cp ranks; " if training else "") + how]

    def summary(self):
        sent = self.sent_per_step()
        return (f"context parallel over {self.group.size} ranks ({self.split}, "
                f"{self.attention} attention): "
                f"{sent / 2**20:.2f} MiB sent per rank per step on the cp group")

    def finish(self, args, log):
        log.print0(self.summary())
        self.inner.finish(args, log)
