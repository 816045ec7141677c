"""Primitive ops that pick, scatter or mask elements: indexing, concat/split, where,
masked fill, embedding lookup, dropout. Re-exported by `ops`, so use them as `ops.X`.

Their backwards are the scatter half of a gather: the gradient of `a[index]` is zero
everywhere except at the picked elements, where it adds up (an index picked twice gets
both contributions). Tests: tests/test_gradcheck.py, tests/test_autograd_ops.py.
"""
import numpy as np

from minidist import backend
from minidist.autograd.dropout_keys import uniforms
from minidist.autograd.function import Function
from minidist.autograd.ops import same_float   # ops imports this module after defining it
from minidist.autograd.tensor import Tensor, is_grad_enabled
from minidist.backend import xp_of


def add_dtype(dtype):
    """The dtype that repeated-index adds into an array of `dtype` run in (_add_at,
    scatter_add_rows): float32 for 16-bit floats, rounded to `dtype` once at the end; else
    `dtype` itself. bfloat16: cupyx.scatter_add takes none (CuPy 14 raises TypeError:
    cupy/_core/_routines_indexing.pyx, v14.0.1 to v14.2.0), and numpy's add.at would round
    after every add (1000 ones make 256). float16: cupyx takes it, but each atomicAdd on
    __half rounds, in an order that changes from run to run (float16 stops counting ones at
    2048), where numpy's scatter_add_rows adds in float32."""
    return np.dtype(np.float32) if backend.is_half(dtype) else np.dtype(dtype)


def _add_at(out, index, values):
    """out[index] += values, repeated indices adding up (numpy's add.at; cupyx on a GPU), in
    add_dtype(out.dtype): a 16-bit `out` through a float32 copy, rounded once."""
    wide = add_dtype(out.dtype)
    if wide != out.dtype:
        total = out.astype(wide)
        _add_at(total, index, xp_of(out).asarray(values).astype(wide))
        out[...] = total
    elif backend.is_cupy(out):
        import cupyx
        cupyx.scatter_add(out, index, values)
    else:
        xp_of(out).add.at(out, index, values)


# ---- indexing ------------------------------------------------------------------------------

def _is_basic(index):
    """True for ints, slices, None and ... only: such an index picks each element once."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or (isinstance(i, (int, slice))
                                              and not isinstance(i, bool)) for i in items)


def _unwrap(index):
    if isinstance(index, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return index.data if isinstance(index, Tensor) else index


class GetItem(Function):
    """a[index], numpy's basic and advanced indexing."""

    @staticmethod
    def forward(ctx, a, index):
        index = _unwrap(index)
        ctx.shape, ctx.dtype, ctx.index = a.shape, a.dtype, index
        return a[index]

    @staticmethod
    def backward(ctx, grad):
        g = xp_of(grad).zeros(ctx.shape, ctx.dtype)
        if _is_basic(ctx.index):
            g[ctx.index] = grad                        # each element picked at most once
        else:
            _add_at(g, ctx.index, grad)                # repeated indices add up
        return g, None


def getitem(t, index):
    return GetItem.apply(t, index)


# ---- masks ---------------------------------------------------------------------------------

def select(cond, a, b, dtype):
    """xp.where(cond, a, b) as `dtype` (None: as it comes), whatever dtype where promotes
    to. CuPy's where has no bfloat16 loop: it picks its '?ff->f' loop and returns float32
    for bfloat16 inputs (cupy/_sorting/search.py, v14.0.1 to v14.2.0), where numpy keeps
    bfloat16 (and promotes bfloat16 with a float32 array to float32)."""
    out = xp_of(a, b, cond).where(cond, a, b)
    return out if dtype is None else out.astype(dtype, copy=False)


def _float_dtype(a, b):
    """The float dtype of a or b (after same_float they share it), or None."""
    for v in (a, b):
        dtype = getattr(v, "dtype", None)
        if dtype is not None and backend.is_float(dtype):
            return dtype
    return None


class Where(Function):
    """cond ? a : b elementwise (cond a boolean array, broadcast with a and b); a float
    result keeps the inputs' float dtype on CuPy too (`select`)."""

    @staticmethod
    def forward(ctx, cond, a, b):
        a, b = same_float(a, b)
        cond = xp_of(a, b, cond).asarray(cond)           # a host mask to the device
        ctx.save_for_backward(cond)
        return select(cond, a, b, _float_dtype(a, b))

    @staticmethod
    def backward(ctx, grad):
        cond, = ctx.saved
        ga = select(cond, grad, 0, grad.dtype) if ctx.needs_input_grad[1] else None
        gb = select(cond, 0, grad, grad.dtype) if ctx.needs_input_grad[2] else None
        return None, ga, gb


def where(cond, a, b):
    return Where.apply(cond, a, b)


class MaskedFill(Function):
    """`value` where `mask` is true, `a` elsewhere (the causal mask's -inf); no gradient
    flows to the filled positions."""

    @staticmethod
    def forward(ctx, a, mask, value):
        mask = xp_of(a).asarray(mask)                    # a host mask to the device
        ctx.save_for_backward(mask)
        return select(mask, a.dtype.type(value), a, a.dtype)

    @staticmethod
    def backward(ctx, grad):
        mask, = ctx.saved
        return select(mask, 0, grad, grad.dtype), None, None


def masked_fill(t, mask, value):
    return MaskedFill.apply(t, mask, value)


# ---- concat and split ----------------------------------------------------------------------

class Concat(Function):
    """Join arrays along `axis`; backward hands each input its slice of the gradient."""

    @staticmethod
    def forward(ctx, *arrays, axis=0):
        xp = xp_of(*arrays)
        dtypes = {a.dtype for a in arrays}
        if len(dtypes) > 1:
            raise TypeError(f"mixed dtypes {sorted(map(str, dtypes))}; cast first")
        sizes = [a.shape[axis] for a in arrays]
        ctx.axis, ctx.cuts = axis, [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
        return xp.concatenate(arrays, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        return tuple(xp_of(grad).split(grad, ctx.cuts, axis=ctx.axis))   # views, no copies


def concat(tensors, axis=0):
    return Concat.apply(*tensors, axis=axis)


class _SplitState:
    """What the pieces of one split share: their slices, and the one gradient buffer they
    write into (instead of k full-size zero buffers, one per piece)."""

    def __init__(self, shape, dtype, slices):
        self.shape, self.dtype, self.slices = shape, dtype, slices
        self.buf, self.written = None, set()


class SplitJoin(Function):
    """Identity in forward. In backward its gradient is the buffer the pieces filled: it
    runs after all of them (they consume its output), zeroes the slices of pieces that got
    no gradient, and passes the buffer on."""

    @staticmethod
    def forward(ctx, a, state):
        ctx.state = state
        return a

    @staticmethod
    def backward(ctx, grad):
        st = ctx.state
        for i, sl in enumerate(st.slices):             # `grad` is st.buf, ours to write
            if i not in st.written:
                grad[sl] = 0
        return grad, None


class SplitPart(Function):
    """Piece i of a split (a view). The first piece to run backward allocates the shared
    buffer and hands it to SplitJoin; every piece writes its gradient into its own slice."""

    @staticmethod
    def forward(ctx, joined, state, i):
        ctx.state, ctx.i = state, i
        return joined[state.slices[i]]

    @staticmethod
    def backward(ctx, grad):
        st, first = ctx.state, ctx.state.buf is None
        if first:
            st.buf = xp_of(grad).empty(st.shape, st.dtype)
        st.buf[st.slices[ctx.i]] = grad
        st.written.add(ctx.i)
        return (st.buf if first else None), None, None


def split(t, sections_or_sizes, axis=0):
    """Cut `t` along `axis`: an int n gives n equal pieces, a list gives pieces of those
    sizes. Returns a list of Tensors whose backward fills one shared gradient buffer."""
    n = t.shape[axis]
    if isinstance(sections_or_sizes, int):
        k = sections_or_sizes
        if k <= 0 or n % k:
            raise ValueError(f"split: axis {axis} of shape {t.shape} does not divide into "
                             f"{k} equal sections")
        sizes = [n // k] * k
    else:
        sizes = list(sections_or_sizes)
        if sum(sizes) != n:
            raise ValueError(f"split: sizes {sizes} do not add up to {n}, axis {axis} of "
                             f"shape {t.shape}")
    lead = (slice(None),) * (axis % t.ndim)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    slices = [lead + (slice(s, s + m),) for s, m in zip(starts, sizes)]
    if not (is_grad_enabled() and isinstance(t, Tensor) and t.requires_grad):
        data = t.data if isinstance(t, Tensor) else t
        return [Tensor(data[sl]) for sl in slices]
    state = _SplitState(t.shape, t.dtype, slices)
    joined = SplitJoin.apply(t, state)
    return [SplitPart.apply(joined, state, i) for i in range(len(slices))]


# ---- embedding -----------------------------------------------------------------------------

def scatter_add_rows(out, idx, rows):
    """out[idx[i]] += rows[i] for every i, repeated indices adding up.

    numpy: sort the indices, sum each run of equal ones with one `add.reduceat` (16-bit rows
    in float32: reduceat keeps a bfloat16 total, 1000 ones making 256), write each
    distinct row once (about 6x faster than `np.add.at` at vocab 50257).
    cupy: atomic adds on the GPU (16-bit through float32: `_add_at`). Both add in
    add_dtype(out.dtype)."""
    xp = xp_of(out, rows)
    if backend.is_cupy(out):
        _add_at(out, idx, rows)
        return out
    order = xp.argsort(idx, kind="stable")
    sorted_idx = idx[order]
    starts = xp.flatnonzero(xp.concatenate(([True], sorted_idx[1:] != sorted_idx[:-1])))
    wide = add_dtype(rows.dtype)
    sums = xp.add.reduceat(rows[order], starts, axis=0, dtype=wide)
    out[sorted_idx[starts]] += sums.astype(out.dtype, copy=False)
    return out


class Embedding(Function):
    """weight[idx]: rows of a (V, C) table for integer ids of any shape -> (*idx.shape, C)."""

    @staticmethod
    def forward(ctx, weight, idx):
        if idx.dtype.kind not in "iu":
            raise TypeError(f"embedding ids must be integers, not {idx.dtype}")
        idx = xp_of(weight).asarray(idx)                 # host ids to the weight's device
        ctx.save_for_backward(idx)
        ctx.shape = weight.shape
        return xp_of(weight).take(weight, idx, axis=0)

    @staticmethod
    def backward(ctx, grad):
        idx, = ctx.saved
        return rows_into_table(ctx.shape, idx, grad), None


def rows_into_table(shape, idx, grad):
    """An embedding table's gradient: a zero (V, C) table `shape` with grad's row i added at
    row idx[i] (ids repeated add up), in grad's dtype. 16-bit rows add up in a float32 table
    (numpy's bfloat16 sums keep a bfloat16 total, cupyx.scatter_add has no bfloat16 and
    float16's atomics round at every add), rounded once: a 16-bit table handed to
    scatter_add_rows would be widened to float32 and copied back inside it (_add_at) anyway.
    Embedding's backward and tensor parallelism's vocabulary-split lookup (VocabShardLookup)."""
    return summed_rows(shape, idx, grad).astype(grad.dtype, copy=False)


def summed_rows(shape, idx, grad):
    """rows_into_table's table before its one rounding: a zero (V, C) table `shape` in
    add_dtype(grad.dtype) (float32 for 16-bit rows) with grad's row i added at row idx[i]."""
    acc = add_dtype(grad.dtype)
    gw = xp_of(grad).zeros(shape, acc)
    if idx.size:
        rows = grad.reshape(-1, shape[1]).astype(acc, copy=False)
        scatter_add_rows(gw, idx.reshape(-1), rows)
    return gw


def embedding(weight, idx):
    return Embedding.apply(weight, idx)


# ---- dropout -------------------------------------------------------------------------------

class Dropout(Function):
    """Zero each element with probability p, scale the survivors by 1/(1-p)."""

    @staticmethod
    def forward(ctx, x, p, rng):
        keep = uniforms(rng, x.shape, xp_of(x)) >= p   # on x's device (dropout_keys.py)
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p) if p < 1 else 0.0
        out = x * keep
        out *= ctx.scale
        return out

    @staticmethod
    def backward(ctx, grad):
        keep, = ctx.saved
        g = grad * keep
        g *= ctx.scale
        return g, None, None


def dropout(x, p, rng, training=True):
    """Inverted dropout. `rng` is a DropoutSite (GPT's layers': numbers keyed by place,
    computed on x's device, minidist/autograd/dropout_keys.py) or a `numpy.random.Generator`
    (e.g. `backend.rng(seed)`: the mask is `rng.random(x.shape, dtype="float32") >= p`, one
    draw per call, on the host then moved). Either gives the same mask on CPU and GPU.
    With `training=False` or `p == 0` it returns `x` itself and draws nothing."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], not {p}")
    if not training or p == 0.0:
        return x
    return Dropout.apply(x, p, rng)
