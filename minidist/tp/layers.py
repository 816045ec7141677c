"""Tensor-parallel layers (Megatron-LM): each rank holds 1/tp of a layer's weights.

    ColumnParallelLinear   W (in, out/tp): enter(x) [f], then x @ W_r + b_r -> (..., out/tp);
                           under sequence parallelism one op, gathered_linear: the all-gather
                           inside, only the (B, T/tp, C) shard kept (region.linear)
    RowParallelLinear      W (in/tp, out): x_r @ W_r, leave [g], then + b (added once)
    VocabParallelEmbedding wte (V/tp, C): each rank looks up the ids in its vocabulary range
                           (zeros for the rest), leave [g] sums the ranks' rows
    vocab_parallel_cross_entropy   the loss from (N, V/tp) logit shards: max, sum of exps and
                           the target's logit are all-reduced, N numbers each; the (N, V)
                           logits never exist on any rank

    SequenceParallelLayerNorm      LayerNorm whose weight and bias pass `region.shared`
    SequenceParallelRMSNorm        RMSNorm whose weight does (Llama-style blocks)

Every split parameter carries `.tp_split` (a Split: how to cut the full tensor and glue it
back); replicated ones (layer norms, position embedding, row-parallel biases) carry None.
Under sequence parallelism those replicated ones are used on sequence shards and reach the
layers through `region.shared` (f), which all-reduces their gradients over tp, or, under the
strategies, leaves them partial for one coalesced sum a step (TensorParallelRegion.leave_partial).
The vocabulary is padded to a multiple of tp (Megatron does the same): the padding rows of
wte are zero, their logits are masked out of the loss, so their gradient is zero and AdamW
(no decay on embeddings) leaves them zero; gathering the model drops them.

Dropout stays exact against one process: a rank draws each row's numbers of the WHOLE
tensor by their keys and keeps its slice (heads for attention dropout, positions under
sequence parallelism): minidist/autograd/dropout_keys.py, set by tp/model.py. (Megatron uses
per-rank generator streams instead: cheaper, but not comparable with one process.)
Tests: tests/test_tensor_parallel.py.
"""
from minidist import backend
from minidist.autograd import Function
from minidist.autograd import fused as F
from minidist.autograd.fused import counted_rows_sum, in_f32, rows_counted
from minidist.autograd.indexing import rows_into_table
from minidist.backend import xp_of
from minidist.nn.layers import LayerNorm, RMSNorm
from minidist.nn.module import Module, Parameter
from minidist.strategy.split import Split


def _param(shape, dtype, split=None, decay=True):
    """A zero Parameter on the current device (the model loads its shard of gpt_init)."""
    p = Parameter(backend.get_xp().zeros(shape, dtype=dtype), decay=decay)
    p.tp_split = split
    return p


class ColumnParallelLinear(Module):
    """y_r = x @ W[:, cols of rank r] + b[cols of rank r]. `blocks`: the output axis is that
    many equal parts, or parts of these lengths (c_attn's q|k|v, SwiGLU's [gate|up]), and
    each rank takes its columns from every part."""

    def __init__(self, in_features, out_features, region, bias=True, dtype="float32",
                 blocks=1):
        super().__init__()
        self.region = region
        split = Split(1, out_features, blocks)
        local = split.local(region.size)
        self.weight = _param((in_features, local), dtype, split)
        self.bias = _param((local,), dtype, Split(0, out_features, blocks), False) \
            if bias else None

    def forward(self, x):                              # (B, T, C) or (B, T/tp, C) under SP
        return self.region.linear(x, self.weight, self.bias)          # (B, T, out/tp)

    def matmul(self, x):
        """forward without the bias (the MLP adds c_fc's in the GELU's pass: bias_gelu)."""
        return self.region.linear(x, self.weight)                      # (B, T, out/tp)


class RowParallelLinear(Module):
    """y = sum_r x_r @ W[rows of rank r], then + b: the bias is replicated and added once,
    after the sum (adding it on every rank would count it tp times)."""

    def __init__(self, in_features, out_features, region, bias=True, dtype="float32"):
        super().__init__()
        self.region = region
        split = Split(0, in_features)
        self.weight = _param((split.chunk(region.size), out_features), dtype, split)
        self.bias = _param((out_features,), dtype, None, False) if bias else None

    def forward(self, x):                              # (B, T, in/tp)
        y = self.region.leave(F.linear(x, self.weight))    # (B, T, out) or (B, T/tp, out)
        return y + self.region.shared(self.bias) if self.bias is not None else y


def shared_gain_and_shift(norm, region):
    """A norm's (weight, bias) through `region.shared`: under sequence parallelism each rank
    normalises only its positions, so their gradients are all-reduced over tp."""
    b = region.shared(norm.bias) if norm.bias is not None else None
    return region.shared(norm.weight), b


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm whose (replicated) weight and bias go through `region.shared`; otherwise it
    is LayerNorm."""

    def __init__(self, ndim, region, bias=True, dtype="float32", eps=1e-5):
        super().__init__(ndim, bias=bias, eps=eps, dtype=dtype)
        self.region = region

    def gain_and_shift(self):
        return shared_gain_and_shift(self, self.region)


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm (Llama's) whose replicated weight goes through `region.shared`."""

    def __init__(self, ndim, region, dtype="float32", eps=1e-5):
        super().__init__(ndim, eps=eps, dtype=dtype)
        self.region = region

    def gain_and_shift(self):
        return shared_gain_and_shift(self, self.region)


# ---- the vocabulary split ---------------------------------------------------------------

class VocabShardLookup(Function):
    """weight[idx - start] for ids in [start, start + rows), zero rows for the others."""

    @staticmethod
    def forward(ctx, weight, idx, start):
        xp = xp_of(weight)
        idx = xp.asarray(idx)
        mine = (idx >= start) & (idx < start + weight.shape[0])
        local = xp.where(mine, idx - start, 0)
        out = xp.take(weight, local, axis=0)                   # (*idx.shape, C)
        # zero the other shards' rows by a multiply, not out[~mine] = 0: a boolean mask's
        # size is data-dependent, and CuPy reads it to the host (a sync every step)
        out *= mine[..., None]
        ctx.save_for_backward(local, mine)
        ctx.shape = weight.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        local, mine = ctx.saved
        # the other shards' ids point at row 0 and add a zero row there (no boolean mask)
        return rows_into_table(ctx.shape, local, grad * mine[..., None]), None, None


class VocabParallelEmbedding(Module):
    """Token embedding with the vocabulary split over tp: rank r holds rows
    [r * V_r, (r + 1) * V_r) of the (padded) table; the lookup's partial sums leave the
    region (g: every rank gets the full (B, T, C); sequence parallel: its positions)."""

    def __init__(self, num_embeddings, embedding_dim, region, dtype="float32"):
        super().__init__()
        self.region, self.num_embeddings = region, num_embeddings
        split = Split(0, num_embeddings)
        self.weight = _param((split.chunk(region.size), embedding_dim), dtype, split, False)
        self.start = region.rank * split.chunk(region.size)    # first id this rank holds

    def forward(self, idx):                                    # (B, T) ints
        return self.region.leave(VocabShardLookup.apply(self.weight, idx, self.start))


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy from logit shards (N, V_r): this rank's vocabulary columns start at
    `start`; columns at or past `vocab_size` are padding and count as -inf.

        m = max over all ranks (all-reduce max, N numbers)
        s = sum_j exp(z_j - m),  z_t - m   (one all-reduce sum of 2N numbers: each rank adds
                                            its exps, and the target's logit if it holds it)
        loss = mean over non-ignored rows of log s - (z_t - m)
    Backward needs no communication: dloss/dz_j = (softmax_j - [j == t]) / n on each shard."""

    @staticmethod
    def forward(ctx, logits, targets, group, start, vocab_size, ignore_index=-1):
        xp, Vr = xp_of(logits), logits.shape[-1]
        p = in_f32(logits).reshape(-1, Vr).copy()                # (N, V_r), becomes softmax
        t = xp.asarray(targets).reshape(-1)
        valid = t != ignore_index
        p[:, max(vocab_size - start, 0):] = -xp.inf            # padding columns
        m = p.max(axis=-1)                                     # (N,) this shard's max
        group.all_reduce(m, op="max")
        p -= m[:, None]
        mine = valid & (t >= start) & (t < start + Vr)
        local_t = xp.where(mine, t - start, 0)
        rows = xp.arange(len(t))
        sums = xp.stack([xp.where(mine, p[rows, local_t], 0.0), xp.exp(p, out=p).sum(-1)])
        group.all_reduce(sums)                                 # (2, N): z_t - m, s
        p /= counted_rows_sum(sums[1], valid)[:, None]         # ignored rows: 0
        n = rows_counted(valid, p.dtype)                       # on the device: no host read
        loss = ((xp.log(sums[1]) - sums[0]) * valid).sum() / n
        ctx.save_for_backward(p, local_t, mine)
        ctx.n, ctx.shape = n, logits.shape
        return xp.asarray(loss, dtype="float32" if backend.is_half(logits.dtype)
                          else logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        p, local_t, mine = ctx.saved
        ctx.saved = ()                     # the softmax buffer becomes the gradient
        rows = xp_of(p).arange(len(local_t))
        p[rows, local_t] -= mine               # 1 at this shard's targets (no boolean mask)
        p *= grad.astype(p.dtype) / ctx.n
        return p.reshape(ctx.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, group, start, vocab_size, ignore_index=-1):
    """Scalar mean cross-entropy of logit shards (B, T, V_r) against full targets (B, T);
    the same value on every rank of `group`."""
    return VocabParallelCrossEntropy.apply(logits, targets, group, start, vocab_size,
                                           ignore_index)
