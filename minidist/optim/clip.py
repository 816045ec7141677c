"""Global gradient-norm clipping, for gradients on one rank or spread over many.

    norm = sqrt(sum over every gradient element of g^2)
    if norm > max_norm:  every g *= max_norm / (norm + 1e-6)

When gradients are sharded (ZeRO) or split (tensor/pipeline parallel), each rank holds a
part: it passes `sum_sq_across_ranks`, a callable that all-reduces (sums) its local sum of
squares, so every rank sees the same global norm and scales the same way. Gradients held
identically on several ranks must be counted once (pass only the ones this rank owns).
This module imports no comm: the caller brings the reduction.
Tests: tests/test_optim.py.
"""
import math

from minidist.backend import xp_of


def local_sum_sq(grads):
    """Sum of squares of these gradient arrays, as a Python float (accumulated in float64)."""
    total = 0.0
    for g in grads:
        flat = g.reshape(-1)
        total += float(xp_of(flat).dot(flat, flat))
    return total


def clip_grad_norm(grads, max_norm, sum_sq_across_ranks=None):
    """Scale `grads` (arrays, or Tensors whose .grad is used) in place so their global L2 norm
    is at most `max_norm` (None or <= 0: measure only). Returns the norm before clipping."""
    arrays = [getattr(g, "grad", g) for g in grads]
    arrays = [g for g in arrays if g is not None]
    sum_sq = local_sum_sq(arrays)
    if sum_sq_across_ranks is not None:
        sum_sq = float(sum_sq_across_ranks(sum_sq))
    norm = math.sqrt(sum_sq)
    if max_norm and max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in arrays:
            g *= scale
    return norm
