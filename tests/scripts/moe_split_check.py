"""SequenceSum (minidist/nn/moe_split.py) checked by central differences across 2 ranks,
float64: the all-reduced sums of an MoE layer's statistics, with the gradient each rank's
tokens get.

    mpiexec -n 2 python tests/scripts/moe_split_check.py

The objective is the model's: every rank computes the same loss from the summed statistics,
L = <SequenceSum(x), R> with R the same on every rank. Sequence parallelism (grad x 1): the tp
ranks' losses are ONE loss, so the gradient of rank r's x is dL/dx_r. Context parallelism
(grad x cp): the objective is the mean over the cp ranks of their losses, and each rank's
gradient is averaged over cp by the strategy, so rank r must hold cp x dL/dx_r, the
gradient of the sum of every rank's (equal) loss. Each rank's x is perturbed in turn (every
rank runs every forward: they are collective). Rank 0 prints `GRADCHECK {json}` rows for
tests/test_moe.py. A failure raises and aborts the job.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import start  # noqa: E402

from minidist.autograd import Tensor, no_grad  # noqa: E402
from minidist.nn.moe_split import SequenceSum  # noqa: E402
from minidist.comm import DeviceMesh  # noqa: E402
import minidist.comm  # noqa: E402

SEED = 5


def check(name, group, scale, comm, eps=1e-6):
    """Backward of SequenceSum(x, [group], scale) against central differences of
    scale x <SequenceSum(x), R> (R shared): a row."""
    x = np.random.default_rng([SEED, 1 + comm.rank]).standard_normal((3, 4))
    R = np.random.default_rng([SEED, 0]).standard_normal((3, 4))
    t = Tensor(x.copy(), requires_grad=True)
    (SequenceSum.apply(t, [group], scale) * Tensor(R)).sum().backward()

    def loss():
        with no_grad():
            return scale * float((SequenceSum.apply(t, [group], scale).data * R).sum())
    numeric = np.zeros_like(x)
    for owner in range(comm.size):
        for j in np.ndindex(x.shape):
            orig = t.data[j]
            values = []
            for step in (eps, -eps):
                t.data[j] = orig + step if owner == comm.rank else orig
                values.append(loss())
            t.data[j] = orig
            if owner == comm.rank:
                numeric[j] = (values[0] - values[1]) / (2 * eps)
    diff = float(np.abs(t.grad - numeric).max())
    assert diff < 1e-6, (name, comm.rank, diff)
    return {"op": name, "rank": comm.rank, "max_abs_diff": diff}


def main():
    _, comm = start(argparse.ArgumentParser())
    group = DeviceMesh(dp=1, tp=comm.size, world=minidist.comm.init()).tp
    for name, scale in (("SequenceSum, sequence parallel (x 1)", 1),
                        ("SequenceSum, context parallel (x cp)", comm.size)):
        rows = comm.gather(check(name, group, scale, comm), root=0)
        if comm.rank == 0:
            for row in rows:
                print("GRADCHECK " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
