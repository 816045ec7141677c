"""Global gradient-norm clipping, for gradients on one rank or spread over many.

    norm = sqrt(sum over every gradient element of g^2)
    if norm > max_norm:  every g *= max_norm / (norm + 1e-6)

When gradients are sharded (ZeRO) or split (tensor/pipeline parallel), each rank holds a
part: it passes `sum_sq_across_ranks`, a callable that all-reduces (sums) its local sum of
squares, so every rank sees the same global norm and scales the same way. Gradients held
identically on several ranks must be counted once (pass only the ones this rank owns).
This module imports no comm: the caller brings the reduction.

No device-to-host synchronisation: the sums, the norm and the clip factor stay arrays on the
gradients' device (numpy: numpy scalars; CuPy: 0-d arrays), and the factor is applied by an
array multiply whether or not it clips (1.0 when the norm is within max_norm), so no Python
`if` ever needs the norm's value. The loop converts the norm to a float only to log it.
Tests: tests/test_optim.py, tests/test_no_sync.py.
"""
from minidist.backend import xp_of
from minidist.optim import multi_tensor


def local_sum_sq(grads):
    """Sum of squares of these gradient arrays, accumulated in float64, as a 0-d float64
    array on their device (a numpy float64 on the CPU); 0.0 when there are none. On cupy
    with MINIDIST_CUDA_NEW_KERNELS=1: two launches in all (multi_tensor.sum_sq, accumulated
    in float32 for float32 gradients), not three per gradient; clip_grad_norm's multiply is
    then one launch (multi_tensor.scale), not two per gradient."""
    grads = list(grads)
    if _multi_ok(grads):
        return multi_tensor.sum_sq(grads, 1.0)
    total = 0.0
    for g in grads:
        flat = g.reshape(-1)
        total = total + xp_of(flat).dot(flat, flat).astype("float64")
    return total


def _multi_ok(grads):
    """The multi-tensor kernels take these gradients: float32 or float64 cupy arrays of one
    dtype with MINIDIST_CUDA_NEW_KERNELS=1 (multi_tensor.use_multi)."""
    return multi_tensor.use_multi(grads) and grads[0].dtype.name in ("float32", "float64")


def clip_factor(norm, max_norm):
    """max_norm / (norm + 1e-6) when a norm (a float) is above max_norm (None or <= 0: no
    clipping), else 1.0. clip_grad_norm below computes the same on the device."""
    return max_norm / (norm + 1e-6) if max_norm and 0 < max_norm < norm else 1.0


def clip_grad_norm(grads, max_norm, sum_sq_across_ranks=None):
    """Scale `grads` (arrays, or Tensors whose .grad is used) in place so their global L2 norm
    is at most `max_norm` (None or <= 0: measure only). Returns the norm before clipping, a
    0-d float64 array on the gradients' device."""
    arrays = [getattr(g, "grad", g) for g in grads]
    arrays = [g for g in arrays if g is not None]
    sum_sq = local_sum_sq(arrays)
    if sum_sq_across_ranks is not None:
        sum_sq = sum_sq_across_ranks(sum_sq)
    if not arrays:
        return sum_sq ** 0.5
    xp = xp_of(arrays[0])
    norm = xp.sqrt(xp.asarray(sum_sq, dtype="float64"))
    if max_norm and max_norm > 0:
        # max_norm / (norm + 1e-6) where norm > max_norm, else 1 (nan: 1): an array, no `if`
        scale = xp.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)
        if _multi_ok(arrays):                 # cupy, MINIDIST_CUDA_NEW_KERNELS=1: one launch
            multi_tensor.scale(arrays, scale)
        else:
            for g in arrays:
                g *= scale.astype(g.dtype)
    return norm
