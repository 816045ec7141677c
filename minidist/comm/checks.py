"""What ProcessGroup checks before it communicates (group.py), and the ranks-in-a-message
helpers that the checks of other layers use too.

A collective's arguments are checked on every rank before any byte moves: `flat` (a numpy or
cupy array, C-contiguous), `check_op` (a known reduction; avg only on floats), `check_chunk`
(reduce_scatter's `out` / all_gather's `inp` is this rank's chunk_bounds share) and
`check_new_group` (the same list of distinct ranks everywhere, judged from every rank's list,
all-gathered). Each depends only on what every rank of a correct program passes alike, so
misuse raises the same ValueError or TypeError on every rank and no rank is left waiting in a
collective (tests/test_comm_misuse.py).

`ranks_by_value` and `ranks_text` turn one value per rank (an all_gather_object's) into "ranks
0, 2 found X": the start-up checks of train/cli.py, train/strategy.py, train/saves.py and
zero/checkpoint.py name the ranks that disagree with them.
"""
import numbers

REDUCE_OPS = ("sum", "avg", "max", "min")


def is_int(r):
    """An int or numpy integer, not a bool: what a rank number may be."""
    return isinstance(r, numbers.Integral) and not isinstance(r, bool)


def ranks_by_value(values):
    """{each distinct value: the ranks that gave it}, first seen first, from `values` (one per
    rank, in rank order: an all_gather_object's): what each rank found, once per finding."""
    out = {}
    for rank, value in enumerate(values):
        out.setdefault(value, []).append(rank)
    return out


def ranks_text(ranks):
    """'rank 1', or 'ranks 0, 2': ranks_by_value's ranks in a message."""
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def flat(buf):
    """`buf` as the 1-D view every collective works on; a list, or a strided view (which a
    collective could not fill in place), raises, naming what to pass instead."""
    if not (hasattr(buf, "flags") and hasattr(buf, "dtype")):
        raise TypeError(f"collectives take a numpy or cupy array, which they fill in place, "
                        f"not a {type(buf).__name__}; pass x = np.asarray(...) and read the "
                        "result from x")
    if not buf.flags.c_contiguous:
        raise ValueError(f"collectives need C-contiguous buffers, got shape {buf.shape} with "
                         f"strides {buf.strides}; pass a flat buffer or x.copy()")
    return buf.reshape(-1)


def check_op(op, buf=None, name="all_reduce"):
    """A known op; "avg" only on a floating buffer (it divides in place). Both depend only on
    the call's op and dtype, which every rank of a correct program shares, so every rank
    raises alike, before any communication."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, not {op!r}")
    if op == "avg" and buf is not None and buf.dtype.kind in "biu":
        raise ValueError(f"{name}: avg needs a floating buffer (it divides by the group size "
                         f"in place), not {buf.dtype}; reduce with op='sum' and divide a "
                         "floating copy, or pass a float array")


def check_new_group(group, lists):
    """new_group's `ranks`, as every rank gave them (`lists`, in rank order): the same list
    everywhere, of distinct ints in 0..size-1. Raises ValueError, alike on every rank."""
    texts = ranks_by_value([repr(lst) for lst in lists])
    if len(texts) > 1:
        detail = "; ".join(f"{ranks_text(who)} passed {text}" for text, who in texts.items())
        raise ValueError(f"new_group on group {group.name!r}: the ranks passed different lists "
                         f"({detail}); every rank must pass the same list, in the same order "
                         "(it is the new group's rank order)")
    ranks = lists[0]
    good = [is_int(r) and 0 <= r < group.size for r in ranks]
    bad = [r for r, ok in zip(ranks, good) if not ok]
    seen = [r for r, ok in zip(ranks, good) if ok]
    twice = sorted({int(r) for i, r in enumerate(seen) if r in seen[:i]})
    if bad or twice:
        problems = ([f"not ranks of it: {bad}"] if bad else []) + \
            ([f"given more than once: {twice}"] if twice else [])
        raise ValueError(f"new_group({ranks}) on group {group.name!r} of size {group.size}: "
                         f"ranks must be distinct ints in 0..{group.size - 1}; "
                         + "; ".join(problems))


def check_chunk(group, name, which, chunk, full):
    """`chunk` (the `which` argument of collective `name`) is this rank's share of `full` under
    chunk_bounds, of full's dtype."""
    lo, hi = group.chunk(full.size)
    if chunk.size != hi - lo:
        raise ValueError(f"{name}: rank {group.rank} of {group.size} owns elements [{lo}:{hi}) "
                         f"of {full.size}, so `{which}` must have {hi - lo} elements, not "
                         f"{chunk.size} (see chunk_bounds)")
    if chunk.dtype != full.dtype:
        raise ValueError(f"{name}: out and inp dtypes differ ({chunk.dtype} vs {full.dtype})")
