"""Collectives on n-d activations along one axis, for tensor and sequence parallelism.

The group's collectives act on flat, C-contiguous buffers (minidist/comm/group.py); an
activation (B, T, C) is split along T (sequence parallelism) or along its last axis (the
vocabulary-split logits). These move the axis to the front, run the flat collective and move
it back:

    all_reduce(x, group)                    x summed over the group (a new array)
    all_gather(x, group, axis)              every rank's x, concatenated along `axis`
    reduce_scatter(x, group, axis)          this rank's chunk along `axis` of x summed
    own_chunk(x, group, axis)               this rank's chunk along `axis`, no communication

`Gathering` and `ReduceScattering` are the same all-gather and reduce-scatter started with
`async_op=True`: the group's communication thread runs them while the caller computes, and
`wait()` returns the result. minidist/tp/gathered.py uses them to overlap the re-gather of a
sequence shard with a matmul in backward. Where the communication thread cannot run (MPI
without THREAD_MULTIPLE, or sync_comm for a debugger) the group runs the call at once and
wait() returns at once: the same numbers, in sequence.
Tests: tests/test_tensor_parallel.py (through tests/scripts/tp_check.py's gradchecks).
"""
from minidist.backend import xp_of

SEQ_AXIS = 1      # activations are (B, T, C): sequence parallelism splits T


def all_reduce(x, group):
    """x summed over the group, in a new array (never the caller's, which may be shared)."""
    out = x.copy()                                           # C-contiguous
    group.all_reduce(out)
    return out


class Gathering:
    """An all-gather of every rank's x along `axis`, in rank order; `async_op=True` starts it
    on the group's communication thread and returns at once. `wait()`: the gathered array."""

    def __init__(self, x, group, axis, async_op=False):
        xp = xp_of(x)
        self.axis, self.size = axis % x.ndim, group.size
        self.inp = xp.ascontiguousarray(x)                  # kept alive until wait()
        self.buf = xp.empty((group.size,) + x.shape, x.dtype)   # (tp, *x.shape): rank r's at [r]
        self.work = group.all_gather(self.buf, self.inp, async_op=async_op)

    def wait(self):
        if self.work is not None:
            self.work.wait()
        shape = list(self.inp.shape)
        shape[self.axis] *= self.size
        return xp_of(self.buf).moveaxis(self.buf, 0, self.axis).reshape(shape)  # (.., tp n, ..)


class ReduceScattering:
    """A reduce-scatter: this rank's chunk along `axis` of x summed over the group (the axis
    must divide by the group size); `async_op=True` as Gathering. `wait()`: the chunk."""

    def __init__(self, x, group, axis, async_op=False):
        xp, self.axis, t = xp_of(x), axis % x.ndim, group.size
        n = x.shape[self.axis]
        if n % t:
            raise ValueError(f"axis {self.axis} of length {n} does not split into {t} equal "
                             f"shards")
        blocks = x.reshape(x.shape[:self.axis] + (t, n // t) + x.shape[self.axis + 1:])
        self.inp = xp.ascontiguousarray(xp.moveaxis(blocks, self.axis, 0))  # (tp, .., n/tp, ..)
        self.out = xp.empty(self.inp.shape[1:], x.dtype)
        self.work = group.reduce_scatter(self.out, self.inp, async_op=async_op)

    def wait(self):
        if self.work is not None:
            self.work.wait()
        return self.out


def all_gather(x, group, axis):
    """Every rank's x concatenated along `axis`, in rank order."""
    return Gathering(x, group, axis).wait()


def reduce_scatter(x, group, axis):
    """This rank's chunk along `axis` of x summed over the group (the axis must divide)."""
    return ReduceScattering(x, group, axis).wait()


def own_chunk(x, group, axis):
    """This rank's chunk along `axis` of x, as a new contiguous array."""
    axis, t = axis % x.ndim, group.size
    n = x.shape[axis] // t
    index = (slice(None),) * axis + (slice(group.rank * n, (group.rank + 1) * n),)
    return xp_of(x).ascontiguousarray(x[index])
