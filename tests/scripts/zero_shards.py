"""What the ZeRO-3 build scripts share (tests/scripts/zero_build.py, zero_build_parts.py,
zero_init_from.py): a build traced, and a rank's shards (and --amp's float32 master shards)
held to the reference build's, bit for bit.
"""
import tracemalloc

import numpy as np

from minidist import backend


def traced(build):
    """(what build() returns, {"peak": the traced peak while it ran, "held": what is still
    traced after it: the shards kept}, each less what was traced before)."""
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    out = build()
    held, peak = (m - start for m in tracemalloc.get_traced_memory())
    tracemalloc.stop()
    return out, {"peak": peak, "held": held}


def assert_same_shards(units, ref_units):
    """Each unit's parameter shard on this rank = the reference's: names, dtype, values."""
    assert len(units) == len(ref_units)
    for u, r in zip(units, ref_units):
        assert u.flat.names == r.flat.names
        a, b = backend.to_host(u.param_shard), backend.to_host(r.param_shard)
        assert a.dtype == b.dtype and np.array_equal(a, b), u.flat.name


def assert_same_masters(optimizers, ref_optimizers):
    """Each optimizer's float32 master shards (--amp) = the reference optimizer's."""
    for opt, ref in zip(optimizers, ref_optimizers):
        for name in opt.state:
            a, b = (backend.to_host(o.state[name]["master"]) for o in (opt, ref))
            assert a.dtype == np.float32 and np.array_equal(a, b), name
