"""A pipeline stage: the part of GPT (or of the tensor-parallel GPT) that one pp rank holds.

    first stage   transformer.wte, .wpe, .drop, blocks h.0 .. h.k-1
    middle stage  blocks h.k .. h.j-1
    last stage    blocks h.j .. h.L-1, transformer.ln_f, and a copy of transformer.wte

Parameter names stay GPT-2's, with the blocks' global numbers (the second stage of a 4-layer
model holds `transformer.h.2...` and `h.3`), so a stage's state dict is a slice of the whole
model's and checkpoints are written in the one-process format. Each stage initialises only
its own parameters from `gpt_init(config, seed, names=...)`: the same numbers as one process.

The tied embedding: the first stage looks tokens up in wte, the last stage multiplies by
wte^T for the logits. Both hold the same initial wte; after each backward the strategy sums
their two gradients over a 2-rank embedding group (Megatron-LM's way), so both copies take
the same optimizer step and stay equal (minidist/pp/strategy.py).

The stage classes are the model classes, built through their own __init__: GPT's __init__
asks the stage (PipelineStage.build_transformer) for the modules, so `embed`, `run_blocks`,
`head` and the layers are GPT's (or TensorParallelGPT's): a stage runs the same code as the
whole model.
`stage_forward` is one micro-batch through this stage; `forward(idx, targets)` (evaluation)
and `generate` run the whole pipeline without gradients, every stage calling them together.

Where the sequence is split under context parallelism (--cp with --pp): in the stage, as
tensor parallelism's sequence split is (TensorParallelGPTStage below: begin, boundary_shape).
Every rank of a stage's cp group gets the whole (B, T) micro-batch from MicroBatches (rows
only are cut there) and runs it inside `sequence_part(T)`, its RingContext's part
(minidist/cp/context.py): this rank's zig-zag positions pos, the ring's layouts and the
dropout keys' positions set. The first stage embeds idx[:, pos] at positions pos, every
stage's attention is the ring over its own cp group (mesh.cp: the same stage, dp and tp),
the boundary activation is this rank's (B, T/cp, C) piece (`expect`), sent to the rank of
the same cp coordinate on the next stage, and the last stage takes the loss over
targets[:, pos]: the mean over this rank's tokens, whose mean over dp x cp (the inner
strategy's) is one process's. Backward needs no context: the ring's Function saved its
layouts, and a recompute (--ckpt-activations) restores them from its checkpoint.
Evaluation runs on the ring too; sampling (any length) runs without it, each cp rank
computing the whole sequence.
Tests: tests/test_pipeline.py, tests/test_cp_pp.py.
"""
import contextlib

import numpy as np

from minidist import backend
from minidist.autograd import Tensor, is_grad_enabled
from minidist.nn.block import Block
from minidist.nn.gpt import GPT, embeddings, moe_loss
from minidist.nn.module import ModuleDict, ModuleList
from minidist.nn.sampling import sample
from minidist.pp.link import StageLink
from minidist.tp.model import TensorParallelGPT


class PipelineStage:
    """What every stage class adds to its model class (mixed in before GPT, whose __init__
    then builds and initialises only this stage's part through the methods below)."""

    def _init_stage(self, pp_group, layers):
        """Before the model class's __init__: which part this rank of `pp_group` holds.
        `layers`: this rank's blocks, a range, or a list of ranges, one per chunk, under
        interleaving (minidist/pp/schedule.py chunk_layers)."""
        self.chunks = [layers] if isinstance(layers, range) else list(layers)
        self.link = StageLink(pp_group, len(self.chunks))
        self.first, self.last = self.link.first, self.link.last
        self.layers = [n for chunk in self.chunks for n in chunk]

    def build_transformer(self, factory):
        """GPT's, for the parts this stage runs: the blocks of every chunk it holds, under
        their global numbers (h.2, h.3 on the second of two stages of a 4-layer GPT), the
        embeddings on the first stage, ln_f and the tied wte's copy on the last (each on
        placeholders as it is made where the stage is not materialized: GPT.made)."""
        config, dtype, made = self.config, factory.dtype, self.made
        parts = {}
        if self.first:
            parts.update({name: made(m) for name, m in embeddings(config, factory).items()})
        parts["h"] = ModuleList([made(Block(config, dtype, n, factory)) for n in self.layers],
                                numbers=self.layers)
        if self.last:
            parts["ln_f"] = made(factory.norm())
            if not self.first:
                parts["wte"] = made(factory.token_embedding())    # the tied head's copy
        return ModuleDict(**parts)

    def tied_copies(self):
        """The first stage's wte and the last stage's copy (the head's): their gradients are
        summed over the embedding group (minidist/pp/strategy.py sync_grads)."""
        return [self.transformer.wte.weight] if self.first or self.last else []

    def begin(self, T):
        """Called once per forward of the whole batch on every stage (TP: sequence parallel?)."""

    def boundary_shape(self, rows, T):
        """The activation that crosses the stage boundary: (rows, T, C), T the tokens this
        rank holds."""
        return (rows, T, self.config.n_embd)

    def expect(self, rows, T, ring=True):
        """Tell the link this step's boundary shape and dtype (no shape messages). Under
        context parallelism with the `ring` on, this rank holds T/cp of the T tokens."""
        self.begin(T)
        if ring and self.context is not None:
            T //= self.context.group.size                  # (rows, T/cp, C) cross
        w = next(p for p in self.parameters() if backend.is_float(p.dtype))
        self.link.expect(self.boundary_shape(rows, T), w.dtype, backend.xp_of(w.data))

    def sequence_part(self, T, ring=True):
        """Context parallelism (a RingContext attached by ContextParallel: minidist/cp/): a
        context inside which this rank holds its part of each length-T sequence and the
        attention layers use the ring; it yields the part's positions (Tl,). Otherwise (and
        with ring=False: sampling, any length, the whole sequence on every rank) it yields
        None."""
        if self.context is None or not ring:
            return contextlib.nullcontext(None)
        return self.context.part(self, T)

    def holds_embedding(self, chunk):
        """Does `chunk` start the model (the first chunk of the first stage)?"""
        return self.first and chunk == 0

    def holds_head(self, chunk):
        """Does `chunk` end the model (the last chunk of the last stage)?"""
        return self.last and chunk == len(self.chunks) - 1

    def stage_forward(self, inp, idx, targets, chunk=0, router_losses=None):
        """One micro-batch through this stage's `chunk`: the input Tensor received (None at
        the model's start, which embeds idx) -> the output activation, or the loss at the
        model's end. The router losses of the chunk's MoE blocks (GPT.run_block): added to
        the loss at the model's end, as GPT.forward adds them; elsewhere appended to the
        list `router_losses` (the stage's backward starts from them too, microbatches.py)."""
        mine = []
        with self.sequence_part(idx.shape[1]) as pos:    # --cp: this rank's tokens, the ring
            if self.holds_embedding(chunk):
                x = self.embed(part_of(idx, pos), pos)                 # (B, Tl, C)
            else:
                x = inp                                                # (B, Tl, C) received
            x = self.run_chunk(x, chunk, mine)                         # (B, Tl, C)
            if not self.holds_head(chunk):
                if router_losses is not None:
                    router_losses.extend(mine)
                return x
            loss = self.head(x, part_of(targets, pos))[1]    # mean over this rank's tokens
        return loss + moe_loss(mine) if mine else loss

    def run_chunk(self, x, chunk, router_losses=None):
        """The blocks of `chunk`: GPT's run_blocks when the stage is one chunk; under
        interleaving, the chunk's blocks as run_blocks runs them (each recomputed in backward
        with --ckpt-activations, the block hooks around it: ZeRO-3's gathers, block i = the
        i-th block this stage holds, as ZeRO numbers its units). router_losses: as
        run_blocks'."""
        if len(self.chunks) == 1:
            return self.run_blocks(x, router_losses)
        recompute = self.checkpointing and is_grad_enabled()
        hooks = self.block_hooks
        for n in self.chunks[chunk]:
            i = self.layers.index(n)
            block = self.transformer.h.numbered(n)
            hooks.before_block(i)                                  # ZeRO-3: gather block i
            x = self.run_block(block, x, recompute, router_losses)     # (B, T, C)
            x = hooks.after_block(i, x)            # ZeRO-3: re-gather block i in backward
        return x

    # ---- the whole pipeline, no gradients: evaluation and sampling ------------------------
    def forward(self, idx, targets=None):
        """(None, mean loss as a 0-d Tensor) on every stage, the batch run through the whole
        pipeline as one micro-batch. Evaluation only: training goes through the schedules."""
        if is_grad_enabled():
            raise RuntimeError("a pipeline stage's forward() is for evaluation (no_grad); "
                               "training runs through minidist/pp/schedule.py")
        router = []                                    # this stage's MoE router losses
        loss = self._pipe_forward(idx, targets, router_losses=router)
        xp = self.link.xp                               # summed on the device: no host read
        mine = sum((r.data.astype("float64") for r in router), xp.zeros((), "float64"))
        mine = mine + (0.0 if loss is None else loss.data.astype("float64"))
        buf = xp.array(mine, dtype="float64").reshape(1)
        if self.config.moe_experts:                    # the loss: summed over the stages
            self.link.group.all_reduce(buf, op="sum")
        else:
            self.link.group.broadcast(buf, root=self.link.n_stages - 1)
        return None, Tensor(buf[0])

    def _pipe_forward(self, idx, targets, last_position=False, router_losses=None):
        idx = np.asarray(backend.to_host(idx))
        ring = not last_position         # --cp: evaluation on the ring, sampling without
        self.expect(len(idx), idx.shape[1], ring)
        with self.sequence_part(idx.shape[1], ring) as pos:
            for chunk in range(len(self.chunks)):      # the ring of chunks, one at a time
                x = self.link.recv_forward_chunk(0, chunk)
                x = self.embed(part_of(idx, pos), pos) if self.holds_embedding(chunk) else x
                x = self.run_chunk(x, chunk, router_losses)
                if not self.holds_head(chunk):
                    self.link.isend_forward(x, 0, chunk)
            self.link.wait_sends()
            if not self.last:
                return None
            if last_position:
                return self.head(x[:, -1:, :])[0]                  # logits (B, 1, V)
            return self.head(x, part_of(targets, pos))[1]

    def sampling_cache(self):
        """None: a pipeline runs the whole context through its stages for each token."""
        return None

    def next_token(self, ctx, temperature, top_k, rng, cache=None):
        """GPT.generate's step over the pipeline: the forward runs through every stage, the
        last stage samples and broadcasts the token to all. Every stage calls generate."""
        logits = self._pipe_forward(ctx, None, last_position=True)
        nxt = np.zeros(len(ctx), dtype=np.int64)
        if self.last:
            nxt[:] = sample(backend.to_host(logits.data)[:, -1, :], temperature, top_k, rng)
        self.link.group.broadcast(nxt, root=self.link.n_stages - 1)
        return nxt


def part_of(a, pos):
    """The columns `pos` of a (B, T) array (this rank's tokens under context parallelism), or
    `a` itself (pos or a None)."""
    return a if pos is None or a is None else a[:, pos]


class GPTStage(PipelineStage, GPT):
    """Blocks `layers` of GPT(config, seed) on this rank of `pp_group` (`materialize`:
    GPT's; False under ZeRO-3, minidist/pp/strategy.py build_model)."""

    def __init__(self, config, pp_group, layers, seed=0, dtype="float32", weights=None,
                 materialize=True):
        self._init_stage(pp_group, layers)
        super().__init__(config, seed, dtype, weights=weights, materialize=materialize)


class TensorParallelGPTStage(PipelineStage, TensorParallelGPT):
    """Blocks `layers` of TensorParallelGPT over `tp_group`, on this rank of `pp_group`: the
    stage of 3-D parallelism (dp x tp x pp)."""

    def __init__(self, config, tp_group, pp_group, layers, seed=0, dtype="float32",
                 sequence_parallel=False, weights=None, materialize=True):
        self._init_stage(pp_group, layers)
        super().__init__(config, tp_group, seed, dtype, sequence_parallel, weights,
                         materialize)

    def begin(self, T):
        self.region.begin(T, shard=is_grad_enabled())   # training forwards: as tp/model.py

    def boundary_shape(self, rows, T):
        """(rows, T/tp, C) under sequence parallelism: each tp rank sends its own shard."""
        t = self.region.size if self.region.sharded else 1
        return (rows, T // t, self.config.n_embd)
