"""Soak: minidist.train for many steps, watching each rank for what grows step after step.

    python tests/scripts/soak.py --every 250 --warmup 500 -- --steps 3000 --n-layer 2 \\
        --n-embd 32 --block-size 32 --batch-size 4 --data FILE
    mpiexec -n 4 python tests/scripts/soak.py --every 250 -- --steps 3000 --zero 3 ...

Flags before `--` are the soak's, those after it examples/train_gpt.py's (checked as it checks
them); the run is the one examples/train_gpt.py makes (minidist.train.loop.train), with an
`each_step` watcher that, every --every steps, after a full gc.collect(), records on each
rank: VmRSS and VmHWM (/proc/self/status), the interpreter's allocated blocks (the watcher's
own rows taken out), the live objects of every class gc tracks, the items every list, dict,
set and deque among them holds (a list growing by a tuple of numbers stays one object: such
tuples are not tracked), the numpy arrays they refer to, open file descriptors
(/proc/self/fd), threads, the objects gc.collect() freed (reference cycles: memory held until
a collection) and the mean, median and least step time of the window (other jobs on the
cores move the mean; the least step least). With --trace N, tracemalloc (N frames) also
records the traced bytes, and the allocation sites that grew most between the first sample
after --warmup and the last (it slows Python ~4x: name a site the counts showed).

The verdict, one `SOAK {json}` line per rank from rank 0 (and --out FILE: the rows too):
each measure's growth per 1000 steps after --warmup (least squares over the samples), the
change of the objects, items and arrays from the first sample after warm-up to the last, the
classes whose counts changed, and the top tracemalloc sites. Object and item counts are
deterministic but for work in flight at the sample (an overlapped gather, a save on its
thread); RSS and step time are noisy, read them over thousands of steps.
Used by tests/test_soak.py (slow); how to run one: minidist/train/README.md#soak-a-long-run.
"""
import argparse
import collections
import gc
import json
import os
import sys
import threading
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from minidist.launcher import set_thread_env, world_size_from_env  # noqa: E402

set_thread_env()          # before numpy loads BLAS, as examples/train_gpt.py does

import numpy as np  # noqa: E402

from minidist import backend, comm  # noqa: E402
from minidist.train.args import train_parser  # noqa: E402
from minidist.train.cli import check_flags  # noqa: E402
from minidist.train.loop import train  # noqa: E402
from minidist.train.saves import claim_save  # noqa: E402
from minidist.strategy import save_lock  # noqa: E402

CONTAINERS = (list, dict, set, collections.deque)
MEASURES = ("rss_kb", "hwm_kb", "blocks", "traced_kb", "objects", "items", "arrays", "fds",
            "threads", "cycles_freed", "ms_per_step", "ms_median", "ms_min")


def soak_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--every", type=int, default=250, help="sample every K steps")
    p.add_argument("--warmup", type=int, default=500,
                   help="steps before the growth is measured (caches fill, arrays settle)")
    p.add_argument("--trace", type=int, default=0,
                   help="tracemalloc with this many frames (0: off; it slows Python ~2x)")
    p.add_argument("--top", type=int, default=8, help="allocation sites and classes shown")
    p.add_argument("--out", help="write the verdict and every sample here (rank 0, JSON)")
    return p


def status_kb(field):
    """A VmRSS / VmHWM line of /proc/self/status, in kB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def live_objects():
    """{class name: live count} of every class gc tracks (minidist's and the rest: dict,
    tuple, ...), the total, the numpy arrays any of them refers to (arrays are not tracked
    themselves), and the items every list, dict, set and deque among them holds: a list
    that grows by a tuple of numbers a step is one object throughout (a tuple of numbers is
    not tracked), but its items grow."""
    objects = gc.get_objects()
    counts, items = {}, 0
    for obj in objects:
        kind = type(obj)
        module = kind.__module__      # (a descriptor on some classes of classes)
        name = f"{module}.{kind.__qualname__}" if isinstance(module, str) else kind.__name__
        counts[name] = counts.get(name, 0) + 1
        if kind in CONTAINERS:
            items += len(obj)
    arrays = {id(o) for o in gc.get_referents(*objects) if type(o) is np.ndarray}
    total = len(objects)
    del objects
    return counts, total, len(arrays), items


class Watcher:
    """The `each_step` of minidist.train.loop.train: a sample every `every` steps."""

    def __init__(self, every, warmup, trace):
        self.every, self.warmup, self.trace = every, warmup, trace
        self.rows = []
        # the counts of the first sample after warm-up and of the latest one
        self.counts = [None, None]
        self.own = 0         # blocks the watcher's own rows hold (taken out of "blocks")
        self.snapshots = []
        self.t_mark, self.times = time.perf_counter(), []

    def __call__(self, step):
        t = time.perf_counter()
        self.times.append(t - self.t_mark)      # this step's seconds, evaluation and save too
        self.t_mark = t
        if (step + 1) % self.every:
            return
        times = np.sort(self.times) * 1e3
        self.times.clear()
        freed = gc.collect()
        blocks = sys.getallocatedblocks() - self.own
        counts, total, arrays, items = live_objects()   # (its dicts of counts: not tracked)
        items -= len(self.rows) + len(self.snapshots)        # (the watcher's own lists)
        row = {"step": step + 1, "ms_per_step": float(times.mean()),
               "ms_median": float(times[len(times) // 2]), "ms_min": float(times[0]),
               "rss_kb": status_kb("VmRSS"), "hwm_kb": status_kb("VmHWM"), "blocks": blocks,
               "objects": total, "items": items, "arrays": arrays,
               "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
               "cycles_freed": freed,
               "traced_kb": tracemalloc.get_traced_memory()[0] // 1024 if self.trace else 0}
        self.rows.append(row)
        if step + 1 >= self.warmup:
            self.counts[self.counts[0] is not None] = counts
        del counts
        self.own = sys.getallocatedblocks() - blocks     # (rows, counts: the watcher's)
        if self.trace and step + 1 >= self.warmup and len(self.snapshots) < 2:
            self.snapshots.append(tracemalloc.take_snapshot())
        elif self.trace and len(self.snapshots) == 2:
            self.snapshots[1] = tracemalloc.take_snapshot()
        self.t_mark = time.perf_counter()    # (the sample's own time left out)

    def verdict(self, top):
        """Growth per 1000 steps after warm-up, the classes that grew, the top sites."""
        keep = [i for i, r in enumerate(self.rows) if r["step"] >= self.warmup]
        rows = [self.rows[i] for i in keep]
        out = {"samples": len(rows), "from_step": rows[0]["step"] if rows else None,
               "to_step": rows[-1]["step"] if rows else None}
        if len(rows) < 2:
            out["error"] = "fewer than 2 samples after --warmup: run more steps"
            return out
        steps = np.array([r["step"] for r in rows], dtype=float)
        per_1000 = {}
        for name in MEASURES:
            values = np.array([r[name] for r in rows], dtype=float)
            per_1000[name] = round(float(np.polyfit(steps, values, 1)[0]) * 1000, 3)
        out["per_1000_steps"] = per_1000
        out["first"], out["last"] = rows[0], rows[-1]
        a, b = self.counts
        grown = {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}
        grown = sorted(((v, k) for k, v in grown.items() if v), reverse=True)
        out["classes_changed"] = {k: v for v, k in grown[:top] + grown[-top:][::-1]
                                  if k} if grown else {}
        out["objects_change"] = rows[-1]["objects"] - rows[0]["objects"]
        out["arrays_change"] = rows[-1]["arrays"] - rows[0]["arrays"]
        out["items_change"] = rows[-1]["items"] - rows[0]["items"]
        if len(self.snapshots) == 2:       # (the watcher's own allocations left out)
            mine = [tracemalloc.Filter(False, __file__, all_frames=True),
                    tracemalloc.Filter(False, tracemalloc.__file__, all_frames=True)]
            first, last = (s.filter_traces(mine) for s in self.snapshots)
            diff = last.compare_to(first, "traceback")
            out["top_sites"] = [
                {"kb": round(d.size_diff / 1024, 1), "count": d.count_diff,
                 "where": [f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}"
                           for f in list(d.traceback)[-6:]]}
                for d in diff[:top] if d.size_diff > 0]
        return out


def main(argv):
    soak_argv, train_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else ([], argv)
    soak = soak_parser().parse_args(soak_argv)
    args = train_parser().parse_args(train_argv)
    check_flags(args)
    if soak.trace:
        tracemalloc.start(soak.trace)
    backend.setup(threads=args.threads, device=args.device)
    world = None
    if world_size_from_env() > 1 or args.zero:
        world = comm.init(args.comm, timeout=args.comm_timeout, sync_comm=args.sync_comm)
    watcher = Watcher(soak.every, soak.warmup, soak.trace)
    held = claim_save(world, args.save)
    try:
        train(args, world, each_step=watcher)
    finally:
        save_lock.release(held)
    verdict = dict(watcher.verdict(soak.top), rank=0 if world is None else world.rank)
    verdicts = [verdict] if world is None else world.gather_object(verdict)
    if world is None or world.rank == 0:
        for v in verdicts:
            print("SOAK " + json.dumps(v, sort_keys=True), flush=True)
        if soak.out:
            with open(soak.out, "w") as f:
                json.dump({"verdicts": verdicts, "rows": watcher.rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
