"""Primitive ops: each a `Function` whose forward and backward sit side by side.

Elementwise arithmetic, unary math, reductions, matmul and shape ops live here; indexing,
concat/split, where/masked fill, embedding and dropout live in `indexing.py` and are
re-exported, so every primitive is `ops.<Name>` and every wrapper `ops.<name>(...)`.

Two rules every backward here follows:
  - never write into the incoming `grad` (another input of the same op may get that very
    array: `x + x` hands `grad` to both sides);
  - return gradients shaped like the op's *output* broadcast; `Function._reduce_to` sums
    them back to each input's shape, the one place broadcasting is undone.
`ctx.needs_input_grad[i]` says whether input i wants a gradient, so no work is done for
constants. Tests: tests/test_gradcheck.py (every op), tests/test_autograd.py,
tests/test_autograd_ops.py.
"""
from minidist.autograd.function import Function
from minidist.backend import is_float, matmul as _mm, xp_of


def same_float(a, b):
    """`a`, `b` with one float dtype. A 0-d operand takes the other's dtype (like a Python
    float does), so `x32 * np.float64(2)` stays float32; two real arrays of different float
    dtypes are an error rather than a silent, slow promotion. A Python float beside a
    bfloat16 array becomes a bfloat16 scalar (`_weak`)."""
    da, db = getattr(a, "dtype", None), getattr(b, "dtype", None)
    if da is None or db is None:
        return _weak(a, b), _weak(b, a)
    if da == db or not is_float(da) or not is_float(db):
        return a, b
    if b.ndim == 0:
        return a, b.astype(da)
    if a.ndim == 0:
        return a.astype(db), b
    raise TypeError(f"mixed float dtypes {da} and {db}; cast one explicitly (.astype)")


def _weak(s, array):
    """`s` as `array`'s dtype when `s` is a Python float and `array` a bfloat16 array, else
    `s` unchanged. numpy keeps a float16 or float32 array's dtype against a Python float
    (NEP 50), but ml_dtypes' bfloat16 is promoted to float32 by one: `x_bf16 * 0.01` would
    leave bfloat16 silently, and a tuple of outputs that must share a dtype (a checkpointed
    MoE block's output and router loss) breaks. CuPy 14 does the same: its ufuncs take a
    weak Python float's loop only where numpy.result_type(0.0, loop type) is that type, which
    for bfloat16 it is not, so the float32 loop wins (cupy/_core/_kernel.pyx, v14.0.1:
    _guess_routine_from_in_types). A bfloat16 scalar picks the bfloat16 loop on both."""
    dtype = getattr(array, "dtype", None)
    if type(s) is float and dtype is not None and dtype.name == "bfloat16":
        return dtype.type(s)
    return s


# ---- elementwise arithmetic ----------------------------------------------------------------

class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = same_float(a, b)
        return a + b

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = same_float(a, b)
        return a - b

    @staticmethod
    def backward(ctx, grad):
        return grad, (-grad if ctx.needs_input_grad[1] else None)


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = same_float(a, b)
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        need_a, need_b = ctx.needs_input_grad
        return (grad * b if need_a else None), (grad * a if need_b else None)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = same_float(a, b)
        out = a / b
        ctx.save_for_backward(b, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        b, out = ctx.saved                   # d(a/b)/da = 1/b;  d(a/b)/db = -a/b^2 = -out/b
        ga = grad / b if ctx.needs_input_grad[0] else None
        gb = -grad * out / b if ctx.needs_input_grad[1] else None
        return ga, gb


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, grad):
        return -grad


class Pow(Function):
    """a ** e, with e a Python number or a Tensor."""

    @staticmethod
    def forward(ctx, a, e):
        a, e = same_float(a, e)
        out = a ** e
        ctx.save_for_backward(a, e, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, e, out = ctx.saved                # d/da = e a^(e-1);  d/de = a^e log(a)
        xp = xp_of(a)
        ga = grad * e * a ** (e - 1) if ctx.needs_input_grad[0] else None
        ge = grad * out * xp.log(a) if ctx.needs_input_grad[1] else None
        return ga, ge


# ---- unary math ----------------------------------------------------------------------------

class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = xp_of(a).exp(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, = ctx.saved                     # d exp(a) = exp(a)
        return grad * out


class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return xp_of(a).log(a)

    @staticmethod
    def backward(ctx, grad):
        a, = ctx.saved                       # d log(a) = 1/a
        return grad / a


class Sqrt(Function):
    @staticmethod
    def forward(ctx, a):
        out = xp_of(a).sqrt(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, = ctx.saved                     # d sqrt(a) = 1 / (2 sqrt(a))
        return grad * 0.5 / out


class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        out = xp_of(a).tanh(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, = ctx.saved                     # d tanh(a) = 1 - tanh(a)^2
        return grad * (1 - out * out)


class Relu(Function):
    @staticmethod
    def forward(ctx, a):
        positive = a > 0                     # 1 byte per element, not a copy of `a`
        ctx.save_for_backward(positive)
        return a * positive

    @staticmethod
    def backward(ctx, grad):
        positive, = ctx.saved
        return grad * positive


# ---- reductions ----------------------------------------------------------------------------

def _axes(axis, ndim):
    """`axis` (None, int or tuple, negatives allowed) as a sorted tuple of non-negative axes."""
    if axis is None:
        return tuple(range(ndim))
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(a % ndim for a in axis))


def _unreduce(grad, shape, axes, keepdims):
    """Broadcast the gradient of a reduction back over the reduced axes (a view, no copy)."""
    xp = xp_of(grad)
    if not keepdims:
        grad = xp.expand_dims(grad, axes)
    return xp.broadcast_to(grad, shape)


class Sum(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape, ctx.axes, ctx.keepdims = a.shape, _axes(axis, a.ndim), keepdims
        return a.sum(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, grad):                 # every summed element gets the whole grad
        return _unreduce(grad, ctx.shape, ctx.axes, ctx.keepdims), None, None


class Mean(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape, ctx.axes, ctx.keepdims = a.shape, _axes(axis, a.ndim), keepdims
        return a.mean(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, grad):                 # each of the n averaged elements gets grad / n
        n = 1
        for ax in ctx.axes:
            n *= ctx.shape[ax]
        return _unreduce(grad * (1.0 / n), ctx.shape, ctx.axes, ctx.keepdims), None, None


class Max(Function):
    """Ties share the gradient equally (the subgradient a finite difference sees)."""

    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        axes = _axes(axis, a.ndim)
        out = a.max(axis=axes, keepdims=True)
        is_max = a == out
        ctx.save_for_backward(is_max)
        ctx.axes, ctx.keepdims = axes, keepdims
        return out if keepdims else out.reshape([n for i, n in enumerate(a.shape)
                                                  if i not in axes])

    @staticmethod
    def backward(ctx, grad):
        is_max, = ctx.saved
        xp = xp_of(grad)
        g = grad if ctx.keepdims else xp.expand_dims(grad, ctx.axes)
        ties = is_max.sum(axis=ctx.axes, keepdims=True).astype(grad.dtype)
        return (g * is_max) / ties, None, None


# ---- matmul --------------------------------------------------------------------------------

class MatMul(Function):
    """a @ b with numpy's rules: 1-D operands, batched (..., n, k) @ (..., k, m), broadcast
    batch dimensions."""

    @staticmethod
    def forward(ctx, a, b):
        a, b = same_float(a, b)
        if a.ndim == 0 or b.ndim == 0:
            raise ValueError("matmul needs at least 1-D operands (use * for scalars)")
        if a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise ValueError(f"inner dimensions differ: {a.shape[-1]} (last of a) vs "
                             f"{b.shape[-2 if b.ndim > 1 else 0]} (first core axis of b)")
        ctx.save_for_backward(a, b)
        return _mm(a, b)                                 # float16 on CPU: see backend

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        xp = xp_of(grad)
        a2 = a[None, :] if a.ndim == 1 else a             # (.., n, k)
        b2 = b[:, None] if b.ndim == 1 else b             # (.., k, m)
        g = grad
        if a.ndim == 1:
            g = xp.expand_dims(g, -2 if b.ndim > 1 else 0)
        if b.ndim == 1:
            g = xp.expand_dims(g, -1)                    # (.., n, m)
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = _mm(g, xp.swapaxes(b2, -1, -2))         # dL/da = g b^T
            ga = ga[..., 0, :] if a.ndim == 1 else ga
        if ctx.needs_input_grad[1]:
            if b2.ndim == 2 and a2.ndim > 2:             # x (B, T, k) @ W (k, m): one GEMM
                k, m = b2.shape                          # over B*T rows, not B then a sum
                gb = _mm(a2.reshape(-1, k).T, g.reshape(-1, m))
            else:
                gb = _mm(xp.swapaxes(a2, -1, -2), g)     # dL/db = a^T g
            gb = gb[..., 0] if b.ndim == 1 else gb
        return ga, gb


def matmul(a, b):
    return MatMul.apply(a, b)


# ---- shapes and dtypes ---------------------------------------------------------------------

class Reshape(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape), None


class Transpose(Function):
    """Permute all axes (`axes=None` reverses them); backward applies the inverse permutation."""

    @staticmethod
    def forward(ctx, a, axes=None):
        axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(ax % a.ndim
                                                                        for ax in axes)
        ctx.inverse = tuple(sorted(range(len(axes)), key=axes.__getitem__))
        return a.transpose(axes)

    @staticmethod
    def backward(ctx, grad):
        return grad.transpose(ctx.inverse), None


class Cast(Function):
    """Change dtype (float32 <-> float16 for mixed precision); the gradient is cast back."""

    @staticmethod
    def forward(ctx, a, dtype):
        ctx.dtype = a.dtype
        return a.astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        return grad.astype(ctx.dtype, copy=False), None


def cast(t, dtype):
    return Cast.apply(t, dtype)


from minidist.autograd.indexing import (  # noqa: E402,F401  (re-exported: ops.<Name>)
    GetItem, MaskedFill, Where, Concat, SplitJoin, SplitPart, Embedding, Dropout,
    getitem, masked_fill, where, concat, split, embedding, dropout)
