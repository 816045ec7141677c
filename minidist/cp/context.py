"""Context parallelism on a GPT: each rank of the cp group runs the model on its own tokens.

`attach_ring(model, group, split)` gives a GPT (or a TensorParallelGPT) a RingContext: from
then on the model's forward takes the WHOLE sequence idx (B, T) and targets, and this rank

    keeps its tokens and their positions (zig-zag: chunks r and 2N-1-r of 2N; naive: r of N)
    -> embed (token + position embedding of those positions)        (B, Tl, C), Tl = T / N
       (a TensorParallelGPT with sequence parallelism keeps its tp rank's run of them:
       (B, Tl/tp, C) between the split layers; minidist/tp/model.py embed)
    -> blocks, whose attention is RingSelfAttention over the cp group (minidist/cp/ring.py),
       or with attention="ulysses" two all-to-alls around the model's own attention on
       this rank's heads of the whole sequence (minidist/cp/ulysses.py); everything else
       in a block acts on each token alone, so it needs no communication
    -> head: logits (B, Tl, V) and the mean loss over this rank's tokens.

The mean of the N ranks' losses is the whole sequence's mean (each holds T/N tokens), and
every parameter is replicated over cp, so averaging gradients over the cp ranks (with the
data-parallel ones: DDP/ZeRO over the mesh's dpcp group) gives one process's gradients.
Sampling (`next_token`, sequences of any length) calls embed and run_blocks directly, not
forward: the context is inactive there and every rank computes the whole thing alone.
Activation recompute (--ckpt-activations) runs a block again inside backward, after forward
has returned: the checkpoint saves the layouts (`snapshot`) and restores them for the rerun.
A pipeline stage (--pp) does not call forward: it runs each micro-batch of its blocks
inside `part(model, T)`, the same setup (minidist/pp/stage.py sequence_part).
Tests: tests/test_context_parallel.py, tests/test_cp_exact.py (tests/scripts/cp_check.py),
tests/test_cp_pp.py.
"""
import contextlib

import numpy as np

from minidist.autograd.flash import DEFAULT_BLOCK
from minidist.cp.ring import RingSelfAttention, check_split, layout, positions
from minidist.cp.ulysses import ulysses_attention
from minidist.nn.gpt import moe_loss


ATTENTIONS = ("ring", "ulysses")


class RingContext:
    """The cp group, the split kind, the tile size, how attention runs (`attention`: "ring",
    or "ulysses": all-to-alls around the model's own attention, `local` its --attention);
    `layouts` (every rank's pieces of the sequence) only while a forward runs, or a block's
    recompute inside backward."""

    def __init__(self, group, split="zigzag", block=DEFAULT_BLOCK, attention="ring",
                 local="auto"):
        if attention not in ATTENTIONS:
            raise ValueError(f"context parallelism: attention {attention!r} is not one of "
                             f"{ATTENTIONS}")
        self.group, self.split, self.block = group, split, block
        self.attention, self.local = attention, local
        self.layouts = None

    @property
    def active(self):
        """True inside forward (and a recompute): the attention layers then use the ring (or
        Ulysses' all-to-alls)."""
        return self.layouts is not None

    def forward(self, model, idx, targets=None):
        """GPT.forward under context parallelism: the whole (B, T) in, this rank's logits
        (B, Tl, V) and the mean loss over its tokens out."""
        with self.part(model, idx.shape[1]) as pos:               # (Tl,) global positions
            idx = idx[:, pos]                                     # (B, Tl)
            targets = None if targets is None else targets[:, pos]
            router_losses = []                                    # MoE blocks': one each
            x = model.embed(idx, pos)                             # (B, Tl, C)
            x = model.run_blocks(x, router_losses)                # (B, Tl, C)
            logits, loss = model.head(x, targets)                 # (B, Tl, V), loss
            if loss is not None and router_losses:                # whole-sequence losses,
                loss = loss + moe_loss(router_losses)             # (minidist/nn/moe_split.py)
            return logits, loss

    @contextlib.contextmanager
    def part(self, model, T):
        """Inside: this rank's part of a length-T sequence. Yields its positions (Tl,) (host
        ints), sets the layouts (the attention layers use the ring) and the dropout keys'
        positions; clears both after. forward above runs the whole model in it; a pipeline
        stage runs one micro-batch of its blocks in it (minidist/pp/stage.py)."""
        n, r = self.group.size, self.group.rank
        problem = check_split(T, n, self.split)
        if problem:
            raise ValueError(f"context parallelism: {problem}")
        pos = positions(T, n, r, self.split)                      # (Tl,) global positions
        self.layouts = [layout(T, n, s, self.split) for s in range(n)]
        try:
            with model.dropout_keys.positions_of(pos, T):         # dropout: global places
                yield pos
        finally:
            self.layouts = None

    def all_positions(self):
        """Every cp rank's global positions of the sequence in hand, (cp, T/cp) host ints in
        rank order (an MoE layer routes over the whole sequence: minidist/nn/moe_split.py)."""
        return np.stack([np.concatenate([np.arange(s, s + n) for s, n in pieces])
                         for pieces in self.layouts])

    def positions(self):
        """This rank's global positions of the sequence in hand (Tl,) host ints, in its local
        order: rotary positions (RoPE, minidist/nn/block.py) turn each token by them."""
        return self.all_positions()[self.group.rank]

    def snapshot(self):
        """This sequence's layouts (None outside a forward): what activation recompute
        (--ckpt-activations, minidist/autograd/recompute.py) saves with each block, so that
        the block's rerun inside backward, after forward has cleared them, attends over the
        ring again and not locally."""
        return self.layouts

    def restore(self, layouts):
        """Set the layouts back to a snapshot() (the recompute, then None again after it)."""
        self.layouts = layouts

    def self_attention(self, qkv, n_head, dropout_p=0.0, rng=None, n_kv_head=None):
        """(B, Tl, (nh + 2 nkv) hs) -> (B, Tl, C): ring attention over the cp group, or
        Ulysses' (heads over the cp group: minidist/cp/ulysses.py); dropout on its weights
        with probability dropout_p, numbers from rng (a DropoutSite). n_kv_head (None: nh):
        grouped-query attention's k and v heads, which travel as they are and are repeated
        to nh only where the attention computes (as the block's repeat_kv would)."""
        if self.attention == "ulysses":
            return ulysses_attention(qkv, n_head, self, dropout_p, rng, n_kv_head)
        return RingSelfAttention.apply(qkv, n_head, self, dropout_p, rng, n_kv_head)


def attach_ring(model, group, split="zigzag", block=DEFAULT_BLOCK, attention="ring"):
    """Give `model`, each of its attention layers and each of its MoE layers (which route
    over the whole sequence: minidist/nn/moe_split.py) one RingContext over `group`;
    attention "ulysses": Ulysses' all-to-alls around the model's own --attention."""
    context = RingContext(group, split, block, attention, model.config.attention)
    for m in model.moe_layers():
        m.context = context
    return model.set_context(context)
