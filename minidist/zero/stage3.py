"""ZeRO stage 3 (FSDP's full sharding): stage 2 (minidist/zero/stage2.py) with the parameters
sharded too. Each rank keeps only param[lo:hi] of every unit.

Before a block runs, all_gather(buffer, shard) rebuilds its parameters, as views into a
full-size gather buffer; the blocks share two buffers, by index parity, so the next block's
gather (prefetch) runs while this one computes. Freeing is overwriting: gathering block i+2
into block i's buffer. But block i's graph saved views of its weights (Linear keeps W for
dL/dx = g W^T), so backward must see them again: an identity node at each block's output
(`BeforeBackward`), which backward reaches before any of the block's own ops, re-gathers the
block (and prefetches the one below). Its views then read the right numbers again: FSDP's
storage trick, done with numpy views. Values never change within a step, so ops that saved
*copies* of a weight (float16 LayerNorm's float32 weight) are right too, just memory.

The root is gathered once per step (used at both ends). A unit still in its buffer is not
gathered again (the last two blocks, at the turn from forward to backward). After the
optimizer step every gathered copy is stale: all are freed, and parameters point at NaN
placeholders until the next gather.

Where it happens: the engine is the model's block hooks (GPT.set_block_hooks); GPT's
run_blocks calls before_block(i) (gather, prefetch) and after_block(i, y) (BeforeBackward)
around block i, its embed and head call before_root(). No method is replaced. Gradients are
stage 2's: reduce-scattered unit by unit from backward's hooks.
"""
import functools

from minidist.autograd import is_grad_enabled
from minidist.autograd.function import Function
from minidist.backend import to_device, xp_of
from minidist.zero.stage2 import ZeroStage2
from minidist.zero.zero import ZeroUnit


class GatherBuffer:
    """A full-size buffer holding one unit's gathered parameters at a time."""

    def __init__(self, size):
        self.size, self.buffer, self.holder, self.work = size, None, None, None

    def __repr__(self):
        held = None if self.holder is None else self.holder.flat.name
        gathering = self.work is not None and not self.work.is_completed()
        return (f"GatherBuffer({self.size:,} elements, holding {held!r}"
                + (", its gather in flight)" if gathering else ")"))


class BeforeBackward(Function):
    """Identity forward; backward first calls `fn()`, then passes the gradient through. Placed
    at a block's output, backward reaches it before any of the block's own ops."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


class ZeroStage3(ZeroStage2):
    """+ parameters sharded: each unit gathered just in time into a shared gather buffer. It
    is the model's block hooks (before_root, before_block, after_block: GPT's forward calls
    them, minidist/nn/gpt.py)."""
    stage = 3

    def __init__(self, model, group, flats, prefetch=True, replicas=None, initial=None,
                 training=True):
        self.prefetch = prefetch
        # initial: None, the parameters hold their numbers; else a model built on
        # placeholders (GPT's materialize=False) and initial(names=...) -> {name: host
        # array}, gpt_init's numbers of those parameters, drawn here a unit at a time
        self.initial = initial
        super().__init__(model, group, flats, replicas, training=training)  # blocks, root
        self.initial = None                                  # (--init-from's weights: let go)
        size = max((u.flat.padded for u in self.blocks), default=0)
        self.buffers = [GatherBuffer(size) for _ in range(min(2, len(self.blocks)))]
        for i, u in enumerate(self.blocks):
            u.slot = self.buffers[i % 2]             # blocks 0, 2, 4.. | 1, 3, 5.. share one
        for u in self.root:
            u.slot = GatherBuffer(u.flat.padded)
            self.buffers.append(u.slot)
        model.set_block_hooks(self)

    def _shard_params(self, flat):
        master = None
        if self.initial is None:
            full = flat.flatten()
        else:                        # this unit's numbers now: no rank holds the whole model
            values = self.initial(names=set(flat.names))
            xp = xp_of(flat.params[0].data)
            drawn = flat.flatten([to_device(values[n], xp) for n in flat.names])
            if drawn.dtype != flat.dtype and self.training:   # --amp: 16-bit parameters,
                master = drawn[flat.lo:flat.hi].copy()        # float32 masters (to step)
            full = drawn.astype(flat.dtype, copy=False)
        self.group.broadcast(full, 0)                # every rank starts from rank 0's model
        flat.release_params()
        return ZeroUnit(flat, param_shard=full[flat.lo:flat.hi].copy(),   # drop the rest
                        master=master)

    def gather(self, u, wait=True):
        """u's full parameters into its gather buffer (unless already there); with `wait`
        False the all-gather runs in the background (prefetch) until a later gather(u)."""
        slot = u.slot
        if slot.holder is not u:
            self._wait(slot)                         # a gather still writing this buffer
            if slot.holder is not None:
                slot.holder.flat.release_params()    # its views would read u's numbers
            if slot.buffer is None:
                slot.buffer = xp_of(u.param_shard).empty(slot.size, u.flat.dtype)
                self._note_transient()
            full = slot.buffer[:u.flat.padded]
            slot.work = self.group.all_gather(full, u.param_shard, async_op=True)
            slot.holder = u
            u.flat.point_params_at(full)
        if wait:
            self._wait(slot)

    @staticmethod
    def _wait(slot):
        if slot.work is not None:
            slot.work.wait()
            slot.work = None

    def after_step(self):
        """Shards changed: every gathered copy is stale. Free them all."""
        self.stepped = False
        self.free()

    def free(self):
        for slot in self.buffers:
            self._wait(slot)
            if slot.holder is not None:
                slot.holder.flat.release_params()
            slot.holder = slot.buffer = None

    # ---- the block hooks: GPT's embed, head and run_blocks call these ----------------------
    def before_root(self):
        """Before embed and head: the root (wte, wpe, ln_f), gathered once per step."""
        for u in self.root:
            self.gather(u)

    def before_block(self, i):
        """Before block i: its parameters gathered; block i+1's gather started (prefetch)."""
        self.gather(self.blocks[i])
        if self.prefetch and i + 1 < len(self.blocks):
            self.gather(self.blocks[i + 1], wait=False)

    def after_block(self, i, y):
        """Block i's output y, behind an identity node whose backward re-gathers block i."""
        if is_grad_enabled() and y.requires_grad:
            y = BeforeBackward.apply(y, functools.partial(self._before_backward, i))
        return y

    def _before_backward(self, i):
        self.gather(self.blocks[i])
        if self.prefetch and i > 0:
            self.gather(self.blocks[i - 1], wait=False)

    def _transient_bytes(self):
        return super()._transient_bytes() + sum(
            s.buffer.nbytes for s in self.buffers if s.buffer is not None)

    def held(self):
        gathered = [s.buffer for s in self.buffers if s.buffer is not None]
        return {"params": [u.param_shard for u in self.units] + gathered,
                "grads": [u.grad_shard for u in self.units]}

    def _full_params(self, u):
        full = xp_of(u.param_shard).empty(u.flat.padded, u.flat.dtype)
        self.group.all_gather(full, u.param_shard)
        return full
