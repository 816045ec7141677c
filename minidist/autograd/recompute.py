"""Activation checkpointing: keep a block's input, recompute the block inside backward.

    y = checkpoint(block, x, block.parameters(), rng=model.dropout_keys, context=model.context)

Without it, the graph keeps alive every intermediate of `block` that an op saved for backward,
from forward until backward (GPT: ~16 (B, T, C)-sized arrays and the (B, nh, T, T) attention
weights per block). With it:

    forward   runs block(x) under no_grad, so its intermediates are freed at once; the graph
              keeps one node holding x (the block's input, the one (B, T, C) array a
              checkpointed block keeps) and the state the block ran in: the dropout
              keys' step, rows and cp positions (or a generator's state) and, under
              context parallelism, the ring's layouts;
    backward  runs block(x) again, grad on, from x as a fresh leaf and with that state
              restored (the same dropout masks, the same ring; then put back),
              backpropagates the incoming gradient through that short-lived graph, and
              returns x's gradient.

The recompute runs the same ops on the same arrays, so every number is bit-identical to a
run without checkpointing; the price is one more forward per block (~1/3 more compute).

The state it ran in. Backward runs after the forward that set it up has returned, so what
fn reads besides x and its parameters must be put back as it was: `rng` (the dropout keys,
which have moved on to later blocks' draws) and `context` (context parallelism's RingContext,
minidist/cp/context.py, whose layouts of the sequence exist only while GPT.forward runs;
without them the attention would see an inactive ring and attend locally). Each is an
object with snapshot() and restore(state), saved by the node and named at the one call
site (GPT.run_block), rather than the layouts threaded through every Block's forward: the
context already is the one place they live, and the keys are rewound the same way.
Under context parallelism the recompute sends messages: every cp rank re-runs the block's
ring forward (N - 1 hops) inside backward, then its ring backward. Every rank's engine
visits the blocks in the same order and each ring call waits for all its messages before it
returns, so on each link the messages of one tag come in the same order on both ends
(MPI does not overtake) and pair up: recompute forward i, backward i, recompute forward i-1...

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
Tests: tests/test_checkpointing.py; under context parallelism tests/test_cp_exact.py
(tests/scripts/cp_check.py, the "+ckpt" runs).
"""
import contextlib
import math

import numpy as np

from minidist.autograd.tensor import enable_grad, hooks_held
from minidist.autograd.function import Function
from minidist.autograd.indexing import concat, split
from minidist.autograd.tensor import Tensor, no_grad


class _Block:
    """What the checkpoint node carries besides x: the function, its parameters, what to
    rewind for the recompute (the rng, the context: those given); `shapes`: the shapes of
    fn's outputs when it returns several (None: one)."""

    def __init__(self, fn, params, rng, context):
        self.fn, self.params = fn, params
        self.rewind = [obj for obj in (rng, context) if obj is not None]
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
        ctx.states = [_state(obj) for obj in block.rewind]      # as the forward ran
        with no_grad():
            return block.run(Tensor(x)).data

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved
        block = ctx.block
        leaf = Tensor(x, requires_grad=ctx.needs_input_grad[0])
        with enable_grad(), _rewound(block.rewind, ctx.states), hooks_held(block.params):
            out = block.run(leaf)                    # the same forward, graph recorded
            if out.requires_grad:
                out.backward(grad)                   # parameter grads: += into .grad
        return (leaf.grad, None) + (None,) * len(block.params)


def checkpoint(fn, x, params, rng=None, context=None):
    """fn(x) for a Tensor x, recomputed in backward instead of stored (a tuple of Tensors
    if fn returns one: module docstring).

    params: every Parameter fn uses (e.g. `block.parameters()`); their gradients accumulate
    as without checkpointing. rng: what fn's dropout draws from, a DropoutKeys (GPT's:
    minidist/autograd/dropout_keys.py) or a numpy Generator, rewound for the recompute so it
    draws the same masks (None when fn draws nothing). context: other state fn reads, with
    snapshot() and restore(state) (context parallelism's RingContext: its layouts), set back
    for the recompute as the forward saw it (None: none)."""
    # Reversed: the block's gradient hooks fire after later blocks', its last parameter
    # first. Inside one block that is not always the order of a run without checkpoints (a
    # weight and its bias may swap); DDP's and ZeRO's buckets still launch alike on all ranks.
    params = [p for p in params if p.requires_grad][::-1]
    block = _Block(fn, params, rng, context)
    out = Checkpoint.apply(x, block, *params)
    if block.shapes is None:
        return out
    parts = split(out, [math.prod(s) for s in block.shapes])
    return tuple(p.reshape(s) for p, s in zip(parts, block.shapes))


def _state(obj):
    """What decides obj's part in fn: a Generator's state; else its snapshot() (DropoutKeys'
    step and rows, a RingContext's layouts)."""
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    return obj.snapshot()


def _set_state(obj, state):
    if isinstance(obj, np.random.Generator):
        obj.bit_generator.state = state
    else:
        obj.restore(state)


@contextlib.contextmanager
def _rewound(objs, states):
    """Run with each of `objs` set back to its state in `states`, then put back as it was."""
    now = [_state(obj) for obj in objs]
    for obj, state in zip(objs, states):
        _set_state(obj, state)
    try:
        yield
    finally:
        for obj, state in zip(objs, now):
            _set_state(obj, state)
