"""The autograd engine: `Tensor`, `Function`, primitive `ops` and `fused` ops.

    from minidist.autograd import Tensor, Function, no_grad, is_grad_enabled, ops, fused

Tests: tests/test_autograd.py, tests/test_autograd_ops.py, tests/test_gradcheck.py,
tests/test_fused.py.
"""
from minidist.autograd.tensor import Tensor, is_grad_enabled, no_grad
from minidist.autograd.function import Function
from minidist.autograd import ops
from minidist.autograd import fused

__all__ = ["Tensor", "Function", "no_grad", "is_grad_enabled", "ops", "fused"]
