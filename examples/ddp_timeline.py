"""Draw one training step of a DDP trace as text: when each bucket's all-reduce ran, against
the forward and backward passes, for every rank.

    mpirun -n 4 python examples/train_gpt.py --steps 5 --trace /tmp/ddp.json
    python examples/ddp_timeline.py /tmp/ddp.json              # the last step
    python examples/ddp_timeline.py /tmp/ddp.json --step 2 --width 100 --ranks 0,3

Reads the Chrome trace that --trace writes (minidist/comm/trace.py): one process per rank;
"forward", "backward" and "wait for gradients" events on the "compute" row (recorded by
minidist/ddp/strategy.py), collectives on the group's row. Time 0 is the start of
that step's forward on rank 0 (ranks share one clock on one node).
"""
import argparse
import json
import sys

from minidist.train.args import Parser


def read_trace(path):
    """The events of the Chrome trace train_gpt.py --trace wrote at `path`; ValueError with
    one line saying what is wrong for anything else (a missing file, a --log-json file, a
    trace with no event: a run on one process sends nothing)."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (train_gpt.py --trace FILE writes it)") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path}: not a --trace file (one JSON document; a --log-json file "
                         "holds one per line)") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list) or not any(e.get("ph") == "X" for e in events):
        raise ValueError(f"{path}: no traced steps in it (train_gpt.py --trace FILE on more "
                         "than one rank writes them)")
    return events


def steps_of(events, rank):
    """[(start, end) of each step: its first forward to its wait for gradients] on `rank`."""
    compute = sorted((e for e in events if e.get("pid") == rank and e.get("ph") == "X"
                      and e.get("cat") == "compute"), key=lambda e: e["ts"])
    steps, start = [], None
    for e in compute:
        if e["name"] == "forward" and start is None:
            start = e["ts"]
        if e["name"] == "wait for gradients" and start is not None:
            steps.append((start, e["ts"] + e["dur"]))
            start = None
    return steps


def bar(t0, t1, lo, hi, width):
    """A row of `width` cells with the span [t0, t1) of [lo, hi) filled."""
    scale = width / max(hi - lo, 1e-9)
    a, b = int((t0 - lo) * scale), max(int((t1 - lo) * scale), int((t0 - lo) * scale) + 1)
    return "".join("#" if a <= i < b else "." for i in range(width))


def fail(line):
    """A user error: one line, exit status 2."""
    sys.stderr.write(line + "\n")
    sys.exit(2)


def draw(events, step, width, only=None):
    """Print step `step` (Python indexing: -1 is the last) of the traced steps, every rank."""
    ranks = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    ranks = [r for r in ranks if only is None or r in only]
    if not ranks:
        fail(f"error: --ranks {','.join(map(str, sorted(only)))}: none of them is in this "
             "trace")
    count = min(len(steps_of(events, r)) for r in ranks)
    if count == 0:
        fail("error: the trace holds no DDP or ZeRO step (no forward and backward on the "
             "compute rows: a --tp or --pp run's); open it in https://ui.perfetto.dev")
    if not -count <= step < count:
        fail(f"error: --step {step}: the trace holds steps 0 to {count - 1} "
             "(DDP steps: train_gpt.py --dp with --trace)")
    step %= count                      # -1 -> the last step's number, which is what we print
    windows = {r: steps_of(events, r)[step] for r in ranks}
    lo = windows[ranks[0]][0]
    hi = max(end for _, end in windows.values())
    print(f"step {step} (traced: 0 to {count - 1}): {(hi - lo) / 1e3:.1f} ms shown, {width} "
          f"columns ({(hi - lo) / 1e3 / width:.2f} ms each)")
    lines = []                         # (rank, label, event); labels right-aligned to the
    for r in ranks:                    # longest (ZeRO's "reduce_scatter 0.01 MiB" broke 22)
        start, end = windows[r]
        rows = sorted((e for e in events if e.get("pid") == r and e.get("ph") == "X"
                       and start <= e["ts"] <= end), key=lambda e: e["ts"])
        lines += [(r, e["name"] if e["cat"] == "compute" else
                   f"{e['name']} {e['args'].get('bytes', 0) / 2**20:.2f} MiB", e) for e in rows]
    w = max([22] + [len(label) for _, label, _ in lines])
    for r, label, e in lines:
        print(f"rank {r} {label:>{w}s} |{bar(e['ts'], e['ts'] + e['dur'], lo, hi, width)}| "
              f"{(e['ts'] - lo) / 1e3:7.1f} -{(e['ts'] + e['dur'] - lo) / 1e3:7.1f} ms")


def main():
    p = Parser(description=__doc__,     # a bad flag: one `error:` line, exit 2 (review 38)
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="the Chrome trace train_gpt.py --trace FILE wrote")
    p.add_argument("--step", type=int, default=-1, help="which step (default: the last)")
    p.add_argument("--width", type=int, default=60, help="columns of the bars (default: 60)")
    p.add_argument("--ranks", default=None, help="e.g. 0,3 (default: all)")
    args = p.parse_args()
    if args.width < 1:
        fail(f"error: --width {args.width}: give at least 1 column")
    if args.ranks is not None and not all(r.strip().isdigit() for r in args.ranks.split(",")):
        fail(f"error: --ranks {args.ranks}: give rank numbers separated by commas, e.g. 0,3")
    try:
        events = read_trace(args.trace)
    except ValueError as e:
        fail(f"error: {e}")
    only = None if args.ranks is None else {int(r) for r in args.ranks.split(",")}
    draw(events, args.step, args.width, only)


if __name__ == "__main__":
    main()
