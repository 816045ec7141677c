"""A column-parallel matmul on a sequence shard that keeps only the shard for backward
(sequence parallelism, Korthikanti et al. 2022, section 4.2.2).

Under --sequence-parallel the input of a column-parallel layer (ln_1's output for c_attn,
ln_2's for c_fc, ln_f's for the tied head) lives as (B, T/tp, C) shards. The naive pair

    F.linear(gather_from_sequence(x_shard), W, b)      all-gather, then Linear

keeps the gathered (B, T, C) for the weight gradient: each layer then holds the whole
activation sequence parallelism was meant to divide by tp. `gathered_linear` is one op:

    forward    X = all-gather(x_shard) along T             (B, T, C), dropped after the matmul
               y = X W + b                                   saves x_shard and W only
    backward   start all-gather(x_shard) -> X              on the communication thread ...
               dX = dy W^T                                   ... while this matmul runs
               start reduce-scatter(dX) along T -> dx_shard  ... and this one while
               dW = X^T dy, db = sum of dy's rows            these run
               return dx_shard, dW, db

so backward moves one more all-gather of (B, T, C) than the pair did (its reduce-scatter is
the pair's). The overlap uses the group's `async_op` collectives (minidist/comm/group.py: a
communication thread per group, in issue order, the same on every rank); without that thread
(sync_comm, MPI below THREAD_MULTIPLE) the same calls run in sequence, the same numbers.
Dtypes and accumulation are F.linear's (minidist/autograd/fused.py Linear): the same GEMMs
(backend.matmul), the bias's column sum in float32 for 16-bit gradients (sum_rows).
Under defer_weight_grads (zero-bubble pipelines) B asks only for dx (no gather) and W only
for dW, db (the gather then, in W: every tp rank runs the same schedule, so the same order).
Tests: tests/scripts/tp_probes.py (a distributed gradcheck on 2 ranks; the activation ledger
before and after), tests/scripts/tp_check.py (exactness against one process).
"""
from minidist.autograd import Function
from minidist.autograd.fused import sum_rows
from minidist.backend import matmul as _mm
from minidist.tp.collectives import SEQ_AXIS, Gathering, ReduceScattering, all_gather


class GatheredLinear(Function):
    """y = all-gather(x) @ W + b along the sequence, saving x's shard instead of the gather.
    x (B, T/tp, C) this rank's positions, W (C, out/tp), b (out/tp,) or None -> (B, T, out/tp);
    backward returns x's (B, T/tp, C) gradient summed over the ranks (every rank's columns
    used every position), W's and b's gradients of this rank's columns."""

    @staticmethod
    def forward(ctx, x, w, b, group):
        xg = all_gather(x, group, SEQ_AXIS)                       # (B, T, C)
        out = _mm(xg.reshape(-1, xg.shape[-1]), w)                # (B T, out/tp)
        if b is not None:
            out += b
        ctx.save_for_backward(x, w)                               # the shard, not xg
        ctx.group = group
        return out.reshape(xg.shape[:-1] + (w.shape[1],))         # (B, T, out/tp)

    @staticmethod
    def backward(ctx, grad):                                      # (B, T, out/tp)
        x, w = ctx.saved
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = grad.reshape(-1, w.shape[1])                         # (B T, out/tp)
        # the re-gather runs on the communication thread while dX's matmul runs here
        gathering = Gathering(x, ctx.group, SEQ_AXIS, async_op=True) if need_w else None
        scattering = None
        if need_x:
            dxg = _mm(g2, w.T).reshape(grad.shape[:-1] + (w.shape[0],))   # (B, T, C)
            # dX's reduce-scatter (each rank's positions summed) runs while dW's matmul does
            scattering = ReduceScattering(dxg, ctx.group, SEQ_AXIS, async_op=True)
        dw = None
        if need_w:
            xg = gathering.wait()                                 # (B, T, C) again
            dw = _mm(xg.reshape(-1, xg.shape[-1]).T, g2)          # dL/dW = X^T dy
        db = sum_rows(g2) if need_b else None                     # dL/db = sum over rows
        dx = scattering.wait() if need_x else None                # (B, T/tp, C)
        return dx, dw, db, None


def gathered_linear(x, weight, bias, group):
    """all-gather(x) along the sequence @ weight + bias, keeping only x's shard for backward
    (bias may be None)."""
    return GatheredLinear.apply(x, weight, bias, group)
