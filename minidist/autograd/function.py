"""`Function`: one differentiable op, its forward and backward side by side.

    class Mul(Function):
        @staticmethod
        def forward(ctx, a, b):          # arrays in, array out
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, grad):         # d(loss)/d(out) in, one gradient per input out
            a, b = ctx.saved
            return grad * b, grad * a

`Mul.apply(x, y)` does the plumbing once, for every op: unwraps Tensors to arrays, calls
forward, wraps the result, and records the op as the result's Node (tensor.py) if any input
needs a gradient.
Non-Tensor arguments (Python numbers, axes, index arrays) pass straight through and get
`None` as their gradient. Gradients whose shape differs from the input's because forward
broadcast are summed back here, in `Function._reduce_to`, the one place broadcasting is undone.
Tests: tests/test_autograd.py, tests/test_gradcheck.py.
"""
from minidist.autograd.tensor import Node, Tensor, is_grad_enabled
from minidist.backend import xp_of


def _describe(a):
    """"(4, 3) float32" for an array, the type name for anything else."""
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return f"{tuple(a.shape)} {a.dtype}"
    return type(a).__name__


def _named_error(cls, arrays, e, where=""):
    """The same kind of error, its message prefixed with the op (and `where`: ".backward")
    and its inputs' shapes (backward's: the output gradient's)."""
    msg = f"{cls.__name__}{where}({', '.join(_describe(a) for a in arrays)}): {e}"
    try:
        return type(e)(msg)
    except Exception:                     # an exception type with a different constructor
        return TypeError(msg) if isinstance(e, TypeError) else ValueError(msg)


def _graph_entry(a):
    """What the graph records for one argument: an op's output by its Node (not the Tensor,
    so the output's array is not kept alive), a leaf by itself (backward accumulates into its
    .grad and fires its hooks), None where no gradient is needed."""
    if not (isinstance(a, Tensor) and a.requires_grad):
        return None
    return a if a.is_leaf else a.grad_fn


class Context:
    """Scratch space an op's forward leaves for its backward."""

    def __init__(self):
        self.saved = ()
        self.needs_input_grad = ()   # per argument: does it want a gradient? (skip if not)

    def save_for_backward(self, *values):
        self.saved = values


class Function:
    # Under defer_weight_grads (tensor.py: zero-bubble pipelines' B and W), True makes B
    # compute this op's weight gradients too and queue only them (they must be cheap, like a
    # bias's column sum), instead of keeping its saved values and output gradient for W.
    weight_grads_in_b = False

    @staticmethod
    def forward(ctx, *args, **kwargs):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kwargs):
        ctx = Context()
        enabled = is_grad_enabled()
        ctx.needs_input_grad = tuple(enabled and isinstance(a, Tensor) and a.requires_grad
                                     for a in args)
        needs_grad = any(ctx.needs_input_grad)
        arrays = [a.data if isinstance(a, Tensor) else a for a in args]
        try:
            out = cls.forward(ctx, *arrays, **kwargs)
        except (ValueError, TypeError, IndexError) as e:
            raise _named_error(cls, arrays, e) from e
        if isinstance(out, Tensor):       # (was "float() argument must be ... not 'Tensor'")
            raise TypeError(f"{cls.__name__}.forward returned a Tensor: forward and backward "
                            "work on the arrays apply() hands them (x.data), and return "
                            "arrays; apply() makes the Tensor")
        if not isinstance(out, xp_of(out).ndarray):   # numpy reductions give scalars
            out = xp_of(out).asarray(out)
        result = Tensor(out, requires_grad=needs_grad)
        if needs_grad:
            parents = tuple(_graph_entry(a) for a in args)
            result.grad_fn = Node(cls, ctx, parents, out.shape, out.dtype)
        return result

    @classmethod
    def run_backward(cls, ctx, grad, parents):
        """Run backward and check its result: a tuple of one gradient per input (None: no
        contribution), each an array of floats shaped like its input; a bare None (a
        backward that forgot its `return` left a parameter untrained without a word:
        first-use walk 39) and an error inside backward name the op, as forward's do."""
        try:
            grads = cls.backward(ctx, grad)
        except (ValueError, TypeError, IndexError, AttributeError) as e:
            raise _named_error(cls, [grad], e, ".backward") from e
        if grads is None and parents:
            raise RuntimeError(f"{cls.__name__}.backward returned None: return its input's "
                               "gradient (several inputs: a tuple, None for one that needs "
                               "none)")
        if isinstance(grads, list):          # (walk 40: a list was taken as one gradient)
            grads = tuple(grads)
        if not isinstance(grads, tuple):
            grads = (grads,)
        if len(grads) != len(parents):
            raise RuntimeError(f"{cls.__name__}.backward returned {len(grads)} gradients "
                               f"for {len(parents)} inputs")
        out = []
        for i, (g, p) in enumerate(zip(grads, parents)):
            if p is None or g is None:     # (None: no contribution; SplitPart's pieces)
                out.append(None)
                continue
            cls._check_gradient(g, i)
            g = cls._reduce_to(g, p.shape)
            if g.dtype not in (p.dtype, p.grad_dtype):    # a leaf's float32 .grad (--grad-
                g = g.astype(p.grad_dtype)                # dtype float32) takes float32 as is
            out.append(g)
        return out

    @classmethod
    def _check_gradient(cls, g, i):
        """Input i's gradient is an array of floats: not a Tensor, a number or a mask."""
        if isinstance(g, Tensor):
            raise TypeError(f"{cls.__name__}.backward returned a Tensor for input {i}: "
                            "backward works on arrays and returns arrays")
        kind = getattr(getattr(g, "dtype", None), "kind", None)
        if kind is None or not hasattr(g, "shape"):
            raise TypeError(f"{cls.__name__}.backward returned {type(g).__name__} for input "
                            f"{i}: return an array shaped like the input")
        if kind in "biuc":
            raise TypeError(f"{cls.__name__}.backward returned a {g.dtype} gradient for input "
                            f"{i}: a gradient is floats (a mask times grad, not the mask)")

    @classmethod
    def _reduce_to(cls, grad, shape):
        """Undo broadcasting: sum `grad` over the axes forward stretched to reach its shape."""
        if grad.shape == tuple(shape):
            return grad
        extra = grad.ndim - len(shape)
        if extra < 0:
            raise RuntimeError(f"{cls.__name__}.backward: gradient of shape {grad.shape} "
                               f"for an input of shape {tuple(shape)}")
        axes = tuple(range(extra)) + tuple(
            extra + i for i, n in enumerate(shape) if n == 1 and grad.shape[extra + i] != 1)
        grad = grad.sum(axis=axes, keepdims=True) if axes else grad
        grad = grad.reshape(grad.shape[extra:]) if extra else grad
        if grad.shape != tuple(shape):
            raise RuntimeError(f"{cls.__name__}.backward: gradient of shape {grad.shape} "
                               f"does not reduce to the input's shape {tuple(shape)}")
        return grad


class _Join(Function):
    """Several outputs as one root, a 0-d zero that depends on all of them: backward hands
    each its given gradient (backward_all)."""

    @staticmethod
    def forward(ctx, *arrays, grads):
        ctx.grads = grads
        return xp_of(arrays[0]).zeros((), dtype=arrays[0].dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.grads


def backward_all(tensors, grads):
    """Backpropagate several outputs in one pass: every leaf's .grad gets the sum over i of
    d<tensors[i], grads[i]>/d(leaf) (grads[i] None: ones, e.g. for a scalar loss). One pass,
    not one per output, so each node's backward runs once with its gradients summed and each
    parameter's hooks fire once, when its gradient is complete (DDP, ZeRO rely on that).
    A pipeline stage uses it for its output's gradient and its MoE blocks' router losses
    (minidist/pp/microbatches.py). Tests: tests/test_autograd_ops.py."""
    grads = tuple(xp_of(t.data).ones_like(t.data) if g is None else g
                  for t, g in zip(tensors, grads))
    _Join.apply(*tensors, grads=grads).backward()


# ---- ops with several outputs ---------------------------------------------------------------

class Outputs:
    """What an op with n outputs shares with its n Pick nodes: the arrays its forward made
    (each handed out once, by its Pick) and, in backward, each output's gradient (None where
    that output got none)."""

    def __init__(self, n):
        self.arrays, self.grads = [None] * n, [None] * n


class Pick(Function):
    """Output i of an op with several outputs (the op's own Tensor is an empty placeholder,
    0 bytes; its Node carries the graph edges).
    Forward hands out the array; backward puts its gradient in outputs.grads[i] and gives
    the op an empty gradient: the op's backward then runs once, after every Pick's (they
    consume its placeholder), and reads all the gradients there."""

    @staticmethod
    def forward(ctx, op, outputs, i):
        ctx.outputs, ctx.i = outputs, i
        array, outputs.arrays[i] = outputs.arrays[i], None      # the Tensor's alone now
        return array

    @staticmethod
    def backward(ctx, grad):
        ctx.outputs.grads[ctx.i] = grad
        return xp_of(grad).empty((0,), grad.dtype), None, None


def apply_outputs(cls, n, *args):
    """The n outputs (Tensors) of `cls`, whose forward(ctx, *args, outputs) fills
    outputs.arrays and returns an empty placeholder, xp.empty((0,)); its backward reads
    outputs.grads.
    Used by fusions.residual_layer_norm (s and y). Tests: tests/test_fusions.py."""
    outputs = Outputs(n)
    op = cls.apply(*args, outputs)
    return tuple(Pick.apply(op, outputs, i) for i in range(n))
