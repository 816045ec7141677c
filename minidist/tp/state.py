"""What another strategy needs of a tensor-parallel model, as functions of (model, group, ...):
the pipeline's stages and the TensorParallel strategy both call them.

    sum_sq_over_tp(model, group, local, replicated, amp)   the global sum of squared gradients
                        from this rank's: split parameters' squares summed over the tp group,
                        replicated ones (the same on every tp rank) counted once
    partial_params(model, sequence_parallel)   the replicated parameters whose gradients
                        the strategy sums over tp once a step (sequence parallelism), told
                        to the model's region
    sum_partial_grads(grads, group)   those gradients summed over tp: one all-reduce of them
                        all, coalesced, after the gradient sync over dp
    unscaled_sum_sq(grads, amp)       a local sum of squares as the optimizer measures it
                                      (float32, unscaled under float16 --amp)
    gather_optimizer_state(model, group, sd)   an optimizer state_dict with each split
                        parameter's arrays (exp_avg, ...) gathered over tp into whole ones
    TpPiece(model, group)     the inverse, array by array as a checkpoint is read
                              (checkpoint.load's `keep`): this rank's shard of a split
                              parameter's whole array (the parameter, m, v, master)
A parameter is split when its `tp_split` (minidist/tp/layers.py) is set.
Tests: tests/test_tensor_parallel.py (tests/scripts/tp_check.py: clipping, --save), and
tests/test_pipeline.py (tests/scripts/pp_check.py: pp x tp).
"""
import numpy as np

from minidist.ddp.sync import byte_runs, through_flat
from minidist.optim.clip import local_sum_sq
from minidist.strategy.base import all_reduce_number


def partial_params(model, sequence_parallel):
    """Under sequence parallelism, the replicated parameters (layer norms, row-parallel
    biases, ln_f, wpe, an MoE router, and its experts, replicated over tp with or without
    --ep: GPT-2's 6 L + 3 dense ones, Llama's 2 L + 1) whose gradients `model`'s region
    leaves partial in backward (region.leave_partial, told here), for the strategy to sum
    over tp once a step (sum_partial_grads, on its inner's local_grads of them: under --ep
    the experts' are ExpertParallel's, their DDP's .grad over edp or the pieces of its
    ZeRO-1 shards, minidist/ep/optim.py); [] without it. Call it once the data-parallel
    strategy holds the model (after inner.wrap)."""
    if not sequence_parallel:
        return []
    params = [p for p in model.parameters() if p.tp_split is None]
    model.region.leave_partial(params)
    return params


# sum_partial_grads copies at most this much at a time: under --moe-experts without --ep the
# replicated gradients include every expert's, most of the model (one flat copy of them all
# and the ring's scratch took 1.5x their bytes on top of the step's peak)
SUM_PIECE_BYTES = 4 * 2 ** 20


def sum_partial_grads(grads, group, piece_bytes=SUM_PIECE_BYTES):
    """The replicated parameters' partial gradients summed over the tp `group`, in place:
    copied into one flat buffer per dtype (one: they share the gradient dtype, float32 under
    --amp --grad-dtype float32), all-reduced, copied back; where they hold more than
    `piece_bytes` (MoE's experts without --ep), in consecutive pieces of at most that, a
    tensor above it all-reduced alone where it lies, so the sum never holds a copy of them
    all (the layer norms, biases and wpe of GPT-2 124M: 3.2 MiB, one piece). Megatron-LM's
    _allreduce_layernorm_grads (finalize_model_grads): once a step, after backward and the
    data-parallel sync, not one blocking all-reduce per parameter and micro-batch inside
    backward. The tp sum and the dp mean are both linear, so they commute; `grads` are the
    arrays the optimizer reads (inner's local_grads after its sync: .grad, or under ZeRO the
    pieces of this rank's flat shards, cut alike on every tp rank), so the sum runs before
    anything reads them (the clip's norm, --amp's overflow verdict, the step). Collective
    over `group`, in the same order on every rank."""
    by_dtype = {}
    for g in grads:
        if g.size:
            by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        for piece in _pieces(same, piece_bytes):     # one piece's copy held at a time
            through_flat(piece, lambda buf: group.all_reduce(buf, op="sum"))

def _pieces(grads, piece_bytes):
    """`grads` in order, cut into consecutive runs of at most `piece_bytes` (a larger tensor
    a run of its own): the same cut on every tp rank, whose gradients have the same shapes."""
    return [[grads[i] for i in run] for run in piece_cuts([g.nbytes for g in grads],
                                                          piece_bytes)]


def piece_cuts(sizes, piece_bytes=SUM_PIECE_BYTES):
    """sum_partial_grads' cut on bytes alone: indices into `sizes` (bytes per gradient, in
    order), consecutive runs of at most piece_bytes, a larger one a run of its own (DDP's
    bucket rule, minidist/ddp/sync.py byte_runs). The step-time model counts the sum's
    all-reduces with it (minidist/train/call_cost.py)."""
    return byte_runs(sizes, piece_bytes)


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
    with np.errstate(invalid="ignore"):     # --amp: inf - inf is nan, an overflow (skipped)
        split = local - rep
    split = all_reduce_number(group, split, "sum", model.parameters()[0].data)
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


class TpPiece:
    """keep(name, array) for checkpoint.load: this rank's tp shard of a whole array of a
    split parameter (the parameter, or an optimizer array shaped like it), cut as the
    parameter is, as each array is read; any other array as it is. So no rank holds every
    whole array at once (TensorParallel's and the pipeline's loads). An array not of the
    whole parameter's shape is left as it is, for check_fits to name what differs (a
    checkpoint of another --n-embd, say)."""

    def __init__(self, model, group):
        self.group = group
        self.whole = {n: (p, _whole_shape(p)) for n, p in _split_params(model)}

    def __call__(self, name, a):
        p, shape = self.whole.get(name, (None, None))
        if p is None or tuple(a.shape) != shape:
            return a
        return p.tp_split.shard(np.asarray(a), self.group.size, self.group.rank)


def _whole_shape(p):
    """The shape of split parameter p's whole array: its size along the split axis."""
    shape = list(p.shape)
    shape[p.tp_split.axis] = p.tp_split.size
    return tuple(shape)
