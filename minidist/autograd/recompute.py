"""Activation checkpointing: keep a block's input, recompute the block inside backward.

    y = checkpoint(block, x, block.parameters(), rng=model.dropout_keys)

Without it, the graph keeps every intermediate of `block` alive from forward until backward
(GPT: ~20 (B, T, C)-sized arrays and the (B, nh, T, T) attention weights per block). With it:

    forward   runs block(x) under no_grad, so its intermediates are freed at once; the graph
              keeps one node holding x (already alive as the previous node's output) and y,
              and the dropout keys' step and rows (or a generator's state) before the block ran;
    backward  runs block(x) again, grad on, from x as a fresh leaf and with the keys (or the
              generator) rewound (the same dropout masks, then put back), backpropagates
              the incoming gradient through that short-lived graph, and returns x's gradient.

The recompute runs the same ops on the same arrays, so every number is bit-identical to a
run without checkpointing; the price is one more forward per block (~1/3 more compute).

Parameter gradients and hooks. The block's parameters are inputs of the checkpoint node, so
the engine counts this node among each parameter's pending contributions, as it would count
the ops inside. The inner backward adds their gradients straight into `.grad` (with its hooks
held back), and the checkpoint returns None for them; the outer engine then decrements their
pending counts and fires each hook once, when the gradient is complete: right after this
block's backward for a parameter used only here, later for one also used elsewhere (tied).
DDP's buckets and ZeRO's reduce-scatter rely on exactly that.

Several outputs. `fn` may return a tuple of Tensors (a Mixture-of-Experts block: its output
and its router loss, minidist/nn/gpt.py run_block); `checkpoint` then returns the tuple. The
node has one output, so they travel through it as one flat array (each flattened, joined by
concat) and are cut apart after it (split): the gradients of all of them meet in that one
array, and the recompute backpropagates through all of them at once. They must share a dtype.
Tests: tests/test_checkpointing.py.
"""
import contextlib
import math

from minidist.autograd import tensor as _tensor
from minidist.autograd.dropout_keys import DropoutKeys
from minidist.autograd.function import Function
from minidist.autograd.indexing import concat, split
from minidist.autograd.tensor import Tensor, no_grad


class _Block:
    """What the checkpoint node carries besides x: the function, its parameters, the rng;
    `shapes`: the shapes of fn's outputs when it returns several (None: one)."""

    def __init__(self, fn, params, rng):
        self.fn, self.params, self.rng = fn, params, rng
        self.shapes = None

    def run(self, x):
        """fn(x); several outputs flattened and joined into one 1-D Tensor."""
        out = self.fn(x)
        if isinstance(out, Tensor):
            return out
        self.shapes = [o.shape for o in out]
        return concat([o.reshape(-1) for o in out])                    # (sum of sizes,)


class Checkpoint(Function):
    """y = fn(x), keeping only x; fn is re-run inside backward."""

    @staticmethod
    def forward(ctx, x, block, *param_arrays):
        ctx.save_for_backward(x)
        ctx.block = block
        ctx.rng_state = _state(block.rng)
        with no_grad():
            return block.run(Tensor(x)).data

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved
        block = ctx.block
        leaf = Tensor(x, requires_grad=ctx.needs_input_grad[0])
        with _grad_enabled(), _rewound(block.rng, ctx.rng_state), _hooks_held(block.params):
            out = block.run(leaf)                    # the same forward, graph recorded
            if out.requires_grad:
                out.backward(grad)                   # parameter grads: += into .grad
        return (leaf.grad, None) + (None,) * len(block.params)


def checkpoint(fn, x, params, rng=None):
    """fn(x) for a Tensor x, recomputed in backward instead of stored (a tuple of Tensors
    if fn returns one: module docstring).

    params: every Parameter fn uses (e.g. `block.parameters()`); their gradients accumulate
    as without checkpointing. rng: what fn's dropout draws from, a DropoutKeys (GPT's:
    minidist/autograd/dropout_keys.py) or a numpy Generator, rewound for the recompute so it
    draws the same masks (None when fn draws nothing)."""
    params = [p for p in params if p.requires_grad][::-1]    # hooks fire last-used first,
    block = _Block(fn, params, rng)                           # as without checkpoints
    out = Checkpoint.apply(x, block, *params)
    if block.shapes is None:
        return out
    parts = split(out, [math.prod(s) for s in block.shapes])
    return tuple(p.reshape(s) for p, s in zip(parts, block.shapes))


@contextlib.contextmanager
def _grad_enabled():
    """Record the graph even if backward was called inside no_grad()."""
    _tensor._grad_enabled.append(True)
    try:
        yield
    finally:
        _tensor._grad_enabled.pop()


def _state(rng):
    """What decides rng's next masks: DropoutKeys' step and rows, a Generator's state."""
    if rng is None:
        return None
    return rng.snapshot() if isinstance(rng, DropoutKeys) else rng.bit_generator.state


def _set_state(rng, state):
    if isinstance(rng, DropoutKeys):
        rng.restore(state)
    else:
        rng.bit_generator.state = state


@contextlib.contextmanager
def _rewound(rng, state):
    """Run with `rng` set back to `state`, then put it back where it was."""
    if rng is None:
        yield
        return
    now = _state(rng)
    _set_state(rng, state)
    try:
        yield
    finally:
        _set_state(rng, now)


@contextlib.contextmanager
def _hooks_held(params):
    """The inner backward must not fire the parameters' hooks: the outer engine does, once."""
    held = [p._hooks for p in params]
    for p in params:
        p._hooks = []
    try:
        yield
    finally:
        for p, hooks in zip(params, held):
            p._hooks = hooks
