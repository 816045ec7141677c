"""Fused ops vs the same layers composed from primitive ops: time and memory.

    python examples/bench_fused.py --threads 1

For each op at the GPT reference sizes (B=16, T=128, C=256, nh=4, float32) prints one JSON
line: forward+backward time (best of --repeats), the bytes the graph keeps for backward (arrays
referenced from the ops' saved state, except the inputs' and the output's own buffers,
which exist whatever the op saves), and the peak bytes numpy allocated during
forward+backward (tracemalloc).
The composed versions are minidist/autograd/reference.py. The tiled_self_attention rows
compare minidist/autograd/flash.py's tiled attention (tiles of 64, in the "fused" columns) with
the materialised fused attention (in the "composed" columns), at T = 128 and T = 1024.
"""
import json
import time
import tracemalloc

import numpy as np

from minidist import backend
from minidist.autograd import Tensor, flash, fused as F, reference as R
from minidist.autograd.tensor import Node
from minidist.train.args import example_parser

B, T, C, NH = 16, 128, 256, 4


def cases(rng):
    """(name, shape, fused, composed, the shapes of its inputs): the inputs are made only
    for the ops that run (inputs(rng, shapes)), so listing the names costs nothing."""
    targets = rng.integers(0, 256, (B, T))
    big_v = rng.integers(0, 8192, (8, 64))
    return [
        ("linear", (B, T, C, 4 * C), F.linear, R.linear, [(B, T, C), (C, 4 * C), (4 * C,)]),
        ("layer_norm", (B, T, C), F.layer_norm, R.layer_norm, [(B, T, C), (C,), (C,)]),
        ("gelu", (B, T, 4 * C), F.gelu, R.gelu, [(B, T, 4 * C)]),
        ("softmax", (B, NH, T, T), F.softmax, R.softmax, [(B, NH, T, T)]),
        ("log_softmax", (B * T, 256), F.log_softmax, R.log_softmax, [(B * T, 256)]),
        ("cross_entropy", (B, T, 256), lambda z: F.cross_entropy(z, targets),
         lambda z: R.cross_entropy(z, targets), [(B, T, 256)]),
        ("cross_entropy_v8192", (8, 64, 8192), lambda z: F.cross_entropy(z, big_v),
         lambda z: R.cross_entropy(z, big_v), [(8, 64, 8192)]),
        ("causal_self_attention", (B, T, 3 * C, NH), lambda x: F.causal_self_attention(x, NH),
         lambda x: R.causal_self_attention(x, NH), [(B, T, 3 * C)]),
        ("tiled_self_attention", (B, T, 3 * C, NH), lambda x: flash.tiled_self_attention(x, NH),
         lambda x: F.causal_self_attention(x, NH), [(B, T, 3 * C)]),
        ("tiled_self_attention_T1024", (2, 1024, 3 * C, NH),
         lambda x: flash.tiled_self_attention(x, NH), lambda x: F.causal_self_attention(x, NH),
         [(2, 1024, 3 * C)]),
    ]


def inputs(rng, shapes):
    """Random float32 tensors of these shapes that take gradients."""
    return [Tensor(rng.standard_normal(s).astype(np.float32), requires_grad=True)
            for s in shapes]


def _root(a):
    while isinstance(getattr(a, "base", None), np.ndarray):
        a = a.base
    return a


def _arrays(obj, out):
    """Every ndarray reachable through tuples, lists and a context's attributes."""
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _arrays(o, out)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for o in vars(obj).values():
            _arrays(o, out)


def saved_bytes(out, inputs):
    """Bytes of distinct buffers the graph behind `out` keeps for backward, beyond the
    inputs' and the output's."""
    arrays, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, Node) or id(node) in seen or node.ctx is None:
            continue                  # None (no gradient), a leaf, a Node seen or freed
        seen.add(id(node))
        _arrays(node.ctx, arrays)
        stack.extend(node.parents)
    skip = {id(_root(x.data)) for x in inputs + [out]}
    roots = {id(_root(a)): _root(a) for a in arrays}
    return sum(r.nbytes for k, r in roots.items() if k not in skip)


def step(fn, inputs, grad):
    for x in inputs:
        x.grad = None
    out = fn(*inputs)
    out.backward(grad)
    return out


def memory(fn, inputs):
    """(bytes saved for backward beyond inputs and output, peak bytes of forward+backward)."""
    out = fn(*inputs)
    held = saved_bytes(out, inputs)
    grad = np.ones_like(out.data)
    del out
    tracemalloc.start()
    step(fn, inputs, grad)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return held, peak


def best_times(fns, inputs, repeats):
    """Best forward+backward time of each fn, runs interleaved so that machine noise and
    warm-up hit both alike."""
    grad = np.ones_like(fns[0](*inputs).data)
    best = [float("inf")] * len(fns)
    for _ in range(repeats + 1):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            step(fn, inputs, grad)
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def main():
    rng = np.random.default_rng(0)
    ops = cases(rng)
    names = [name for name, *_ in ops]
    p = example_parser(__doc__)
    p.add_argument("--threads", type=int, default=1, help="BLAS threads")
    p.add_argument("--repeats", type=int, default=15, help="timed runs per op, best kept")
    p.add_argument("--only", default=None, metavar="OP", choices=names,
                   help=f"run just this op, one of: {', '.join(names)}")
    args = p.parse_args()
    for flag, value in (("--threads", args.threads), ("--repeats", args.repeats)):
        if value < 1:
            p.error(f"{flag} {value}: must be at least 1")
    backend.setup(threads=args.threads, device="cpu")
    for name, shape, fused, composed, shapes in ops:
        if args.only and name != args.only:
            continue
        xs = inputs(rng, shapes)
        tf, tc = best_times([fused, composed], xs, args.repeats)
        (sf, pf), (sc, pc) = memory(fused, xs), memory(composed, xs)
        mb = 2.0 ** 20
        print(json.dumps({
            "op": name, "shape": shape, "fused_ms": round(tf * 1e3, 2),
            "composed_ms": round(tc * 1e3, 2), "speedup": round(tc / tf, 2),
            "fused_saved_mb": round(sf / mb, 2), "composed_saved_mb": round(sc / mb, 2),
            "fused_peak_mb": round(pf / mb, 2), "composed_peak_mb": round(pc / mb, 2),
            "threads": args.threads}), flush=True)


if __name__ == "__main__":
    main()
