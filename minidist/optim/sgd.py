"""SGD with momentum (the PyTorch convention) and L2 weight decay added to the gradient.

    g <- g + wd * p                     (coupled decay: plain L2 regularisation)
    buf <- momentum * buf + g           (buf = g on the first step)
    p <- p - lr * buf                   (nesterov: p <- p - lr * (g + momentum * buf))

`sgd_update` does it in place on raw arrays; `SGD` keeps one momentum buffer per parameter.
Tests: tests/test_optim.py.
"""
from minidist.backend import xp_of
from minidist.optim.optimizer import Optimizer


def sgd_update(p, g, buf, lr, momentum=0.0, weight_decay=0.0, nesterov=False, first=False):
    """One SGD step in place on p (and on buf when momentum > 0). `first` starts buf at g."""
    if weight_decay:
        g = g + weight_decay * p
    if momentum:
        if first:
            buf[...] = g
        else:
            buf *= momentum
            buf += g
        g = g + momentum * buf if nesterov else buf
    xp_of(p).subtract(p, lr * g, out=p)


class SGD(Optimizer):
    defaults = {"lr": 1e-2, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False}

    def __init__(self, params, lr=1e-2, momentum=0.0, weight_decay=0.0, nesterov=False):
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         nesterov=nesterov)

    def update(self, p, grad, state, group, name=None):
        first = group["momentum"] and "momentum_buffer" not in state
        if first:
            state["momentum_buffer"] = xp_of(p).empty_like(p)
        sgd_update(p, grad, state.get("momentum_buffer"), group["lr"], group["momentum"],
                   group["weight_decay"], group["nesterov"], first=bool(first))
