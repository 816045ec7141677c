"""The memory ledger: bytes actually held by parameters, gradients, optimizer state and
activations, counted from the live arrays (not estimated from shapes).

Each array is counted by the buffer behind it (`a.base` chain), once: a view costs nothing
extra and a buffer shared by two names counts once. Activations are what the autograd graph
keeps alive between forward and backward: the outputs of every op still referenced by the
graph and the arrays ops saved for their backward (ctx attributes), minus parameter buffers.
`activation_bytes(loss)` walks the graph from the loss, so call it after forward, before
backward (which frees the graph as it goes).
Tests: tests/test_memory.py.
"""


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
    """Every array the graph behind the Tensor `output` holds: op outputs and saved values."""
    stack, seen = [output], {id(output)}
    while stack:
        node = stack.pop()
        if node.is_leaf:
            continue
        yield node.data
        if node._ctx is not None:
            yield from _ctx_arrays(node._ctx)
        for p in node._parents:
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                stack.append(p)


def activation_bytes(output, params=()):
    """Bytes the autograd graph behind `output` keeps alive, parameters excluded."""
    return unique_nbytes(graph_arrays(output), exclude=[p.data for p in params])


def ledger(params, optimizer=None, activations=0):
    """{"params", "grads", "optimizer", "activations", "total"} in bytes for this rank."""
    params = list(params)
    row = {"params": unique_nbytes(p.data for p in params),
           "grads": unique_nbytes(p.grad for p in params if p.grad is not None),
           "optimizer": unique_nbytes(optimizer.state_arrays()) if optimizer else 0,
           "activations": int(activations)}
    row["total"] = sum(row.values())
    return row
