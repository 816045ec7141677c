"""The ring collectives for N ranks inside one process: the same schedule, step by step.

Each simulated rank is a numpy array in a list. Every step asks ring.py's own schedule
(`reduce_scatter_step`, `all_gather_step`, `chain_step`) which chunk each rank sends and
receives, moves the chunks between list entries, and reduces, so the table printed is the one
in ring.py's docstring and a debugger stepping through `simulate_all_reduce` sees what every
rank holds after every step. No MPI messages are sent.

Each rank adds the arriving partial sum into its own buffer (`bufs[r][chunk] += incoming`),
exactly as ring.py's `ring_all_reduce` does; its stand-alone `ring_reduce_scatter` keeps the
travelling sums in scratch buffers instead so as to leave its input untouched, with the same
chunks sent and the same sums formed.

`simulate_reduce_scatter` and `simulate_all_gather` are its two phases alone, as ZeRO uses
them (examples/zero_walkthrough.py). `simulate_all_to_all` does the same for the pairwise
all-to-all (alltoall.py's `pairwise_step`), which examples/moe_walkthrough.py prints.
Run: python examples/ring_walkthrough.py --ranks 4 --n 10.
Tests: tests/test_comm.py::test_simulation_matches_sum, tests/test_alltoall.py.
"""
import numpy as np

from minidist.comm.alltoall import offsets, pairwise_step
from minidist.comm.ring import (all_gather_step, chain_step, chunk_bounds, reduce_into,
                                reduce_scatter_step)


def _table(who, bounds, show):
    """Rank x chunk table of which ranks' data each chunk holds so far (e.g. 0+2+3)."""
    world = len(who)
    show("          " + "".join(f"chunk {c} [{lo}:{hi})".ljust(18)
                                for c, (lo, hi) in enumerate(bounds)))
    for r in range(world):
        show(f"  rank {r}  " + "".join("+".join(map(str, sorted(s))).ljust(18) for s in who[r]))


def _ring_phase(name, bufs, who, bounds, step_fn, op, show):
    """World-1 steps of one ring phase; `op` None copies (all-gather), else reduces."""
    world = len(bufs)
    for step in range(world - 1):
        show(f"\n{name} step {step}:")
        # every rank sends at the same time: snapshot all outgoing chunks first
        outgoing = []
        for r in range(world):
            send_idx, _ = step_fn(r, world, step)
            lo, hi = bounds[send_idx]
            outgoing.append((send_idx, bufs[r][lo:hi].copy(), set(who[r][send_idx])))
        for r in range(world):
            left = (r - 1) % world
            _, recv_idx = step_fn(r, world, step)
            chunk, data, contributors = outgoing[left]
            assert chunk == recv_idx, "the schedule must agree with the left neighbour's"
            lo, hi = bounds[chunk]
            if op is None:
                bufs[r][lo:hi] = data
                who[r][chunk] = contributors
                verb = "stores it"
            else:
                reduce_into(op, bufs[r][lo:hi], data, out=bufs[r][lo:hi])
                who[r][chunk] = who[r][chunk] | contributors
                verb = (f"reduces ({op}) it into its own -> "
                        f"{'+'.join(map(str, sorted(who[r][chunk])))}")
            show(f"  rank {left} -> rank {r}: chunk {chunk} "
                 f"({'+'.join(map(str, sorted(contributors)))}); rank {r} {verb}")
        _table(who, bounds, show)


def simulate_all_reduce(inputs, op="sum", show=print):
    """Ring all-reduce of `inputs` (one 1-D array per simulated rank); returns the outputs."""
    world, n = len(inputs), inputs[0].size
    bounds = chunk_bounds(n, world)
    bufs = [np.array(x, copy=True) for x in inputs]
    who = [[{r} for _ in range(world)] for r in range(world)]
    show(f"ring all-reduce ({op}) of {n} elements on {world} simulated ranks; "
         f"chunks {bounds}\nthe tables name whose data each chunk holds, by rank ('0+2': "
         "rank 0's and rank 2's combined);\nat the start each rank holds only its own:")
    _table(who, bounds, show)
    _ring_phase("reduce-scatter", bufs, who, bounds, reduce_scatter_step, op, show)
    show("\nnow rank r holds chunk r reduced over all ranks; all-gather passes them around")
    if op == "avg":
        for r, (lo, hi) in enumerate(bounds):
            bufs[r][lo:hi] /= world
    _ring_phase("all-gather", bufs, who, bounds, all_gather_step, None, show)
    return bufs


def simulate_reduce_scatter(inputs, op="sum", show=print):
    """Ring reduce-scatter of `inputs` (one 1-D array per simulated rank): the all-reduce's
    first phase. Returns each rank's buffer, whose chunk r (rank r's own: chunk_bounds) holds
    the reduction over every rank; its other chunks hold partial sums. ZeRO's gradients
    (examples/zero_walkthrough.py)."""
    world, n = len(inputs), inputs[0].size
    bounds = chunk_bounds(n, world)
    bufs = [np.array(x, copy=True) for x in inputs]
    who = [[{r} for _ in range(world)] for r in range(world)]
    _ring_phase("reduce-scatter", bufs, who, bounds, reduce_scatter_step, op, show)
    if op == "avg":
        for r, (lo, hi) in enumerate(bounds):
            bufs[r][lo:hi] /= world
    return bufs


def simulate_all_gather(bufs, show=print):
    """Ring all-gather: chunk r of rank r's buffer (chunk_bounds) to every rank, in new
    buffers (the all-reduce's second phase). ZeRO's updated parameter shards."""
    world = len(bufs)
    bounds = chunk_bounds(bufs[0].size, world)
    out = [np.array(b, copy=True) for b in bufs]
    who = [[{r} if c == r else set() for c in range(world)] for r in range(world)]
    _ring_phase("all-gather", out, who, bounds, all_gather_step, None, show)
    return out


def simulate_broadcast(buf, world, root=0, nseg=3, show=print):
    """Chain broadcast of `buf` from `root` in `nseg` segments; returns each rank's buffer."""
    segs = chunk_bounds(buf.size, nseg)
    bufs = [np.array(buf, copy=True) if r == root else np.zeros_like(buf) for r in range(world)]
    show(f"chain broadcast from rank {root}, {nseg} segments {segs}, {world} ranks")
    for step in range(nseg + world - 2):
        moves = []
        for r in range(world):
            pos = (r - root) % world
            send_idx, _ = chain_step(pos, world, step, nseg)
            if send_idx is not None:
                moves.append((r, (r + 1) % world, send_idx))
        for src, dst, seg in moves:
            lo, hi = segs[seg]
            bufs[dst][lo:hi] = bufs[src][lo:hi]
        show(f"  step {step}: " + ", ".join(f"rank {s} -> rank {d}: segment {g}"
                                            for s, d, g in moves))
    return bufs


def simulate_all_to_all(inputs, counts, show=print):
    """Pairwise all-to-all-v: inputs[i] holds counts[i][j] elements for rank j, in rank order;
    returns what each rank receives (from rank 0, then 1, ...), moving one chunk per rank per
    step as alltoall.py's `pairwise_all_to_all_v` does."""
    world = len(inputs)
    starts = [offsets(c) for c in counts]
    chunk = lambda i, j: inputs[i][starts[i][j]:starts[i][j + 1]]     # noqa: E731  i -> j
    got = [[None] * world for _ in range(world)]                        # got[j][i]: from i
    for r in range(world):
        got[r][r] = chunk(r, r).copy()                                  # step 0: my own chunk
    for step in range(1, world):
        moves = []
        for r in range(world):
            dst, src = pairwise_step(r, world, step)
            assert pairwise_step(dst, world, step)[1] == r, "the partner must expect r"
            got[dst][r] = chunk(r, dst).copy()
            moves.append(f"{r}->{dst} ({counts[r][dst]})")
        show(f"  step {step}: " + ", ".join(moves))
    return [np.concatenate(g) for g in got]
