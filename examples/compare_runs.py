"""Compare training runs side by side: one row per --log-json file of examples/train_gpt.py,
the flags that differ between the runs, and how each ended, best val loss first.

    python examples/compare_runs.py sweep/*.jsonl
    python examples/compare_runs.py sweep/*.jsonl --sort last_loss --json

A sweep's logs each end with a summary row naming the run (`"run": {"flags": ...}`), so the
table shows only the flags whose values differ (those the runs share, where not at their
defaults, are printed once, above it); the
paths a run writes (--log-json, --save, --trace, ...) and its own BLAS threads are left out.
Per run: the steps done of the schedule's, how it ended (finished, stopped by --stop-at,
diverged, evaluated by --eval-only, or no summary: still running, or cut off by a kill or a
signal, which write none; such a run's flags are unknown, "-"), the final val loss, the best
val loss seen and at which step (the console's `step N/total` and the checkpoint folder's
step-0000000N: the rows' "step", which counts from 0, plus 1), the last train loss and the
median tokens/s. A resumed run's log holds a summary per
part; the last one is the run's. The curves themselves: examples/plot.py.
Tests: tests/test_compare_runs.py.
"""
import json
import os
import statistics
import sys

from minidist.train.args import example_parser, train_parser

# flags that say where a run writes or how it is launched, not what it computes
NOT_COMPARED = ("log_json", "save", "resume", "trace", "cache_dir", "overwrite", "traceback",
                "threads", "save_every", "keep", "log_every", "async_save", "stop_at",
                "sample", "given", "peak_tflops")
SORTS = ("best_val_loss", "val_loss", "last_loss", "tokens_per_s")


def read_log(path):
    """The rows of one --log-json file (a half-written last line, a run cut off mid-row, is
    skipped); ValueError naming the file for anything else that is not a JSON object."""
    rows = []
    with open(path) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON: is it a --log-json file "
                             "of examples/train_gpt.py?") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {i + 1} is not a JSON object")
        rows.append(row)
    return rows


def ending(summary):
    """How a run's last summary row says it ended."""
    if summary is None:
        return "no summary (running, or cut off)"
    if summary.get("diverged"):
        return f"diverged at step {summary['steps']}"
    if summary.get("stopped_at") is not None:
        return f"stopped at {summary['stopped_at']}"
    return "evaluated (--eval-only)" if summary.get("eval_only") else "finished"


def summarize(path, rows):
    """One run's row of the table, from its log's rows."""
    steps = [r for r in rows if "step" in r and "loss" in r]
    summaries = [r for r in rows if r.get("final")]
    last = summaries[-1] if summaries else None
    evals = [(r["step"], r["val_loss"]) for r in rows if "step" in r and "val_loss" in r]
    best = min(evals, key=lambda e: e[1]) if evals else None
    speeds = [r["tokens_per_s"] for r in steps if r.get("tokens_per_s")]
    flags = (last or {}).get("run", {}).get("flags", {})
    return {"run": os.path.splitext(os.path.basename(path))[0], "path": path,
            "flags": {k: v for k, v in flags.items() if k not in NOT_COMPARED},
            "steps": last["steps"] if last else (steps[-1]["step"] + 1 if steps else 0),
            "schedule_steps": (last or {}).get("schedule_steps", flags.get("steps")),
            "ended": ending(last),
            "val_loss": None if last is None or last.get("diverged") else last.get("val_loss"),
            "best_val_loss": best[1] if best else None,
            "best_val_step": best[0] + 1 if best else None,     # the console's step
            "last_loss": steps[-1]["loss"] if steps else None,
            "tokens_per_s": statistics.median(speeds) if speeds else None}


def differing(runs, defaults):
    """(the flags whose values differ between the runs, in the first run's order (and what
    a run's record adds: its data's digest); the flags every run shares, where that is not
    train_gpt.py's default, `defaults`)."""
    known = [r for r in runs if r["flags"]] or runs     # (a run without a summary: unknown)
    names = []
    for r in known:
        names += [k for k in r["flags"] if k not in names]
    values = {k: {json.dumps(r["flags"].get(k)) for r in known} for k in names}
    shared = {k: known[0]["flags"].get(k) for k in names if len(values[k]) == 1}
    return ([k for k in names if len(values[k]) > 1],
            {k: v for k, v in shared.items() if k in defaults and v != defaults[k]})


def _cell(value):
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1e4:
            return f"{value:,.0f}"
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)


def table(runs, keys):
    """The text table: run, the differing flags `keys` (as flags: a sweep over --steps had
    two "steps" columns, the flag's and the steps done), then the results."""
    head = ["run", *[f"--{k.replace('_', '-')}" for k in keys], "steps", "ended", "val loss",
            "best val (step)", "last loss", "tokens/s"]
    body = [[r["run"], *[_cell(r["flags"].get(k)) if r["flags"] else "-" for k in keys],
             f"{r['steps']}/{_cell(r['schedule_steps'])}", r["ended"], _cell(r["val_loss"]),
             "-" if r["best_val_loss"] is None else
             f"{_cell(r['best_val_loss'])} ({r['best_val_step']})",
             _cell(r["last_loss"]), _cell(r["tokens_per_s"])] for r in runs]
    widths = [max(len(str(row[i])) for row in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in [head] + body)


def main(argv=None):
    p = example_parser(__doc__)
    p.add_argument("logs", nargs="+", help="--log-json files of examples/train_gpt.py")
    p.add_argument("--sort", choices=SORTS, default="best_val_loss",
                   help="the column the rows are ordered by (lowest first; tokens/s highest "
                   "first); runs without it last")
    p.add_argument("--json", action="store_true", help="one JSON object per run instead")
    args = p.parse_args(argv)
    runs = []
    for path in args.logs:
        try:
            runs.append(summarize(path, read_log(path)))
        except OSError as e:
            p.error(f"{path}: {e.strerror or e}")
        except ValueError as e:
            p.error(str(e))
    sign = -1 if args.sort == "tokens_per_s" else 1
    runs.sort(key=lambda r: (r[args.sort] is None, sign * (r[args.sort] or 0)))
    if args.json:
        for r in runs:
            print(json.dumps(r))
        return
    keys, shared = differing(runs, vars(train_parser().parse_args([])))
    if shared:
        print("the same in every run, off train_gpt.py's defaults: " + ", ".join(
            f"{k} {_cell(v)}" for k, v in shared.items()))
    print(table(runs, keys))


if __name__ == "__main__":
    sys.exit(main())
