"""Central-difference gradient checking: is an op's backward the derivative of its forward?

For a scalar `L = sum(f(inputs) * R)` with a fixed random R (so every output element
counts, each with its own weight), compare the gradient backward computes with
    dL/dx[i] ~ (L(x + eps e_i) - L(x - eps e_i)) / (2 eps)
element by element, in float64 (error O(eps^2) ~ 1e-12, far below any real bug).
A failure names the op, the input and the worst index. Tests: tests/test_gradcheck.py.
"""
import numpy as np

from minidist.autograd.tensor import Tensor, no_grad


def _as_float64_tensors(inputs):
    out = []
    for x in inputs:
        if isinstance(x, Tensor) and x.dtype.kind == "f":
            x = Tensor(x.data.astype(np.float64), requires_grad=x.requires_grad)
        out.append(x)
    return out


def numeric_grad(fn, inputs, i, weights, eps=1e-6):
    """d sum(fn(inputs) * weights) / d inputs[i], by central differences."""
    x = inputs[i].data
    grad = np.zeros_like(x)
    with no_grad():
        for j in np.ndindex(x.shape):
            orig = x[j]
            x[j] = orig + eps
            plus = _weighted_sum(fn(*inputs), weights)
            x[j] = orig - eps
            minus = _weighted_sum(fn(*inputs), weights)
            x[j] = orig
            grad[j] = (plus - minus) / (2 * eps)
    return grad


def _weighted_sum(out, weights):
    outs = out if isinstance(out, (list, tuple)) else [out]
    return sum(float((o.data * w).sum()) for o, w in zip(outs, weights))


def gradcheck(fn, inputs, name=None, eps=1e-6, atol=1e-6, rtol=1e-5, seed=0):
    """Check every float input with requires_grad=True of `fn(*inputs)` (a Tensor or a list
    of Tensors). Inputs are converted to float64 first. Raises AssertionError naming the op
    (`name`, default fn's name), the input, the worst index and both values."""
    name = name or getattr(fn, "__name__", "fn")
    inputs = _as_float64_tensors(inputs)
    out = fn(*inputs)
    outs = out if isinstance(out, (list, tuple)) else [out]
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(o.shape) for o in outs]
    total = None
    for o, w in zip(outs, weights):             # L = sum_k sum(out_k * w_k)
        if o.requires_grad:
            term = (o * Tensor(w)).sum()
            total = term if total is None else total + term
    if total is None:
        raise AssertionError(f"{name}: no output requires grad (give the inputs to check "
                             "as Tensor(array, requires_grad=True))")
    total.backward()
    for i, x in enumerate(inputs):
        if not (isinstance(x, Tensor) and x.requires_grad):
            continue
        analytic = np.zeros_like(x.data) if x.grad is None else x.grad
        numeric = numeric_grad(fn, inputs, i, weights, eps)
        _compare(name, i, x, analytic, numeric, atol, rtol)


def _compare(name, i, x, analytic, numeric, atol, rtol):
    if analytic.shape != numeric.shape:
        raise AssertionError(f"{name}: input {i} {x.shape}: gradient has shape "
                             f"{analytic.shape}")
    err = np.abs(analytic - numeric) - (atol + rtol * np.abs(numeric))
    if err.size and err.max() > 0:
        worst = tuple(int(k) for k in np.unravel_index(np.argmax(err), err.shape))
        raise AssertionError(
            f"{name}: gradient of input {i} (shape {x.shape}) wrong at index {worst}: "
            f"backward gives {analytic[worst]:.8g}, central difference {numeric[worst]:.8g} "
            f"(|diff| {abs(analytic[worst] - numeric[worst]):.3g}; "
            f"{int((err > 0).sum())} of {err.size} elements off)")
