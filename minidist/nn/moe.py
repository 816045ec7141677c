"""Mixture of Experts: E expert MLPs behind a learned router (Switch Transformer, GShard).

Dimensions as in block.py (B, T, C), plus N = B T tokens, E experts, k experts per token,
M kept (token, expert) assignments.

    x (B, T, C) -> (N, C) -> router: logits = x W_r (N, E), probs = softmax(logits)
    top-k:     each token's k most probable experts (slot 0 the most probable)
    capacity:  each expert takes at most cap = ceil(f k T / E) tokens of each sequence
               (f = moe_capacity_factor; 0: no limit); past it an assignment is dropped, in
               GShard's priority order: every token's slot-0 choice in token order, then slot 1
    experts:   expert e runs its MLP (GPT-2's, block.py's MLP) on its tokens, in token order
    combine:   out_n = sum over token n's kept assignments e of probs[n, e] * expert_e(x_n)
               (a dropped assignment adds 0; the block's residual carries the token on)
    dropout:   (training, config.dropout > 0) the experts' output rows, before the combine,
               with a mask per (token, expert) (`expert_dropout`), not drawn by the expert
               MLPs in the order they run, so any rank may run any expert

Two losses, added to the model's loss by GPT.forward (MoE.router_loss, GPT.run_block):
    aux = E sum_e f_e P_e  (Switch's load balancing; 1 when perfectly balanced), where f_e is
          the fraction of a sequence's k T assignments that chose e (before dropping: a
          constant) and P_e the mean router probability of e over the sequence's tokens
    z   = mean over tokens of logsumexp(logits)^2  (ST-MoE's router z-loss)
Everything is per sequence (capacity, f, P; aux is averaged over sequences), so a batch cut
into rows per rank, by data or expert parallelism, drops exactly the tokens one process drops
and has the same losses: this is what makes the parallel runs exact.

Expert parallelism (minidist/ep/) keeps only this rank's experts (`keep_experts`) and sets
`exchange`, which carries the (M, C) expert inputs to the experts' ranks and the outputs back
(all-to-all); the routing and the combine stay here, the same code in both.
Tests: tests/test_moe.py (float64 gradchecks, routing and dropping, losses).
"""
import math
from dataclasses import replace

import numpy as np

from minidist import backend
from minidist.autograd import Function, Tensor
from minidist.autograd import fused as F
from minidist.autograd.indexing import concat, scatter_add_rows, where
from minidist.nn.layers import Dropout, Linear
from minidist.nn.module import Module, ModuleDict


# ---- routing: which token goes to which expert (host numpy, no gradient) -------------------

class Routing:
    """The kept assignments, sorted by (expert, token, slot): token (M,), expert (M,),
    slot (M,); counts (E,) kept per expert; chosen (B, E) assignments per sequence before
    dropping."""

    def __init__(self, token, expert, slot, counts, chosen):
        self.token, self.expert, self.slot = token, expert, slot
        self.counts, self.chosen = counts, chosen

    @property
    def dropped(self):
        """Assignments dropped for lack of capacity."""
        return int(self.chosen.sum() - self.counts.sum())


def capacity(T, E, k, factor):
    """Tokens of one sequence an expert takes: ceil(factor k T / E), at most T; factor 0: T."""
    return T if factor <= 0 else min(T, math.ceil(factor * k * T / E))


def route(probs, k, cap, T):
    """probs (N, E) host array, N = B T -> Routing (top-k, then capacity `cap` per sequence
    and expert, GShard's priority: slot-major, token-minor)."""
    N, E = probs.shape
    B = N // T
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]             # (N, k)
    choice = top.reshape(B, T, k).transpose(0, 2, 1).reshape(B, k * T)  # (B, kT) priority order
    onehot = choice[..., None] == np.arange(E)                          # (B, kT, E)
    seen = np.take_along_axis(onehot.cumsum(axis=1), choice[..., None], axis=2)[..., 0]
    keep = seen <= cap                                                  # (B, kT): within cap
    b, a = np.nonzero(keep)                                             # sequence, assignment
    slot, t = np.divmod(a, T)
    token, expert = b * T + t, choice[b, a]
    order = np.lexsort((slot, token, expert))                           # by expert, token, slot
    counts = np.bincount(expert, minlength=E)
    return Routing(token[order], expert[order], slot[order], counts, onehot.sum(axis=1))


# ---- the ops --------------------------------------------------------------------------------

class IndexAddRows(Function):
    """out = zeros (n, C); out[idx[i]] += rows[i] (the combine: each token sums its experts'
    weighted outputs). Backward: rows get grad[idx] (each row reads its token's gradient)."""

    @staticmethod
    def forward(ctx, rows, idx, n):                                     # rows (M, C)
        ctx.idx = idx
        out = backend.xp_of(rows).zeros((n,) + rows.shape[1:], dtype=rows.dtype)
        if idx.size:
            scatter_add_rows(out, idx, rows)
        return out                                                      # (n, C)

    @staticmethod
    def backward(ctx, grad):                                            # (n, C)
        return grad[ctx.idx], None, None                                # (M, C)


def load_balancing_loss(probs, chosen, T, k):
    """Switch's auxiliary loss, per sequence, averaged: probs (N, E) Tensor, chosen (B, E)."""
    B, E = chosen.shape
    P = probs.reshape(B, T, E).mean(axis=1)                             # (B, E)
    f = Tensor(backend.to_device(chosen / (k * T), backend.xp_of(probs.data)).astype(
        probs.dtype))                                                   # (B, E) constant
    return (P * f).sum() * (E / B)


def expert_dropout(y, routing, rng, p, shape):
    """Dropout on the experts' outputs y (M, C), rows sorted by expert as `routing`'s. Row b
    of the batch has (E, T, C) numbers (`shape`: this forward's (B, T, C); `rng`: the GPT's
    DropoutSite, whose numbers are keyed by the row's place in the global batch), of which
    assignment (token n = (b, t), expert e) keeps [e, t, :], computed for the assignments
    alone. A mask thus depends on the token's place in the global batch and its expert, not
    on which rank runs the expert or in what order. Survivors are scaled by 1/(1-p), as
    ops.dropout's."""
    B, T, C = shape
    b, t = np.divmod(routing.token, T)                                  # (M,) each
    base = (np.asarray(routing.expert) * T + t) * C                     # [e, t, 0] in the row
    numbers = rng.at(B, b, base, np.arange(C), backend.xp_of(y.data))   # (M, C)
    return where(numbers >= p, y * (1.0 / (1.0 - p)), 0.0)


def router_z_loss(logits):
    """Mean over tokens of logsumexp(logits)^2: logits (N, E) Tensor -> scalar Tensor."""
    m = logits.data.max(axis=-1, keepdims=True)                         # (N, 1) a constant
    lse = (logits - m).exp().sum(axis=-1).log() + m[:, 0]               # (N,)
    return (lse * lse).mean()


# ---- the layer ------------------------------------------------------------------------------

class MoE(Module):
    """E experts (`make_expert(config, dtype)`, block.py's MLP, built without dropout) behind a
    router; the MLP of a MoE block. Parameters: router.weight (C, E), experts.<e>.c_fc /
    c_proj (e global). `dropout`: the experts' (expert_dropout), its rng set by GPT."""
    exchange = None     # expert parallelism's ExpertExchange (minidist/ep/exchange.py), or None

    def __init__(self, config, make_expert, dtype="float32"):
        super().__init__()
        E = config.moe_experts
        self.router = Linear(config.n_embd, E, bias=False, dtype=dtype)
        plain = replace(config, dropout=0.0)       # the experts' dropout is the layer's
        self.experts = ModuleDict(**{str(e): make_expert(plain, dtype) for e in range(E)})
        self.dropout = Dropout(config.dropout)     # expert_dropout's rate and draws
        self.n_experts, self.top_k = E, config.moe_top_k
        self.capacity_factor = config.moe_capacity_factor
        self.aux_coef, self.z_coef = config.moe_aux_loss_coef, config.moe_z_loss_coef
        self.local = list(range(E))     # the experts this rank holds (all, on one process)
        self.aux_loss = self.z_loss = self.routing = None     # from the last forward

    def keep_experts(self, ids):
        """Drop every expert not in `ids` (expert parallelism: this rank's share)."""
        for e in range(self.n_experts):
            if e not in ids:
                delattr(self.experts, str(e))
        self.local = list(ids)
        return [p for e in ids for p in getattr(self.experts, str(e)).parameters()]

    def forward(self, x):                                               # (B, T, C)
        B, T, C = x.shape
        x2 = x.reshape(B * T, C)                                        # (N, C)
        logits = self.router(x2)                                        # (N, E)
        probs = F.softmax(logits, axis=-1)                              # (N, E)
        cap = capacity(T, self.n_experts, self.top_k, self.capacity_factor)
        # the one host read of an MoE layer's forward: the routing decides the shapes (tokens
        # per expert), which the host needs to slice, launch and exchange (a GPU-side routing
        # with fixed-capacity buffers would remove it: minidist/train/README.md)
        r = route(backend.host_read(probs.data, "moe routing"), self.top_k, cap, T)
        self.routing = r
        self.aux_loss = load_balancing_loss(probs, r.chosen, T, self.top_k)
        self.z_loss = router_z_loss(logits)
        xp = backend.xp_of(x.data)
        token, expert = xp.asarray(r.token), xp.asarray(r.expert)
        gate = probs[token, expert].reshape(-1, 1)                      # (M, 1)
        xin = x2[token]                                                 # (M, C) by expert
        if self.exchange is None:
            y = self.run_experts(xin, r.counts)                         # (M, C)
        else:     # all-to-all to the experts' ranks, run_experts there, all-to-all back
            y = self.exchange.run(xin, r.counts, self.run_experts)      # (M, C)
        if self.training and self.dropout.p > 0:
            y = expert_dropout(y, r, self.dropout.rng, self.dropout.p, (B, T, C))
        out = IndexAddRows.apply(y * gate, token, B * T)                # (N, C)
        return out.reshape(B, T, C)

    def router_loss(self):
        """What this layer adds to the model's loss, from its last forward: aux_coef x the
        load-balancing loss (+ z_coef x the z-loss when z_coef is not 0)."""
        loss = self.aux_loss * self.aux_coef
        return loss + self.z_loss * self.z_coef if self.z_coef else loss

    def run_experts(self, xin, counts):
        """xin (M, C), rows sorted by expert, `counts[i]` rows for the i-th of self.local ->
        (M, C). Every expert runs, on 0 rows too, so each gets a (zero) gradient."""
        parts, lo = [], 0
        for e, n in zip(self.local, counts):
            parts.append(getattr(self.experts, str(e))(xin[lo:lo + int(n)]))   # (n, C)
            lo += int(n)
        return parts[0] if len(parts) == 1 else concat(parts, axis=0)


def moe_layers_by_block(model):
    """{block number: its MoE layer} for the MoE blocks `model` holds (a pipeline stage: its
    own, under their global numbers) that have run a forward."""
    return {int(name.split(".")[2]): m for name, m in model.named_modules()
            if isinstance(m, MoE) and m.routing is not None}


def load_stats(model):
    """The MoE blocks' routing in the last forward, on this rank's rows, for the log:
    {"moe_tokens": [[assignments kept per expert] per MoE block], "moe_dropped": [per block],
    "moe_aux": [load-balancing loss per block]}; {} for a dense model."""
    layers = list(moe_layers_by_block(model).values())
    if not layers:
        return {}
    return {"moe_tokens": [m.routing.counts.tolist() for m in layers],
            "moe_dropped": [m.routing.dropped for m in layers],
            "moe_aux": [float(backend.host_read(m.aux_loss.data, "moe log")) for m in layers]}
