"""The memory ledger: bytes actually held by parameters, gradients, optimizer state and
activations, counted from the live arrays (not estimated from shapes).

Each array is counted by the buffer behind it (`a.base` chain), once: a view costs nothing
extra and a buffer shared by two names counts once. Activations are what the autograd graph
keeps alive between forward and backward: the arrays ops saved for their backward (ctx
attributes) and the output itself, minus parameter buffers (a graph's Nodes hold no op's
output: minidist/autograd/tensor.py).
`activation_bytes(loss)` walks the graph from the loss, so call it after forward, before
backward (which frees the graph as it goes).
The ZeRO paper's per-rank arithmetic (`zero_model_states`) sits beside the ledger, and
`zero_table` prints one against the other (the ZeRO strategy does, at the end of a run).
Tests: tests/test_memory.py, tests/test_zero.py (stages 1/2/3 measured at 4 ranks).
"""
import collections
import itertools

from minidist import backend
from minidist.autograd.tensor import Node


def _buffer(a):
    """The array that owns `a`'s memory (numpy memmaps stop at their file map)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def _is_array(a):
    return hasattr(a, "nbytes") and hasattr(a, "shape") and hasattr(a, "dtype")


def unique_nbytes(arrays, exclude=()):
    """Total bytes of the distinct buffers behind `arrays`, skipping buffers in `exclude`."""
    seen = {id(_buffer(a)) for a in exclude}
    total = 0
    for a in arrays:
        buf = _buffer(a)
        if id(buf) not in seen:
            seen.add(id(buf))
            total += int(buf.nbytes)
    return total


def _ctx_arrays(ctx):
    """Arrays an op saved: ctx attributes, inside tuples and lists at any depth (attention
    saves (qkv, y, (P, mask, scale)))."""
    stack = list(vars(ctx).values())
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list)):
            stack.extend(v)
            continue
        v = getattr(v, "data", v) if not _is_array(v) else v
        if _is_array(v):
            yield v


def graph_arrays(output):
    """Every array the graph behind the Tensor `output` holds: `output`'s own and the values
    its ops saved for backward."""
    if output.is_leaf:
        return
    yield output.data
    stack, seen = [output.grad_fn], {id(output.grad_fn)}
    while stack:
        node = stack.pop()
        if node.ctx is not None:
            yield from _ctx_arrays(node.ctx)
        for p in node.parents:
            if isinstance(p, Node) and id(p) not in seen:
                seen.add(id(p))
                stack.append(p)


def saved_arrays(contexts):
    """Every array in (ctx, grad) pairs: the values a deferred weight-gradient pass (W) keeps
    (minidist/autograd/tensor.py WeightGradQueue.contexts)."""
    out = []
    for ctx, grad in contexts:
        out += list(_ctx_arrays(ctx)) + [grad]
    return out


def activation_bytes(output, params=()):
    """Bytes the autograd graph behind `output` keeps alive, parameters excluded."""
    return unique_nbytes(graph_arrays(output), exclude=[p.data for p in params])


def ledger(params, optimizer=None, activations=0):
    """{"params", "grads", "optimizer", "activations", "total"} in bytes for this rank.

    An optimizer that holds the model's state itself (ZeRO's ShardedAdamW: flat shards,
    gather buffers) lists those arrays in `ledger_arrays()` -> {"params": [...], "grads":
    [...]}; they are counted with the parameters' own, each buffer once. On a GPU the row also
    has "pool_used", what CuPy's memory pool hands out to live arrays of any kind (not in
    "total", which sums the four kinds)."""
    params = list(params)
    held = optimizer.ledger_arrays() if hasattr(optimizer, "ledger_arrays") else {}
    row = {"params": unique_nbytes(_state(itertools.chain((p.data for p in params),
                                                          held.get("params", ())))),
           "grads": unique_nbytes(_state(itertools.chain(
               (p.grad for p in params if p.grad is not None), held.get("grads", ())))),
           "optimizer": unique_nbytes(optimizer.state_arrays()) if optimizer else 0,
           "activations": int(activations)}
    row["total"] = sum(row.values())
    if backend.device() == "cuda":
        row["pool_used"] = backend.memory_stats()["pool_used"]
    return row


def _state(arrays):
    """Arrays that hold model state: not views of a 0-d scalar (ZeRO-3's placeholder for a
    parameter that is not gathered is a read-only broadcast of one shared NaN)."""
    return (a for a in arrays if _buffer(a).ndim > 0)


# ---- the ZeRO paper's arithmetic, beside the ledger -------------------------------------------

def zero_model_states(n_params, dp=1, stage=0, amp=False, itemsize=4, grad_bytes=None):
    """Model-state bytes per rank in the ZeRO paper's accounting (Rajbhandari et al. 2020,
    section 3): P parameters in `itemsize` bytes hold itemsize P params + itemsize P grads +
    2 itemsize P Adam moments (4 + 4 + 8 in float32); with mixed precision (`amp`) 2P 16-bit
    params + 2P 16-bit grads + 12P float32 master, m, v (`grad_bytes` 4: --grad-dtype
    float32's 4P float32 grads). Stage 1 shards the optimizer state, stage 2 also the
    gradients, stage 3 also the parameters: ceil(P / dp) of each.
    Returns {"params", "grads", "optimizer", "total"}; minidist/train/planner.py agrees."""
    p, g, o = (2, 2, 12) if amp else (itemsize, itemsize, 2 * itemsize)
    g = grad_bytes or g
    shard = -(-n_params // dp)
    row = {"params": p * (shard if stage >= 3 else n_params),
           "grads": g * (shard if stage >= 2 else n_params),
           "optimizer": o * (shard if stage >= 1 else n_params)}
    row["total"] = sum(row.values())
    return row


# Under --ep, ZeRO's memory table (zero_table) is told of this rank's experts: how many
# parameters, how many ranks (edp) their optimizer state is split over (ZeRO-1 at any stage),
# and the optimizer whose state includes them.
ExpertStates = collections.namedtuple("ExpertStates", "params ranks optimizer")


def zero_table(rows, predicted, stage, n_params, experts=None, shard_ranks=None):
    """Predicted (zero_model_states) vs measured (ledger rows with a "rank"): one line per
    rank, MiB, and measured / predicted for the model states. `experts` (an ExpertStates):
    how many of the n_params are this rank's experts, said in the title. `shard_ranks`
    (hybrid sharding): the ranks each replica is sharded over, said in the title."""
    mib = 2.0 ** 20
    kinds = ("params", "grads", "optimizer")
    mine = (f" ({experts.params:,} of them this rank's experts: optimizer state split over "
            f"{experts.ranks}, gradients whole)" if experts else "")
    hybrid = f", each replica sharded over {shard_ranks}" if shard_ranks else ""
    lines = [f"memory per rank, ZeRO stage {stage}, {n_params:,} parameters{mine}, "
             f"{len(rows)} ranks{hybrid}: the ZeRO paper's model states vs the ledger's live "
             "arrays (MiB)",
             "           " + "".join(f"{k:>12}" for k in kinds + ("states",)) +
             f"{'activations':>13}{'transient':>11}",
             "predicted  " + "".join(f"{predicted[k] / mib:12.3f}" for k in kinds) +
             f"{predicted['total'] / mib:12.3f}"]
    for r in rows:
        states = sum(r[k] for k in kinds)
        lines.append(f"rank {r['rank']:<5} " + "".join(f"{r[k] / mib:12.3f}" for k in kinds) +
                     f"{states / mib:12.3f}{r['activations'] / mib:13.3f}"
                     f"{r.get('transient', 0) / mib:11.3f}")
    worst = max(abs(sum(r[k] for k in kinds) / predicted["total"] - 1) for r in rows)
    lines.append(f"measured model states within {100 * worst:.2f}% of predicted (padding to a "
                 "multiple of the ranks in each flat unit); transient = stage 2's gradient "
                 "buckets in flight + stage 3's gather buffers, at their peak")
    return "\n".join(lines)
