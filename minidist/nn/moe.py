"""Mixture of Experts: E expert MLPs behind a learned router (Switch Transformer, GShard).

Dimensions as in block.py (B, T, C), plus N = B T tokens, E experts, k experts per token,
M kept (token, expert) assignments.

    x (B, T, C) -> (N, C) -> router: logits = x W_r (N, E), probs = softmax(logits)
    top-k:     each token's k most probable experts (slot 0 the most probable), ranked by
               probs + bias where the layer has a bias (below)
    capacity:  each expert takes at most cap = ceil(f k T / E) tokens of each sequence
               (f = moe_capacity_factor; 0: no limit); past it an assignment is dropped, in
               GShard's priority order: every token's slot-0 choice in token order, then slot 1
    experts:   expert e runs its MLP (GPT-2's, block.py's MLP) on its tokens, in token order
    combine:   out_n = sum over token n's kept assignments e of probs[n, e] * expert_e(x_n)
               (a dropped assignment adds 0; the block's residual carries the token on)
    shared:    (moe_shared S > 0) + shared(x_n): S shared experts every token runs, ungated,
               as one MLP S F wide (DeepSeekMoE, Dai et al. 2024: common knowledge in them,
               the routed ones free to specialise); built by the block with its layers, so
               under tensor parallelism it is split as the dense MLP is, and under expert
               parallelism it is dense, on every rank
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
and has the same losses: this is what makes the parallel runs exact. A sequence cut into
positions per rank (sequence parallelism: `region`, context parallelism: `context`) needs
the other ranks' choices and sums: minidist/nn/moe_split.py, the same code with `parts`.

Auxiliary-loss-free balancing (--moe-bias-rate; Wang et al. 2024, DeepSeek-V3): `bias` (E,)
is added to probs for the top-k choice only (`route`; the combine's weights stay probs), and
each training forward adds its per-sequence `chosen` to `load`, which the loop sums over the
global batch to move the bias after every step (minidist/nn/moe_bias.py). Where the bias
lives: not as a Parameter, since every strategy's parameter machinery (DDP's buckets, ZeRO's
flat shards, tensor-parallel splits, the optimizers) would carry, shard or step a thing no
gradient trains, but as a host table of every block's bias (moe_bias.RouterBias, the GPT's,
the same bits on every rank, each MoE layer a view of its row), saved with the run's state
beside the parameters: the meta's "rng" dict, where the dropout keys' step is, which every
strategy's save writes from its writing rank and every rank reads back (_run_state in
minidist/train/loop.py). So a checkpoint holds it in one layout-free form: a resume is
bit-identical (JSON keeps a float64 exact), any other layout reads it as it is, and one from
before it (or a dense model's) starts the bias at 0. examples/sample.py routes by it too.

Expert parallelism (minidist/ep/) keeps only this rank's experts (`keep_experts`) and sets
`exchange`, which carries the (M, C) expert inputs to the experts' ranks and the outputs back
(all-to-all); the routing and the combine stay here, the same code in both.
Tests: tests/test_moe.py (float64 gradchecks, routing and dropping, losses);
tests/scripts/ep_check.py (SP and CP runs against one process); tests/test_moe_bias.py.
"""
import math
from dataclasses import replace

import numpy as np

from minidist import backend
from minidist.autograd import Function, Tensor, is_grad_enabled, no_grad
from minidist.autograd import fused as F
from minidist.autograd.indexing import concat, scatter_add_rows, where
from minidist.nn.layers import Dropout, Linear
from minidist.nn.module import Module, ModuleDict
from minidist.nn.moe_split import choice_dtype, sequence_parts


# ---- routing: which token goes to which expert (host numpy, no gradient) -------------------

class Routing:
    """The kept assignments of this rank's tokens, sorted by (expert, token, slot): token (M,),
    expert (M,), slot (M,); counts (E,) kept per expert; chosen (B, E) assignments per WHOLE
    sequence before dropping; assigned: this rank's assignments before dropping (N k);
    positions (T,): the places of this rank's T tokens in sequences of length `length`."""

    def __init__(self, token, expert, slot, counts, chosen, assigned, positions, length):
        self.token, self.expert, self.slot = token, expert, slot
        self.counts, self.chosen, self.assigned = counts, chosen, assigned
        self.positions, self.length = positions, length

    @property
    def dropped(self):
        """This rank's assignments dropped for lack of capacity."""
        return int(self.assigned - self.counts.sum())

    @property
    def parts(self):
        """The ranks each sequence's tokens are split over (1: this rank holds them whole)."""
        return self.length // self.positions.size


def capacity(T, E, k, factor):
    """Tokens of one sequence an expert takes: ceil(factor k T / E), at most T; factor 0: T."""
    return T if factor <= 0 else min(T, math.ceil(factor * k * T / E))


def route(probs, k, cap, T, parts=None, bias=None):
    """probs (N, E) host array, N = B T -> Routing (top-k, then capacity `cap` per sequence
    and expert, GShard's priority: slot-major, token-minor). `parts` (moe_split.py): the T
    tokens here are some positions of longer sequences; the choices of the others are
    gathered so that the priority runs over the whole sequence, as in one process.
    `bias` (E,) host float64 or None: each token's k experts are the top-k of probs + bias
    (moe_bias.py), slot 0 the highest, so the capacity's priority follows the biased choice;
    the combine's weights stay probs (MoE.forward reads them, not the scores)."""
    N, E = probs.shape
    B = N // T
    scores = probs if bias is None else probs + bias                    # (N, E)
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k].reshape(B, T, k)
    top = top.astype(choice_dtype(E))                                  # (B, T, k) expert ids
    whole = top if parts is None else parts.gather(top)                # (B, Tg, k)
    Tg = whole.shape[1]
    choice = whole.transpose(0, 2, 1).reshape(B, k * Tg)               # priority order
    onehot = choice[..., None] == np.arange(E)                          # (B, kTg, E)
    seen = np.take_along_axis(onehot.cumsum(axis=1), choice[..., None].astype(np.int64),
                              axis=2)[..., 0]
    keep = (seen <= cap).reshape(B, k, Tg)                              # within cap
    if parts is not None:
        keep = keep[:, :, parts.mine]                                   # (B, k, T) mine
    b, slot, t = np.nonzero(keep)                                       # sequence, slot, token
    token, expert = b * T + t, top[b, t, slot].astype(np.int64)
    order = np.lexsort((slot, token, expert))                           # by expert, token, slot
    counts = np.bincount(expert, minlength=E)
    mine = np.arange(T) if parts is None else parts.mine
    return Routing(token[order], expert[order], slot[order], counts, onehot.sum(axis=1),
                   N * k, mine, Tg)


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
    return balance_from_sums(probs.reshape(B, T, E).sum(axis=1), chosen, T, k)


def balance_from_sums(psum, chosen, T, k):
    """load_balancing_loss from psum (B, E) Tensor, each sequence's router probabilities summed
    over its T tokens (P = psum / T): what a rank holding part of the sequence gets from the
    sums of every part (moe_split.py)."""
    B, E = chosen.shape
    f = Tensor(backend.to_device(chosen / (k * T), backend.xp_of(psum.data)).astype(
        psum.dtype))                                                    # (B, E) constant
    return (psum * f).sum() * (E / (B * T))


def expert_dropout(y, routing, rng, p, shape, parts=None):
    """Dropout on the experts' outputs y (M, C), rows sorted by expert as `routing`'s. Row b
    of the batch has (E, T, C) numbers (`shape`: this forward's (B, T, C); `rng`: the GPT's
    DropoutSite, whose numbers are keyed by the row's place in the global batch), of which
    assignment (token n = (b, t), expert e) keeps [e, t, :], computed for the assignments
    alone. A mask thus depends on the token's place in the global batch and its expert, not
    on which rank runs the expert or in what order. Survivors are scaled by 1/(1-p), as
    ops.dropout's. `parts` (moe_split.py): this rank's T tokens are the positions parts.mine
    of sequences of parts.T, whose places in the row they take."""
    B, T, C = shape
    b, t = np.divmod(routing.token, T)                                  # (M,) each
    if parts is not None:
        t, T = parts.mine[t], parts.T                                   # global positions
    base = (np.asarray(routing.expert) * T + t) * C                     # [e, t, 0] in the row
    numbers = rng.at(B, b, base, np.arange(C), backend.xp_of(y.data))   # (M, C)
    return where(numbers >= p, y * (1.0 / (1.0 - p)), 0.0)


def router_z_loss(logits):
    """Mean over tokens of logsumexp(logits)^2: logits (N, E) Tensor -> scalar Tensor."""
    return z_sum(logits) * (1.0 / logits.shape[0])


def z_sum(logits):
    """Sum over tokens of logsumexp(logits)^2: logits (N, E) Tensor -> scalar Tensor."""
    m = logits.data.max(axis=-1, keepdims=True)                         # (N, 1) a constant
    lse = (logits - m).exp().sum(axis=-1).log() + m[:, 0]               # (N,)
    return (lse * lse).sum()


# ---- the layer ------------------------------------------------------------------------------

class MoE(Module):
    """E experts (`make_expert(config, dtype)`, block.py's MLP, built without dropout) behind a
    router; the MLP of a MoE block. Parameters: router.weight (C, E), experts.<e>.c_fc /
    c_proj (e global), and with `shared_expert` (an MLP, its own dropout) its c_fc / c_proj.
    `dropout`: the experts' (expert_dropout), its rng set by GPT. `bias`: the routing bias
    (module docstring), set by GPT; `load`: the assignments per expert, before dropping, of
    the training forwards since moe_bias.global_loads last took them."""
    exchange = None     # expert parallelism's ExpertExchange (minidist/ep/exchange.py), or None
    region = None       # tensor parallelism's TensorParallelRegion (set by TensorParallelGPT)
    context = None      # context parallelism's RingContext (set by minidist/cp/context.py)

    def __init__(self, config, make_expert, dtype="float32", shared_expert=None):
        super().__init__()
        E = config.moe_experts
        self.router = Linear(config.n_embd, E, bias=False, dtype=dtype)
        plain = replace(config, dropout=0.0)       # the experts' dropout is the layer's
        self.experts = ModuleDict(**{str(e): make_expert(plain, dtype) for e in range(E)})
        self.shared_expert = shared_expert
        self.dropout = Dropout(config.dropout)     # expert_dropout's rate and draws
        self.n_experts, self.top_k = E, config.moe_top_k
        self.capacity_factor = config.moe_capacity_factor
        self.aux_coef, self.z_coef = config.moe_aux_loss_coef, config.moe_z_loss_coef
        self.local = list(range(E))     # the experts this rank holds (all, on one process)
        self.aux_loss = self.z_loss = self.routing = None     # from the last forward
        self.bias = None                # (E,): a view of the GPT's RouterBias row, or None
        self.load = np.zeros(E, dtype=np.int64)     # chosen per expert since last taken
        self.logged = StepRouting(E)                # the log's, since last taken

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
        parts = sequence_parts(self.region, self.context, T)    # SP / CP: moe_split.py
        logits = F.linear(x2, self.shared(self.router.weight))          # (N, E)
        probs = F.softmax(logits, axis=-1)                              # (N, E)
        Tg = T if parts is None else parts.T                            # the whole sequence
        cap = capacity(Tg, self.n_experts, self.top_k, self.capacity_factor)
        # the one host read of an MoE layer's forward: the routing decides the shapes (tokens
        # per expert), which the host needs to slice, launch and exchange (a GPU-side routing
        # with fixed-capacity buffers would remove it: minidist/train/README.md)
        r = route(backend.host_read(probs.data, "moe routing"), self.top_k, cap, T, parts,
                  self.bias)
        self.routing = r
        if self.training and is_grad_enabled():   # the forward backward follows: once per
            self.load += r.chosen.sum(axis=0)     # micro-batch (a checkpointed block's first
                                                  # run records no graph, its recompute does)
        self.aux_loss, self.z_loss = self.losses(probs, logits, r.chosen, parts)
        if self.training and is_grad_enabled():   # every micro-batch of the step, for the
            self.logged.add(r, self.aux_loss.data)  # log (not only the last: walk 35)
        xp = backend.xp_of(x.data)
        token, expert = xp.asarray(r.token), xp.asarray(r.expert)
        gate = probs[token, expert].reshape(-1, 1)                      # (M, 1)
        xin = x2[token]                                                 # (M, C) by expert
        if self.exchange is None:
            y = self.run_experts(xin, r.counts)                         # (M, C)
        else:     # all-to-all to the experts' ranks, run_experts there, all-to-all back
            y = self.exchange.run(xin, r.counts, self.run_experts)      # (M, C)
        if self.training and self.dropout.p > 0:
            y = expert_dropout(y, r, self.dropout.rng, self.dropout.p, (B, T, C), parts)
        out = IndexAddRows.apply(y * gate, token, B * T).reshape(B, T, C)
        if self.shared_expert is not None:                              # every token, ungated
            out = out + self.shared_expert(x)
        return out

    def losses(self, probs, logits, chosen, parts):
        """(load-balancing loss, z-loss) of this forward, from each sequence's sums over its
        tokens; with `parts` the sums over every rank's tokens (one all-reduce: moe_split.py),
        so both are one process's on every rank."""
        B, E = chosen.shape
        T = probs.shape[0] // B
        psum = probs.reshape(B, T, E).sum(axis=1)                       # (B, E)
        if self.z_coef:
            zsum = z_sum(logits)                                        # ()
        else:     # not in the loss: its value without a graph, which self.z_loss would
            with no_grad():     # keep alive (the (N, E) exp and more) until the next forward
                zsum = z_sum(logits)      # (tests/scripts/soak.py found it, 2026-11-29)
        if parts is not None:
            both = parts.total(concat([psum.reshape(B * E), zsum.reshape(1)], axis=0))
            psum, zsum, T = both[:B * E].reshape(B, E), both[B * E], parts.T
        return balance_from_sums(psum, chosen, T, self.top_k), zsum * (1.0 / (B * T))

    def shared(self, p):
        """A replicated parameter as the layer uses it on this rank's tokens: under sequence
        parallelism through the tp region's `shared` (its gradient summed over tp)."""
        return p if self.region is None else self.region.shared(p)

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
            parts.append(self.run_expert(getattr(self.experts, str(e)), xin[lo:lo + int(n)]))
            lo += int(n)
        return parts[0] if len(parts) == 1 else concat(parts, axis=0)

    def run_expert(self, mlp, x):
        """block.py's MLP forward, act(x W_fc + b_fc) W_proj + b_proj (its dropout is 0), on
        x (n, C), each parameter passed through `shared` (sequence parallelism)."""
        fc, proj, s = mlp.c_fc, mlp.c_proj, self.shared
        h = mlp.activation(F.linear(x, s(fc.weight)), None if fc.bias is None else s(fc.bias))
        return F.linear(h, s(proj.weight), None if proj.bias is None else s(proj.bias))


def moe_layers(model):
    """{block number: its MoE layer} for every MoE block `model` holds (a pipeline stage: its
    own, under their global numbers)."""
    return {int(name.split(".")[2]): m for name, m in model.named_modules()
            if isinstance(m, MoE)}


def moe_layers_by_block(model):
    """moe_layers, those that have run a forward."""
    return {b: m for b, m in moe_layers(model).items() if m.routing is not None}


class StepRouting:
    """A layer's routing summed over the training forwards since last taken (every
    micro-batch of a step: --grad-accum's, a pipeline's), for the log's rows: assignments
    kept per expert, dropped, and the load-balancing losses (summed on the device: read when
    taken, the layer's one "moe log" host read). First-use walk 35: a pipeline's rows held its last
    micro-batch's counts only, a quarter of the batch at 4 micro-batches."""

    def __init__(self, n_experts):
        self.n_experts = n_experts
        self._start()

    def _start(self):
        self.kept, self.dropped = np.zeros(self.n_experts, np.int64), 0
        self.aux, self.forwards = None, 0           # (the losses' sum, on the device)

    def add(self, routing, aux):
        self.kept += routing.counts
        self.dropped += routing.dropped
        self.aux = aux.astype("float64") if self.aux is None else self.aux + aux
        self.forwards += 1

    def take(self):
        """(kept (E,) int64, dropped, the mean load-balancing loss: a host float, read here
        (0.0 without a forward)) since the last take; starts again from zero."""
        aux = 0.0 if self.aux is None else \
            float(backend.host_read(self.aux / self.forwards, "moe log"))
        taken = self.kept, self.dropped, aux
        self._start()
        return taken


def load_stats(model):
    """The MoE blocks' routing in the step's training forwards (StepRouting, taken), on this
    rank's rows, for the log: {"moe_tokens": [[assignments kept per expert] per MoE block],
    "moe_dropped": [per block], "moe_aux": [load-balancing loss per block, the micro-batches'
    mean]}; {} for a dense model."""
    layers = list(moe_layers_by_block(model).values())
    if not layers:
        return {}
    taken = [m.logged.take() for m in layers]
    return {"moe_tokens": [kept.tolist() for kept, _, _ in taken],
            "moe_dropped": [dropped for _, dropped, _ in taken],
            "moe_aux": [aux for _, _, aux in taken]}
