"""`Tensor`: one numpy/cupy array (`.data`), its gradient (`.grad`), and the graph behind it.

A Tensor made by an op points at that op's `Node` (`grad_fn`): the op, what it saved for its
backward (`ctx`) and its inputs (`parents`: their Nodes, or the leaf Tensors themselves). A
Node does not hold its op's output: the graph keeps alive only what ops saved, so an output no
op saved is freed as soon as the code that made it lets go of it. `loss.backward()` walks the
Nodes once, in reverse topological order, and:
  - hands each op the gradient of its output, which is complete by the time we reach it;
  - accumulates leaf gradients with `+=` into `.grad`, of the leaf's `grad_dtype` (gradient
    accumulation across backward calls; a tensor used twice gets both contributions);
  - fires a leaf's hooks (`register_grad_hook`) as soon as its last contribution for this
    backward has arrived: DDP starts a bucket's all-reduce there, ZeRO-2 its reduce-scatter;
  - frees each op's saved arrays as soon as its backward has run.
The walk is a loop, not recursion, so a deep graph cannot hit Python's recursion limit.
Tests: tests/test_autograd.py.
"""
import contextlib

from minidist import backend

_grad_enabled = [True]


def is_grad_enabled():
    return _grad_enabled[-1]


def no_grad():
    """Ops inside build no graph: for evaluation, sampling and optimizer updates."""
    return _grad_mode(False)


def enable_grad():
    """Ops inside build a graph, even inside no_grad() (recompute.py: a backward's rerun)."""
    return _grad_mode(True)


@contextlib.contextmanager
def _grad_mode(on):
    _grad_enabled.append(on)
    try:
        yield
    finally:
        _grad_enabled.pop()


@contextlib.contextmanager
def hooks_held(params):
    """Inside, no gradient hook of `params` fires (recompute.py's inner backward)."""
    held = [p._hooks for p in params]
    for p in params:
        p._hooks = []
    try:
        yield
    finally:
        for p, hooks in zip(params, held):
            p._hooks = hooks


class Node:
    """One op's record in the autograd graph, made by `Function.apply` for the Tensor it
    returns (that Tensor's `grad_fn`): the op (`fn`, a Function class), what its forward saved
    for its backward (`ctx`), and its inputs (`parents`: per argument the input's Node, the
    input itself if it is a leaf, or None where no gradient is needed), with the shape and
    dtype of its output, which backward checks gradients against. It does not hold the
    output's array: only what an op saved outlives the forward code that made it, as with
    PyTorch's grad_fn nodes. backward() empties `ctx` and `parents` as it passes."""

    def __init__(self, fn, ctx, parents, shape, dtype):
        self.fn, self.ctx, self.parents = fn, ctx, parents
        self.shape, self.dtype = shape, dtype

    grad_dtype = property(lambda self: self.dtype)      # an output's gradient: its dtype

    def __repr__(self):
        return f"Node({self.fn.__name__}, shape={self.shape}, dtype={self.dtype})"


class Tensor:

    def __init__(self, data, requires_grad=False, dtype=None):
        if isinstance(data, Tensor):
            data = data.data
        xp = backend.xp_of(data) if hasattr(data, "__array__") else backend.get_xp()
        if dtype is not None or not isinstance(data, xp.ndarray):   # lists, numbers, np.float64
            data = xp.asarray(data, dtype=dtype or _default_dtype(data))
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self.grad_fn = None     # the Node of the op that made this tensor (None for a leaf)
        self._hooks = []
        self._grad_dtype = None     # .grad's dtype where it is not the data's (grad_dtype)

    # ---- plain properties -----------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    is_leaf = property(lambda self: self.grad_fn is None)

    @property
    def grad_dtype(self):
        """The dtype `.grad` accumulates in: the data's, unless set (--amp --grad-dtype
        float32 sets float32 on every 16-bit parameter, train/amp.py cast_model: Megatron-LM's
        main_grad; the strategies' gradient buffers are made in this dtype)."""
        return self.data.dtype if self._grad_dtype is None else self._grad_dtype

    @grad_dtype.setter
    def grad_dtype(self, dtype):
        self._grad_dtype = dtype

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        op = f", fn={self.grad_fn.fn.__name__}" if self.grad_fn else ""
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}{grad}{op})"

    def item(self):
        return self.data.item()

    def numpy(self):                    # the data as a numpy array (from the GPU if there)
        return backend.to_host(self.data)

    def detach(self):
        """The same array, cut off from the graph."""
        return Tensor(self.data)

    def register_grad_hook(self, fn):
        """Call `fn(self)` once `self.grad` holds this backward's full contribution (leaves only).
        Returns a handle whose `remove()` unregisters it."""
        if not self.is_leaf:
            raise RuntimeError("register_grad_hook is for leaf tensors (parameters)")
        self._hooks.append(fn)
        return _HookHandle(self._hooks, fn)

    # ---- backward -------------------------------------------------------------------------
    def backward(self, grad=None):
        """Accumulate d(self)/d(leaf) into every leaf's `.grad` that requires one."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad "
                               "(no input of the ops that made it requires a gradient)")
        if grad is None:
            if self.size != 1:
                raise RuntimeError(f"backward() on a non-scalar tensor of shape {self.shape} "
                                   "needs an explicit gradient of the same shape")
            grad = backend.xp_of(self.data).ones_like(self.data)
        grad = grad.data if isinstance(grad, Tensor) else grad
        if grad.shape != self.shape:
            raise ValueError(f"backward(): gradient of shape {grad.shape} "
                             f"for a tensor of shape {self.shape}")
        grad = grad.astype(self.dtype, copy=False)       # a float64 seed must not promote
        if self.is_leaf:
            _accumulate(self, grad)
            _fire_hooks(self)
            return
        order, pending = _topological_order(self.grad_fn)
        deferred = _deferring[-1]                         # defer_weight_grads(), or None
        if deferred is not None:
            deferred.note_views(order)
        grads = {id(self.grad_fn): grad}
        for node in reversed(order):                      # outputs before their inputs
            if deferred is not None and deferred.holds(node):
                deferred.defer_view(node)                 # made from weights: W runs it
                continue
            g = grads.pop(id(node), None)                 # complete: all consumers ran
            if node.ctx is None:
                raise RuntimeError("backward through a graph that was already freed "
                                   "(a second backward over the same ops)")
            if deferred is not None and g is not None:    # B now, the weights' part later
                in_grads = deferred.input_grads(node, g)
            else:
                in_grads = (node.fn.run_backward(node.ctx, g, node.parents) if g is not None
                            else [None] * len(node.parents))
            node.ctx = None                               # free saved arrays as we go
            for p, pg in zip(node.parents, in_grads):
                if p is None or (deferred is not None and deferred.holds(p)):
                    continue                              # a deferred weight: W counts it
                if isinstance(p, Tensor):                 # a leaf
                    if pg is not None:
                        _accumulate(p, pg)
                    pending[id(p)] -= 1
                    if pending[id(p)] == 0:
                        _fire_hooks(p)
                elif pg is not None:
                    prev = grads.get(id(p))
                    grads[id(p)] = pg if prev is None else prev + pg
            node.parents = ()

    # ---- operators: each one op, called in plain sight -------------------------------------
    def __add__(self, other): return ops.Add.apply(self, other)
    def __radd__(self, other): return ops.Add.apply(other, self)
    def __sub__(self, other): return ops.Sub.apply(self, other)
    def __rsub__(self, other): return ops.Sub.apply(other, self)
    def __mul__(self, other): return ops.Mul.apply(self, other)
    def __rmul__(self, other): return ops.Mul.apply(other, self)
    def __truediv__(self, other): return ops.Div.apply(self, other)
    def __rtruediv__(self, other): return ops.Div.apply(other, self)
    def __neg__(self): return ops.Neg.apply(self)
    def __pow__(self, exponent): return ops.Pow.apply(self, exponent)
    def __matmul__(self, other): return ops.MatMul.apply(self, other)
    def __getitem__(self, index): return ops.GetItem.apply(self, index)

    def sum(self, axis=None, keepdims=False): return ops.Sum.apply(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return ops.Mean.apply(self, axis, keepdims)
    def max(self, axis=None, keepdims=False): return ops.Max.apply(self, axis, keepdims)
    def exp(self): return ops.Exp.apply(self)
    def log(self): return ops.Log.apply(self)
    def sqrt(self): return ops.Sqrt.apply(self)
    def tanh(self): return ops.Tanh.apply(self)
    def relu(self): return ops.Relu.apply(self)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return ops.Reshape.apply(self, tuple(shape))

    def transpose(self, *axes):
        """Permute axes (all of them, like numpy); no axes reverses them."""
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return ops.Transpose.apply(self, tuple(axes) or None)

    permute = transpose
    T = property(lambda self: self.transpose())

    def masked_fill(self, mask, value): return ops.MaskedFill.apply(self, mask, value)
    def astype(self, dtype): return ops.Cast.apply(self, dtype)


def _default_dtype(data):
    """Python floats become float32 (minidist's default); ints and bools keep their kind,
    and anything that already has a dtype (a numpy scalar) keeps it."""
    if hasattr(data, "dtype"):
        return None
    import numpy as np
    return "float32" if np.asarray(data).dtype.kind == "f" else None


# ---- the backward split in two: input gradients (B) now, weight gradients (W) later -------

_deferring = [None]


@contextlib.contextmanager
def defer_weight_grads(weights):
    """Inside, `backward()` computes every gradient except those of `weights` (the B pass of
    zero-bubble pipelines: what the previous stage waits for) and records, per op that has a
    weight among its inputs, what computing the weights' part needs (the op, its saved values,
    its output's gradient) on the WeightGradQueue it yields; `queue.run()` later does them
    (the W pass), in the order recorded, accumulating and firing hooks as backward would:

        with defer_weight_grads(model.parameters()) as w:
            loss.backward()        # B: inputs' gradients only
        w.run()                    # W: the weights' .grad, the same numbers as one backward
    Tests: tests/test_autograd_ops.py (identical to a plain backward, and gradcheck)."""
    queue = WeightGradQueue(weights)
    _deferring.append(queue)
    try:
        yield queue
    finally:
        _deferring.pop()


class WeightGradQueue:
    """Deferred weight-gradient work in the order B met it: per op (op, ctx, its output's
    gradient, its inputs, what they needed, and for a view its id). A view is an op applied
    to weights alone (the tied head's wte.T, an embedding lookup): it counts as a weight, so
    the matmul using wte.T defers that gradient too, and the view's own backward waits for W,
    where the gradient reaching it is complete (its consumers come earlier in the queue)."""

    def __init__(self, weights):
        self.weight_ids = {id(w) for w in weights}
        self.work = []

    def holds(self, entry):
        """A weight (a leaf Tensor), or the Node of a view made from weights alone."""
        return id(entry) in self.weight_ids

    def note_views(self, order):
        """Ops applied to weights directly, and to nothing else, are views."""
        leaves = set(self.weight_ids)
        for node in order:
            parents = [p for p in node.parents if p is not None]
            if parents and all(id(p) in leaves for p in parents):
                self.weight_ids.add(id(node))

    def defer_view(self, node):
        self.work.append((node.fn, node.ctx, None, node.parents,
                          tuple(node.ctx.needs_input_grad), id(node)))

    def input_grads(self, node, grad):
        """B for one op: the gradients of its non-weight inputs (the op skips the weights' via
        ctx.needs_input_grad); the weights' part is queued with the op's saved values. An op
        whose weight gradients cost next to nothing once its input's is known (a bias's
        column sum: `Function.weight_grads_in_b`) computes them now; only they are queued,
        not its saved values and output gradient, which B then frees as a plain backward."""
        ctx, parents = node.ctx, node.parents
        weights = [p is not None and self.holds(p) for p in parents]
        if not any(weights):
            return node.fn.run_backward(ctx, grad, parents)
        if node.fn.weight_grads_in_b:
            grads = node.fn.run_backward(ctx, grad, parents)
            kept = tuple(p if w else None for p, w in zip(parents, weights))
            self.work.append((node.fn, None, grads, kept, tuple(ctx.needs_input_grad), None))
            return [None if w else g for g, w in zip(grads, weights)]
        needs = ctx.needs_input_grad
        self.work.append((node.fn, ctx, grad, parents, tuple(needs), None))
        ctx.needs_input_grad = tuple(n and not w for n, w in zip(needs, weights))
        if not any(ctx.needs_input_grad):
            return [None] * len(parents)
        return node.fn.run_backward(ctx, grad, parents)

    def contexts(self):
        """The saved values the queued work keeps alive (the memory ledger counts them)."""
        return [(ctx, grad) for _, ctx, grad, *_ in self.work
                if grad is not None and ctx is not None]

    def run(self):
        """W: every queued op's weight gradients, in the order B met them (so summed in a
        plain backward's order); a weight's hooks fire after its last contribution."""
        pending, view_grads = {}, {}
        for *_, parents, _, _ in self.work:
            for p in parents:
                if isinstance(p, Tensor) and self.holds(p):
                    pending[id(p)] = pending.get(id(p), 0) + 1
        for fn, ctx, grad, parents, needs, view in self.work:
            grad = view_grads.pop(view, None) if view is not None else grad
            weights = [p is not None and self.holds(p) for p in parents]
            if ctx is None:                               # computed in B: `grad` holds them
                in_grads = grad
            else:
                ctx.needs_input_grad = tuple(n and w for n, w in zip(needs, weights))
                in_grads = ([None] * len(parents) if grad is None
                            else fn.run_backward(ctx, grad, parents))
            for p, pg, w in zip(parents, in_grads, weights):
                if not w:
                    continue
                if not isinstance(p, Tensor):              # a view: summed, run later
                    if pg is not None:
                        prev = view_grads.get(id(p))
                        view_grads[id(p)] = pg if prev is None else prev + pg
                    continue
                if pg is not None:
                    _accumulate(p, pg)
                pending[id(p)] -= 1
                if pending[id(p)] == 0:
                    _fire_hooks(p)
        self.work = []


def _accumulate(leaf, grad):
    """`grad` into leaf.grad, which is made in leaf.grad_dtype: under --amp --grad-dtype
    float32 each 16-bit gradient is added into a float32 .grad."""
    if leaf.grad is None:
        # a C-contiguous copy (never alias an op's array; collectives take flat buffers)
        leaf.grad = grad.astype(leaf.grad_dtype, order="C")
    elif grad.dtype != leaf.grad.dtype:    # cast first: no mixed-dtype kernel (CuPy's
        leaf.grad += grad.astype(leaf.grad.dtype)      # bfloat16 + float32) is asked for
    else:
        leaf.grad += grad


def _fire_hooks(leaf):
    for hook in list(leaf._hooks):
        hook(leaf)


def _topological_order(root):
    """The Nodes reachable from the Node `root`, each after all of its inputs (iterative DFS),
    and for each leaf the number of graph edges into it (its pending contributions)."""
    order, visited, pending = [], {id(root)}, {}
    stack = [(root, iter(root.parents))]
    while stack:
        node, parents = stack[-1]
        for p in parents:
            if p is None:
                continue
            if isinstance(p, Tensor):  # a leaf
                pending[id(p)] = pending.get(id(p), 0) + 1
            elif id(p) not in visited:
                visited.add(id(p))
                stack.append((p, iter(p.parents)))
                break
        else:                          # every input of `node` is placed: place node
            stack.pop()
            order.append(node)
    return order, pending


class _HookHandle:
    def __init__(self, hooks, fn):
        self._hooks, self._fn = hooks, fn

    def remove(self):
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


from minidist.autograd import ops  # noqa: E402  (ops imports Tensor: import it after the class)
