"""Plot training runs (train_gpt.py --log-json) and a DDP step (--trace) to a PNG.

    pip install -e ".[plot]"                                      # matplotlib, only for this
    python examples/plot.py single.jsonl ddp.jsonl zero3.jsonl -o curves.png \\
        --labels "1 rank,DDP x2,ZeRO-3 x2"
    python examples/plot.py --trace ddp_trace.json -o timeline.png          # the last step
    python examples/plot.py run.jsonl --trace ddp_trace.json -o both.png --step 3

Curves, one line per log file, against step: loss (train, and validation as markers), tokens/s,
and memory per rank from the log's ledger (rank 0's row: total, and model states = parameters +
gradients + optimizer, thinner and paler). Runs of the same global batch and seed should lie on
top of each other however they are parallelised, so each run has its own color, line style and
marker (`STYLES`; the markers of different runs at different steps): identical curves stay
visible one over the other. A Mixture-of-Experts run (--moe-experts) adds a row: the share
of tokens each expert took per step, and the share dropped. The timeline is
examples/ddp_timeline.py's picture: per rank, the forward, backward and "wait for gradients"
spans above the all-reduces.

Tests: tests/test_plot.py (skipped where matplotlib is not installed).
"""
import argparse
import json
import os
import sys

from ddp_timeline import read_trace, steps_of

from minidist.train.args import Parser, a_path

MiB = 2 ** 20
# (line style, marker) per run, in order: curves that coincide still tell apart
STYLES = [("-", "o"), ((0, (5, 3)), "s"), (":", "^"), ("-.", "D"), ((0, (1, 1)), "v"),
          ((0, (8, 2, 1, 2)), "x")]
COLORS = {"forward": "tab:blue", "backward": "tab:orange", "wait for gradients": "tab:red"}


def fail(line):
    sys.stderr.write(f"error: {line}\n")
    sys.exit(2)


def read_log(path):
    """(step rows, final row or None) of one --log-json file."""
    if not os.path.isfile(path):
        fail(f"log {path!r} not found: give files written by train_gpt.py --log-json FILE")
    rows, final = [], None
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                fail(f"{path} line {n} is not JSON: is it a --log-json file?")
            if row.get("final"):
                final = row
            elif "step" in row:
                rows.append(row)
    if not rows:
        fail(f"{path} holds no step rows: train_gpt.py --log-json writes one per step")
    return rows, final


def run_style(i, n_points, runs):
    """Run i's color, line style and marker; ~8 markers per curve, each run's at other steps."""
    every = max(n_points // 8, 1)
    ls, marker = STYLES[i % len(STYLES)]
    return {"color": f"C{i}", "ls": ls, "marker": marker, "ms": 5, "mfc": "none",
            "markevery": (i * every // max(runs, 1) % every, every)}


def console_step(row):
    """A log row's step as the console printed it (`step N/total`, the checkpoint folders'
    step-0000000N): its "step", which counts from 0, plus 1 (first-use walk, session 35: an
    evaluation the console printed at step 10 was drawn at 9)."""
    return row["step"] + 1


def plot_curves(axes, logs, labels):
    """Loss, tokens/s and memory per rank against step (console_step), one color, line
    style and marker per run (run_style)."""
    ax_loss, ax_tok, ax_mem = axes
    for i, ((rows, final), label) in enumerate(zip(logs, labels)):
        color = f"C{i}"
        steps = [console_step(r) for r in rows]
        style = run_style(i, len(rows), len(logs))
        ax_loss.plot(steps, [r["loss"] for r in rows], lw=1.2, label=label, **style)
        val = [(console_step(r), r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        if final is not None and final.get("val_loss") is not None and not val:
            # a log from before the evaluating steps' rows held their val loss: the end's
            val.append((final.get("steps", steps[-1]), final["val_loss"]))
        if val:
            ax_loss.plot(*zip(*val), "*", color=color, ms=9, ls="none",
                         label=f"{label} (val)")
        timed = [(console_step(r), r["tokens_per_s"]) for r in rows if r.get("tokens_per_s")]
        if timed:
            ax_tok.plot(*zip(*timed), lw=1.2, label=label, **style)
        mem = [(console_step(r), r["mem"]) for r in rows if isinstance(r.get("mem"), dict)]
        if mem:
            x = [s for s, _ in mem]
            ax_mem.plot(x, [m.get("total", 0) / MiB for _, m in mem], lw=1.2,
                        label=f"{label} total", **style)
            states = [sum(m.get(k, 0) for k in ("params", "grads", "optimizer")) / MiB
                      for _, m in mem]
            ax_mem.plot(x, states, lw=0.8, alpha=0.5, label=f"{label} model states", **style)
    for ax, title, unit in ((ax_loss, "loss", "nats/token"), (ax_tok, "throughput", "tokens/s"),
                            (ax_mem, "memory per rank (rank 0's ledger)", "MiB")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="center right" if ax is ax_mem else "best")


def plot_expert_load(ax, log, label):
    """Mixture of Experts (--moe-experts): the share of the routed tokens each expert kept,
    summed over the MoE blocks, per step (1/E each when balanced), and the share dropped for
    lack of capacity (dashed). Over the global batch (each rank's last micro-batch)."""
    rows = [r for r in log[0] if "moe_tokens" in r]
    steps = [console_step(r) for r in rows]
    kept = [[sum(col) for col in zip(*r["moe_tokens"])] for r in rows]     # (steps, E)
    routed = [sum(k) + sum(r["moe_dropped"]) for k, r in zip(kept, rows)]
    for e in range(len(kept[0])):
        ax.plot(steps, [k[e] / n for k, n in zip(kept, routed)], lw=1.2, label=f"expert {e}")
    ax.plot(steps, [sum(r["moe_dropped"]) / n for r, n in zip(rows, routed)], "k--", lw=1.0,
            label="dropped")
    ax.axhline(1 / len(kept[0]), color="gray", lw=0.6)
    ax.set_title(f"{label}: tokens per expert (share of the routed assignments)")
    ax.set_xlabel("step")
    ax.set_ylabel("share")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def plot_timeline(ax, events, step):
    """One DDP step: per rank a compute row (forward, backward, wait) and a row of
    all-reduces; time 0 is the step's first forward on the lowest rank."""
    ranks = sorted({e["pid"] for e in events if e.get("ph") == "X"})
    count = min((len(steps_of(events, r)) for r in ranks), default=0)
    if count == 0:
        fail("the trace holds no DDP or ZeRO step (no forward and backward on the compute "
             "rows: a --tp or --pp run's); open it in https://ui.perfetto.dev")
    if not -count <= step < count:
        fail(f"--step {step}: the trace holds DDP steps 0 to {count - 1} (train_gpt.py --dp "
             "with --trace)")
    step %= count
    windows = {r: steps_of(events, r)[step] for r in ranks}
    lo = min(start for start, _ in windows.values())
    ticks = []
    for i, r in enumerate(ranks):
        start, end = windows[r]
        y = 3 * (len(ranks) - 1 - i)
        for e in events:
            if e.get("pid") != r or e.get("ph") != "X" or not start <= e["ts"] <= end:
                continue
            span = [((e["ts"] - lo) / 1e3, max(e["dur"] / 1e3, 0.05))]
            if e.get("cat") == "compute":
                ax.broken_barh(span, (y + 1.5, 1), color=COLORS.get(e["name"], "tab:gray"))
            else:
                ax.broken_barh(span, (y + 0.3, 1), color="tab:green", edgecolor="black",
                               lw=0.3)
        ticks += [(y + 0.8, f"rank {r} comm"), (y + 2.0, f"rank {r} compute")]
    ax.set_yticks([t for t, _ in ticks], [name for _, name in ticks], fontsize=8)
    handles = [ax.bar(0, 0, color=c, label=n) for n, c in COLORS.items()]
    handles.append(ax.bar(0, 0, color="tab:green", label="all_reduce (one per bucket)"))
    ax.set_ylim(-0.2, 3 * len(ranks) + 1.2)      # room above the top rank for the legend
    ax.legend(handles=handles, fontsize=7, loc="upper left", ncol=4)
    ax.set_xlabel("ms since the step's first forward")
    ax.set_title(f"DDP step {step} (traced: 0 to {count - 1}): when each bucket's "
                 "all-reduce ran")
    ax.grid(axis="x", alpha=0.3)


def main():
    p = Parser(description=__doc__,     # a bad flag: one `error:` line, exit 2 (review 38)
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="*", metavar="LOG.jsonl", help="train_gpt.py --log-json files")
    p.add_argument("-o", "--out", required=True, metavar="OUT.png", help="the PNG to write")
    p.add_argument("--labels", default=None, help="comma-separated, one per log (default: names)")
    p.add_argument("--trace", type=a_path, default=None, metavar="FILE",
                   help="train_gpt.py --trace FILE")
    p.add_argument("--step", type=int, default=-1, help="the traced step to draw (-1: last)")
    args = p.parse_args()
    if not args.logs and not args.trace:
        fail("nothing to plot: give --log-json files and/or --trace FILE")
    labels = args.labels.split(",") if args.labels else [os.path.basename(f) for f in args.logs]
    if len(labels) != len(args.logs):
        fail(f"--labels has {len(labels)} names for {len(args.logs)} logs")
    try:
        import matplotlib
    except ImportError:
        fail('examples/plot.py needs matplotlib: pip install -e ".[plot]"')
    matplotlib.use("Agg")          # files only, no window
    from matplotlib import pyplot as plt
    check_out(args.out, plt.figure().canvas.get_supported_filetypes())
    logs = [read_log(f) for f in args.logs]
    events = None
    if args.trace:
        try:
            events = read_trace(args.trace)
        except ValueError as e:
            fail(f"--trace {e}")
    moe = [(log, label) for log, label in zip(logs, labels)
           if any("moe_tokens" in r for r in log[0])]
    rows = bool(logs) + bool(moe) + bool(events)
    fig = plt.figure(figsize=(13, 4 * rows), layout="constrained")
    grid = fig.add_gridspec(rows, 3)
    if logs:
        plot_curves([fig.add_subplot(grid[0, c]) for c in range(3)], logs, labels)
    if moe:
        plot_expert_load(fig.add_subplot(grid[1, :2]), *moe[0])
    if events:
        plot_timeline(fig.add_subplot(grid[rows - 1, :]), events, args.step)
    try:
        fig.savefig(args.out, dpi=80)
    except OSError as e:
        fail(f"-o {args.out}: {e.strerror or e}")
    print(f"wrote {args.out}")


def check_out(out, kinds):
    """-o before any log is read: a file name ending in a format matplotlib writes (`kinds`:
    its extensions), its folder made. Both were a traceback after the plotting (first-use
    walk, session 35): `-o x.txt` matplotlib's ValueError, `-o new/x.png` a
    FileNotFoundError; `-o x` was written as x.png."""
    kind = os.path.splitext(out)[1][1:].lower()
    if kind not in kinds:
        fail(f"-o {out!r}: give a file name ending in one of the formats matplotlib writes: "
             f"{', '.join(sorted(kinds))} (e.g. -o curves.png)")
    try:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    except OSError as e:
        fail(f"-o {out}: cannot make its folder ({e.strerror or e})")


if __name__ == "__main__":
    main()
