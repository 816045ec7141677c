"""What another strategy needs of a tensor-parallel model, as functions of (model, group, ...):
the pipeline's stages and the TensorParallel strategy both call them.

    sum_sq_over_tp(model, group, local, replicated, amp)   the global sum of squared gradients
                        from this rank's: split parameters' squares summed over the tp group,
                        replicated ones (the same on every tp rank) counted once
    unscaled_sum_sq(grads, amp)       a local sum of squares as the optimizer measures it
                                      (float32, unscaled under float16 --amp)
    gather_optimizer_state(model, group, sd)   an optimizer state_dict with each split
                        parameter's arrays (exp_avg, ...) gathered over tp into whole ones
    shard_optimizer_state(model, group, sd)    the inverse: this rank's shards of them
    shard_params(model, group, params)         this rank's shards of whole parameters
    TpPiece(model, group)                      the same, array by array, as a checkpoint is
                                               read (checkpoint.load's `keep`)
A parameter is split when its `tp_split` (minidist/tp/layers.py) is set.
Tests: tests/test_tensor_parallel.py (tests/scripts/tp_check.py: clipping, --save), and
tests/test_pipeline.py (tests/scripts/pp_check.py: pp x tp).
"""
import numpy as np

from minidist.optim.clip import local_sum_sq
from minidist.strategy.base import all_reduce_number


def unscaled_sum_sq(grads, amp=None):
    """Sum of squares of `grads` (None skipped) as the optimizer's clip measures them: under
    float16 --amp unscaled in float32, as the master gradients will be."""
    grads = [g for g in grads if g is not None]
    return amp.unscaled_sum_sq(grads) if amp is not None else local_sum_sq(grads)


def sum_sq_over_tp(model, group, local, replicated, amp=None):
    """The sum of squares over the tp `group` from this rank's `local` one, in which the
    arrays `replicated` (equal on every tp rank) are counted: the rest summed over the
    group, those added once. Collective over `group`."""
    rep = unscaled_sum_sq(replicated, amp)
    split = all_reduce_number(group, local - rep, "sum", model.parameters()[0].data)
    return split + rep                 # on the device (no host sync), as the clip takes it


def _split_params(model):
    return [(n, p) for n, p in model.named_parameters() if p.tp_split is not None]


def gather_optimizer_state(model, group, sd):
    """Optimizer state_dict `sd` with every split parameter's arrays gathered over `group`
    into whole (host) arrays. Collective, in model order on every rank."""
    sd = {"groups": sd["groups"], "state": dict(sd["state"])}
    for name, p in _split_params(model):
        entry = dict(sd["state"].get(name, {}))
        for key in sorted(entry):
            v = entry[key]
            if hasattr(v, "shape") and tuple(v.shape) == tuple(p.shape):
                buf = np.empty((group.size,) + v.shape, v.dtype)
                group.all_gather(buf, np.ascontiguousarray(v))
                entry[key] = p.tp_split.unshard(list(buf))
        sd["state"][name] = entry
    return sd


def shard_optimizer_state(model, group, sd):
    """This rank's shards of a whole optimizer state_dict (arrays of split parameters cut as
    the parameters are; the rest as is)."""
    sd = {"groups": sd["groups"], "state": dict(sd["state"])}
    for name, p in _split_params(model):
        entry = dict(sd["state"].get(name, {}))
        for key, v in entry.items():
            if hasattr(v, "shape") and v.ndim == p.ndim and tuple(v.shape) != p.shape:
                entry[key] = p.tp_split.shard(v, group.size, group.rank)
        sd["state"][name] = entry
    return sd


def shard_params(model, group, params):
    """This rank's shards of whole parameter arrays by name (split ones cut as the
    parameters are; the rest as they are)."""
    split = dict(_split_params(model))
    return {n: split[n].tp_split.shard(np.asarray(a), group.size, group.rank) if n in split
            else a for n, a in params.items()}


class TpPiece:
    """keep(name, array) for checkpoint.load: this rank's tp shard of a whole array of a
    split parameter (the parameter, or an optimizer array shaped like it), cut as the
    parameter is, as each array is read; any other array as it is. What shard_params and
    shard_optimizer_state do to whole dicts, without holding them whole."""

    def __init__(self, model, group):
        self.split, self.group = dict(_split_params(model)), group

    def __call__(self, name, a):
        p = self.split.get(name)
        if p is None or a.ndim != p.ndim:
            return a
        return p.tp_split.shard(np.asarray(a), self.group.size, self.group.rank)
