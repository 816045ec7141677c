"""Shared by the autograd tests (tests/test_autograd.py, tests/test_autograd_ops.py): arrays
and parameter-like leaves on --device, drawn from one generator."""
import numpy as np

from minidist import backend
from minidist.autograd import Tensor


rng = np.random.default_rng(0)


def A(a):
    """A host array moved to --device (numpy: no copy)."""
    return backend.get_xp().asarray(a)


def P(*shape, dtype=np.float64):
    """A parameter-like leaf on --device."""
    return Tensor(A(rng.standard_normal(shape).astype(dtype)), requires_grad=True)
