"""Central differences across ranks (float64), for Functions whose forward communicates: a
rank's gradient must be the derivative of a loss every rank's output counts in.

    dist_gradcheck(name, fn, x, comm, inp, out)

L = sum over ranks of <fn(t)_r, R_r> (out "sharded": each rank's output is its own) or
<fn(t), R> counted once (out "replicated"), with fixed random R. inp "sharded": each rank's
t is its own, perturbed one rank at a time (the ranks' shards may differ in shape: the owner
tells the others how many elements it perturbs); "replicated": one t, perturbed on every rank
at once. Every rank calls it together (each loss is an allreduce on `comm`, mpi4py's).
Used by tests/scripts/tp_probes.py, alltoall_check.py, ulysses_check.py and cp_check.py.
"""
import numpy as np

from minidist.autograd import Tensor, no_grad

SEED = 11


def numeric_grad(fn, t, R, comm, inp, out, eps):
    """dL/dt by central differences (L as in the module's docstring)."""
    def loss():
        with no_grad():
            v = float((fn(t).data * R).sum())
        return comm.allreduce(v) if out == "sharded" else v
    numeric = np.zeros_like(t.data)
    for owner in (range(comm.size) if inp == "sharded" else [comm.rank]):
        mine = owner == comm.rank
        n = comm.bcast(t.data.size, root=owner) if inp == "sharded" else t.data.size
        for k in range(n):
            j = np.unravel_index(k, t.shape) if mine else None
            orig = t.data[j] if mine else None
            if mine:
                t.data[j] = orig + eps
            plus = loss()
            if mine:
                t.data[j] = orig - eps
            minus = loss()
            if mine:
                t.data[j] = orig
                numeric[j] = (plus - minus) / (2 * eps)
    return numeric


def dist_gradcheck(name, fn, x, comm, inp, out, eps=1e-6, atol=1e-6, rtol=1e-5):
    """Backward's gradient of L with respect to x (this rank's array) against numeric_grad;
    raises naming the op, the rank and the worst index. Returns a result row."""
    t = Tensor(x.copy(), requires_grad=True)
    y = fn(t)
    seed = [SEED, 1 + comm.rank] if out == "sharded" else [SEED, 0]
    R = np.random.default_rng(seed).standard_normal(y.shape)
    (y * Tensor(R)).sum().backward()
    grad = np.zeros_like(t.data) if t.grad is None else t.grad
    numeric = numeric_grad(fn, t, R, comm, inp, out, eps)
    err = np.abs(grad - numeric) - (atol + rtol * np.abs(numeric))
    if err.size:
        worst = tuple(int(k) for k in np.unravel_index(np.argmax(err), err.shape))
        assert err.max() <= 0, (f"{name} on rank {comm.rank}: backward {grad[worst]:.8g}, "
                                f"central difference {numeric[worst]:.8g} at {worst}")
    return {"op": name, "rank": comm.rank, "inp": inp, "out": out, "elements": int(t.data.size),
            "max_abs_diff": float(np.abs(grad - numeric).max()) if err.size else 0.0}
