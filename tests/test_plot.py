"""examples/plot.py: loss, tokens/s and memory curves from --log-json files, and the DDP
timeline from a --trace file, to PNG. Skipped where matplotlib is not installed
(pip install -e ".[plot]").

    python examples/plot.py a.jsonl b.jsonl -o curves.png --labels "1 rank,DDP"
    python examples/plot.py --trace ddp_trace.json -o timeline.png
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from mpirun import ROOT

PNG = b"\x89PNG\r\n\x1a\n"


def write_log(path, steps, scale=1.0):
    """A --log-json file as train_gpt.py writes it: one row per step, then the final row."""
    with open(path, "w") as f:
        for s in range(steps):
            mem = {"params": 1000, "grads": 1000, "optimizer": 2000, "activations": 5000,
                   "total": int(9000 * scale)}
            f.write(json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3,
                                "tokens_per_s": 1000.0 * scale, "ms_per_step": 10.0,
                                "grad_norm": 1.0, "mem": mem, "comm_bytes": 0}) + "\n")
        f.write(json.dumps({"final": True, "val_loss": 4.0, "steps": steps}) + "\n")


def write_trace(path, ranks=2, steps=2):
    """A Chrome trace with the compute spans and bucket all-reduces ddp_timeline.py reads."""
    events, t = [], 0
    for _ in range(steps):
        for r in range(ranks):
            spans = [("forward", "compute", 0, 10), ("backward", "compute", 10, 30),
                     ("all_reduce", "dp", 20, 8), ("all_reduce", "dp", 29, 9),
                     ("wait for gradients", "compute", 40, 5)]
            events += [{"ph": "X", "pid": r, "tid": 0, "name": n, "cat": c, "ts": t + a,
                        "dur": d, "args": {"bytes": 4096}} for n, c, a, d in spans]
        t += 100
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)


def plot(*args):
    return subprocess.run([sys.executable, "examples/plot.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_curves_and_timeline_to_png(tmp_path):
    pytest.importorskip("matplotlib")
    a, b, t = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "trace.json"
    write_log(a, 20)
    write_log(b, 20, scale=0.5)
    write_trace(t)
    for extra, out in (([a, b, "--labels", "1 rank,DDP"], "curves.png"),
                       (["--trace", t], "timeline.png"),
                       ([a, "--trace", t, "--step", "0"], "both.png")):
        done = plot(*extra, "-o", tmp_path / out)
        assert done.returncode == 0, done.stderr
        data = (tmp_path / out).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, (out, len(data))


def test_bad_input_is_one_line(tmp_path):
    """Missing log, missing trace, a step the trace lacks, labels that do not match: one
    `error:` line, exit status 2 (matplotlib or not, for the first two)."""
    pytest.importorskip("matplotlib")
    t = tmp_path / "trace.json"
    write_trace(t)
    write_log(tmp_path / "a.jsonl", 3)
    (tmp_path / "b.jsonl").write_text('{"step": 0, "loss": 5.0}\n{"step": 1, "loss": 4.9}\n')
    for args in ([tmp_path / "missing.jsonl"], ["--trace", tmp_path / "missing.json"],
                 ["--trace", t, "--step", "5"], ["--trace", tmp_path / "b.jsonl"],
                 [tmp_path / "a.jsonl", "--labels", "x,y"]):
        done = plot(*args, "-o", tmp_path / "x.png")
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), (
            args, done.stderr)


def test_the_output_is_checked_before_plotting(tmp_path):
    """-o x.txt (a format matplotlib does not write) or -o x (none: it wrote x.png) is one
    `error:` line, exit 2; -o into a folder that does not exist makes it (each was a
    traceback after the plotting: first-use walk, session 35)."""
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "a.jsonl", 3)
    for out in ("x.txt", "x"):
        done = plot(tmp_path / "a.jsonl", "-o", tmp_path / out)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"error: -o '{tmp_path / out}': give a file name ending "
                                   "in one of the formats matplotlib writes: "), lines[0]
        assert "png" in lines[0] and not os.path.exists(tmp_path / out)
    done = plot(tmp_path / "a.jsonl", "-o", tmp_path / "new" / "c.png")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "new" / "c.png").read_bytes().startswith(PNG)


def test_curves_are_drawn_at_the_consoles_steps(tmp_path, monkeypatch):
    """A row's "step" counts from 0; the curves and val markers are drawn at the console's
    `step N/total` (and the checkpoint folder's) N = step + 1: an evaluation printed at
    step 10/20 was drawn at 9 (first-use walk, session 35)."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    import plot as plot_module
    log = tmp_path / "a.jsonl"
    write_log(log, 20)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    rows[9]["val_loss"] = 4.2                        # evaluated after the 10th step
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = plt.figure()
    axes = [fig.add_subplot(1, 3, c + 1) for c in range(3)]
    plot_module.plot_curves(axes, [plot_module.read_log(str(log))], ["a"])
    loss, val = axes[0].lines[:2]
    assert list(loss.get_xdata()) == list(range(1, 21))
    assert list(val.get_xdata()) == [10] and list(val.get_ydata()) == [4.2]
    assert list(axes[1].lines[0].get_xdata())[0] == 1 and axes[2].lines[0].get_xdata()[0] == 1
    plt.close(fig)


def test_ddp_timeline_text(tmp_path):
    """examples/ddp_timeline.py names the step it draws (not `step -1`), refuses a step the
    trace lacks in one line, and its --help is the whole docstring."""
    t = tmp_path / "trace.json"
    write_trace(t, ranks=2, steps=3)
    run = [sys.executable, "examples/ddp_timeline.py"]
    done = subprocess.run(run + [str(t)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("step 2 (traced: 0 to 2)"), \
        done.stdout
    assert "step -1" not in done.stdout and done.stdout.count("all_reduce") == 4, done.stdout
    # every bar starts in one column, a ZeRO trace's long "reduce_scatter 0.01 MiB" too
    events = json.loads(t.read_text())["traceEvents"]
    for e in events:
        e["name"] = "reduce_scatter" if e["name"] == "all_reduce" else e["name"]
    t.write_text(json.dumps({"traceEvents": events}))
    done = subprocess.run(run + [str(t)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    bars = {line.index("|") for line in done.stdout.splitlines()[1:]}
    assert len(bars) == 1 and "reduce_scatter" in done.stdout, done.stdout
    bad = subprocess.run(run + [str(t), "--step", "3"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --step 3"), bad.stderr
    # not a trace, none at all, no step in it: one line each (they were tracebacks)
    log, empty = tmp_path / "run.jsonl", tmp_path / "empty.json"
    log.write_text('{"step": 0, "loss": 5.0}\n{"step": 1, "loss": 4.9}\n')
    empty.write_text('{"traceEvents": []}')
    for path, says in ((tmp_path / "missing.json", "no such file"), (log, "not a --trace "
                       "file"), (empty, "no traced steps in it")):
        bad = subprocess.run(run + [str(path)], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and bad.stderr == f"error: {path}: {says}" + \
            bad.stderr.split(says, 1)[1] and bad.stderr.count("\n") == 1, bad.stderr
    # a --tp/--pp trace (collectives, no DDP step), a zero width, ranks not numbers: one line
    # each (found by a first-use walk: "--step -1: ... steps 0 to -1", two tracebacks)
    tp = tmp_path / "tp.json"
    tp.write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 0, "tid": 1, "cat": "comm",
                                               "name": "all_reduce", "ts": 0, "dur": 5,
                                               "args": {"bytes": 64}}]}))
    for flags, says in (([str(tp)], "error: the trace holds no DDP or ZeRO step"),
                        ([str(t), "--width", "0"], "error: --width 0: give at least 1"),
                        ([str(t), "--ranks", "a"], "error: --ranks a: give rank numbers")):
        bad = subprocess.run(run + flags, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith(says) and \
            bad.stderr.count("\n") == 1, bad.stderr
    helptext = subprocess.run(run + ["--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60).stdout
    assert "mpirun -n 4 python examples/train_gpt.py" in helptext and "one node)" in helptext


def test_identical_runs_get_distinct_styles(tmp_path):
    """Three logs with the same numbers (what exact strategies produce): every curve its own
    color, line style and marker, the markers at different steps, so none hides another.
    Checked on plot_curves' lines; by hand: python examples/plot.py a.jsonl a.jsonl -o x.png"""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    sys.path.insert(0, os.path.join(ROOT, "examples"))    # plot.py imports ddp_timeline
    try:
        spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "examples",
                                                                           "plot.py"))
        plot_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plot_module)
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    write_log(tmp_path / "a.jsonl", 40)
    logs = [plot_module.read_log(tmp_path / "a.jsonl")] * 3
    fig, axes = plt.subplots(1, 3)
    plot_module.plot_curves(axes, logs, ["one", "ddp", "zero3"])
    for ax in axes:
        runs = [line for line in ax.lines if line.get_label() in ("one", "ddp", "zero3")
                or line.get_label().endswith(" total")]
        assert len(runs) == 3, [line.get_label() for line in ax.lines]
        for look in (lambda x: x.get_color(), lambda x: str(x.get_linestyle()),
                     lambda x: x.get_marker(), lambda x: str(x.get_markevery())):
            assert len({look(line) for line in runs}) == 3
    plt.close(fig)


@pytest.mark.mpi
@pytest.mark.slow
def test_readme_pictures_script_makes_both_pictures(tmp_path, corpus):
    """The README's command, short and small (the real one: bash examples/readme_pictures.sh):

        STEPS=3 TRACE_STEPS=2 OUT=DIR bash examples/readme_pictures.sh --data CORPUS ...
    """
    pytest.importorskip("matplotlib")
    from mpirun import mpi_env, mpiexec, run_job
    env = mpi_env(STEPS=3, TRACE_STEPS=2, OUT=tmp_path, PYTHON=sys.executable, MPIRUN=mpiexec())
    # the script runs $MPIRUN: on a timeout run_job kills its process group, ranks included
    run_job(["bash", "examples/readme_pictures.sh", "--data", corpus, "--cache-dir",
             tmp_path / "cache", "--block-size", "16", "--batch-size", "4", "--eval-iters",
             "1"], env=env, timeout=300)
    for name in ("loss_1rank_ddp_zero3.png", "ddp_timeline.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG), name
