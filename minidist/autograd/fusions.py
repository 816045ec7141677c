"""Fused ops across the GPT block's layer boundaries: one Function where the model had two.

    bias_gelu(h, b)                  gelu(h + b): c_fc's bias added in the GELU's pass (h is
                                     x @ W without the bias, Linear.matmul; the xp path
                                     adds b into h in place, as Linear did)
    residual_layer_norm(x, r, w, b)  (s, y) = (x + r, layer_norm(s)): the block's second
                                     residual add and ln_2, two outputs (s goes on to the
                                     next residual add, y into the MLP)
    padded_cross_entropy(z, t, V)    the mean cross-entropy over the first V of Vp logit
                                     columns (a vocabulary padded to a multiple), 0 gradient
                                     in the padding

Dimensions: N rows (B * T), C features, V real and Vp padded vocabulary columns.
Each has two paths. On cupy arrays with MINIDIST_CUDA_NEW_KERNELS=1 (`use_new`) it launches
the kernels of cuda_source_fusions.py through the glue in cuda_kernels_new.py (one kernel
where the xp code makes several passes; off by default until a GPU session confirms them).
Otherwise it runs fused.py's code (which itself uses cuda_kernels.py's older kernels on
cupy arrays) in the order the unfused layers did, so on numpy the numbers are bit for bit
those of the two ops it replaces; 16-bit inputs accumulate in float32, as in fused.py.
Proven by tests/test_fusions.py (the xp path against the unfused ops, bitwise; the kernel
glue run on numpy through the CPU harness against the xp path) and tests/test_gradcheck.py.
"""
import math

from minidist.autograd import cuda_kernels_new as _ckn
from minidist.autograd import fused as F
from minidist.autograd.cuda_kernels import launch
from minidist.autograd.function import Function, apply_outputs
from minidist.backend import xp_of


# ---- bias + GELU ----------------------------------------------------------------------------

class BiasGelu(Function):
    """y = gelu(h + b) for h (..., C), b (C,), h a matmul's fresh output (Linear.matmul).
    The xp path adds b into h IN PLACE, as Linear adds its bias into its own output: the
    graph holds h anyway (it is this op's input), so no second (N, C) array is made and
    backward reads h + b from h. The kernel path leaves h alone and adds b in its passes.
    db is a column sum of dh: zero-bubble pipelines' B pass computes it with dh
    (weight_grads_in_b), so nothing (N, C) waits for their W pass here."""

    weight_grads_in_b = True

    @staticmethod
    def forward(ctx, h, b):
        if b.shape != h.shape[-1:]:
            raise ValueError("the bias must have the shape of h's last axis")
        if b.dtype != h.dtype:
            raise TypeError(f"mixed dtypes {h.dtype} and {b.dtype}; cast one (.astype)")
        ctx.save_for_backward(h, b)
        ctx.kernel = _ckn.use_new(h, b)
        if ctx.kernel:                                # one kernel: the add in GELU's pass
            return _ckn.bias_gelu(xp_of(h), launch, h, b)
        h += b                                        # h is h + b from here on
        return F.gelu_forward(h)

    @staticmethod
    def backward(ctx, grad):
        v, b = ctx.saved                              # h + b (the kernel path: h)
        if ctx.kernel:
            return _ckn.bias_gelu_backward(xp_of(v), launch, v, b, grad, ctx.needs_input_grad)
        dv = F.gelu_backward(v, grad).astype(v.dtype, copy=False)   # 16 bits: rounded before
        db = F.sum_rows(dv.reshape(-1, b.size)) if ctx.needs_input_grad[1] else None  # the sum
        return dv, db                                 # d(h + b): dh = dv, db = sum of rows


def bias_gelu(h, b):
    """gelu(h + b); b None: gelu(h). h must be a fresh array nobody else reads (the xp
    path overwrites it with h + b): the matmul's output, as in block.MLP."""
    return F.gelu(h) if b is None else BiasGelu.apply(h, b)


# ---- residual + layer norm ------------------------------------------------------------------

class ResidualLayerNorm(Function):
    """s = x + r and y = layer_norm(s, w, b) for x, r (..., C), w, b (C,): two outputs, handed
    out by Pick nodes (function.apply_outputs). Backward: s's gradient arrives from later
    (grad_s, the next residual add) and y's through layer norm, so
        dx = dr = grad_s + layer_norm's dx(grad_y),  dw, db from grad_y alone.
    dw and db are column sums, computed in zero-bubble pipelines' B pass (weight_grads_in_b,
    as fused.LayerNorm)."""
    weight_grads_in_b = True

    @staticmethod
    def forward(ctx, x, r, w, b, eps, outputs):
        if x.shape != r.shape or w.shape != x.shape[-1:] or (b is not None and
                                                            b.shape != w.shape):
            raise ValueError("x and r must have one shape; w and b that of its last axis")
        if x.dtype != r.dtype:
            raise TypeError(f"mixed dtypes {x.dtype} and {r.dtype}; cast one (.astype)")
        ctx.grads, ctx.kernel, ctx.dtype = outputs.grads, _ckn.use_new(x, r, w, b), x.dtype
        if ctx.kernel:                                # s and y in one pass over each row
            s, y, saved = _ckn.residual_layer_norm(xp_of(x), launch, x, r, w, b, eps)
        else:
            s = x + r                                 # the residual add, as Tensor + did
            y, saved, ctx.cuda = F.layer_norm_forward(s, w, b, eps)
        ctx.save_for_backward(*saved)
        outputs.arrays[:] = [s, y]
        return xp_of(x).empty((0,), x.dtype)          # the placeholder the Picks hang on

    @staticmethod
    def backward(ctx, grad):
        grad_s, grad_y = ctx.grads                    # the Picks' (None: unused output)
        needs = ctx.needs_input_grad
        if needs[0] or needs[1]:                      # used now; a deferred W needs only y's
            ctx.grads[0] = None
        if ctx.kernel:
            dx, dr, dw, db = _ckn.residual_layer_norm_backward(
                xp_of(grad), launch, grad_s, grad_y, ctx.saved, needs)
            return dx, dr, dw, db, None, None
        dx = dw = db = None
        if grad_y is not None:
            dx, dw, db = F.layer_norm_backward(grad_y, ctx.saved, ctx.cuda,
                                               (needs[0] or needs[1], needs[2], needs[3]))
        if dx is not None:
            dx = dx.astype(ctx.dtype, copy=False)    # 16 bits: rounded, then added
        if grad_s is not None and dx is not None:
            dx = grad_s + dx                          # s feeds both: its gradients add up
        elif grad_s is not None:
            dx = grad_s
        return dx, dx, dw, db, None, None             # s = x + r: the same gradient to each


def residual_layer_norm(x, r, weight, bias=None, eps=1e-5):
    """(s, y) = (x + r, layer_norm(x + r, weight, bias, eps)), two Tensors."""
    return apply_outputs(ResidualLayerNorm, 2, x, r, weight, bias, eps)


# ---- cross-entropy over a padded vocabulary -------------------------------------------------

class PaddedCrossEntropy(Function):
    """Mean over non-ignored rows of -log softmax(logits[..., :V])[target] for logits
    (..., Vp), Vp >= V: the padding columns take no part, and their gradient is 0.
    The xp path writes -inf into logits' padding columns (in place: what the model returns
    is logits[..., :V], and the matmul that made them does not keep them) and runs
    fused.CrossEntropy's forward and backward with this op's ctx; the kernel path skips
    the padding instead (ce_pad_fwd/_bwd)."""

    @staticmethod
    def forward(ctx, logits, targets, V, ignore_index=-1):
        if not 0 < V <= logits.shape[-1]:
            raise ValueError(f"V = {V} real columns of {logits.shape[-1]}")
        if targets.dtype.kind not in "iu" or targets.shape != logits.shape[:-1]:
            raise TypeError("targets must be integers shaped like logits without its last "
                            f"axis, not {targets.dtype} {tuple(targets.shape)}")
        ctx.V, ctx.kernel = V, _ckn.use_new(logits)
        if ctx.kernel:
            loss, saved = _ckn.cross_entropy_padded(xp_of(logits), launch, logits, targets,
                                                    V, ignore_index)
            ctx.save_for_backward(*saved)
            ctx.shape, ctx.ignore = logits.shape, ignore_index
            return loss
        logits[..., V:] = -math.inf                   # softmax gives the padding 0
        return F.CrossEntropy.forward(ctx, logits, targets, ignore_index)

    @staticmethod
    def backward(ctx, grad):
        if ctx.kernel:
            dz = _ckn.cross_entropy_padded_backward(xp_of(grad), launch, grad, ctx.saved,
                                                    ctx.V, ctx.ignore)
            return dz.reshape(ctx.shape), None, None, None
        dz, _, _ = F.CrossEntropy.backward(ctx, grad)
        dz[..., ctx.V:] = 0                           # 0 already (p = 0 there); +0, exactly
        return dz, None, None, None


def padded_cross_entropy(logits, targets, V, ignore_index=-1):
    """Scalar mean cross-entropy of the first V columns of logits (N, Vp) or (B, T, Vp)
    against integer targets (N,) or (B, T) in [0, V) (or ignore_index)."""
    return PaddedCrossEntropy.apply(logits, targets, V, ignore_index)
