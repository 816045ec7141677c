"""examples/compare_runs.py: a sweep's --log-json files side by side (walk 41: no view of a
sweep told which run won). Three real runs of a tiny model (two learning rates, and a third
with another --beta2 stopped by --stop-at), read back: the flags that differ, how each run
ended, its val losses, best first; a half-written last row skipped, a file that is no log one
error line.

    python -m pytest -q tests/test_compare_runs.py
"""
import json
import os
import subprocess
import sys

import pytest

from minidist.train.loop import train
from tests.mpirun import ROOT
from tests.train_cases import _args, _rows

SCRIPT = os.path.join(ROOT, "examples", "compare_runs.py")


@pytest.fixture(scope="module")
def sweep(corpus, tmp_path_factory, device):
    """{name: log path} of three runs: --lr 1e-3, --lr 1e-2, and --lr 3e-2 --beta2 0.99
    --stop-at 4 (of 6 steps), each evaluated every 2 steps."""
    tmp = tmp_path_factory.mktemp("sweep")
    runs = {"slow": ["--lr", "1e-3"], "fast": ["--lr", "1e-2"],
            "cut": ["--lr", "3e-2", "--beta2", "0.99", "--stop-at", "4"]}
    logs = {}
    for name, flags in runs.items():
        logs[name] = tmp / f"{name}.jsonl"
        train(_args(device, corpus, tmp, "--steps", "6", "--eval-every", "2", *flags,
                    "--log-json", str(logs[name])))
    return logs


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_the_runs_side_by_side_best_first(sweep):
    out = _run(*sweep.values())
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("the same in every run, off train_gpt.py's defaults: n_layer 1")
    assert lines[1].split() == ["run", "--lr", "--beta2", "steps", "ended", "val", "loss",
                                "best", "val", "(step)", "last", "loss", "tokens/s"]
    rows = {line.split()[0]: line for line in lines[2:]}
    best = {n: min(r["val_loss"] for r in _rows(log) if "step" in r and "val_loss" in r)
            for n, log in sweep.items()}
    assert list(rows) == sorted(best, key=best.get)                # best val loss first
    assert "4/6" in rows["cut"] and "stopped at 4" in rows["cut"] and " 0.99 " in rows["cut"]
    # the best val loss's step is the console's (`step 4/6 | val loss`), as "stopped at 4"
    # is: it was the rows' (3), counted from 0 (first-use walk, session 35)
    for name, log in sweep.items():
        step = min((r["val_loss"], r["step"]) for r in _rows(log) if "val_loss" in r
                   and "step" in r)[1]
        assert f" ({step + 1}) " in rows[name], rows[name]
    assert "6/6" in rows["fast"] and "finished" in rows["fast"] and " 0.95 " in rows["fast"]


def test_the_json_rows_are_the_logs_numbers(sweep):
    out = _run(*sweep.values(), "--json", "--sort", "last_loss")
    runs = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["last_loss"] for r in runs] == sorted(r["last_loss"] for r in runs)
    for r in runs:
        rows = _rows(sweep[r["run"]])
        summary = rows[-1]
        evals = [(x["step"], x["val_loss"]) for x in rows if "step" in x and "val_loss" in x]
        assert r["val_loss"] == summary["val_loss"] and r["steps"] == summary["steps"]
        step, loss = min(evals, key=lambda e: e[1])     # the rows' step counts from 0
        assert (r["best_val_step"], r["best_val_loss"]) == (step + 1, loss)
        assert r["last_loss"] == [x["loss"] for x in rows if "loss" in x][-1]
        assert "log_json" not in r["flags"] and r["flags"]["lr"] in (1e-3, 1e-2, 3e-2)
    assert {r["run"]: r["ended"] for r in runs} == {"slow": "finished", "fast": "finished",
                                                    "cut": "stopped at 4"}


def test_a_cut_off_log_is_read_and_a_file_that_is_no_log_is_one_error_line(sweep, tmp_path):
    cut = tmp_path / "killed.jsonl"
    rows = open(sweep["fast"]).read().splitlines()[:3]
    cut.write_text("\n".join(rows) + '\n{"step": 3, "lo')           # a kill -9 mid-row
    out = _run(cut, "--json")
    run, = [json.loads(line) for line in out.stdout.splitlines()]
    assert run["ended"] == "no summary (running, or cut off)" and run["steps"] == 3
    out = _run(cut, *sweep.values())            # beside finished runs: its flags unknown
    head, = [line for line in out.stdout.splitlines() if line.startswith("run ")]
    row, = [line for line in out.stdout.splitlines() if "no summary" in line]
    assert head.split()[:3] == ["run", "--lr", "--beta2"] and row.split()[:4] == \
        ["killed", "-", "-", "3/-"], out.stdout
    bad = tmp_path / "notes.jsonl"
    bad.write_text("my notes\n{}\n")
    out = _run(bad)
    assert out.returncode == 2 and out.stderr.startswith(
        f"error: {bad}: line 1 is not JSON: is it a --log-json file") and \
        len(out.stderr.splitlines()) == 1
    out = _run(tmp_path / "missing.jsonl")
    assert out.returncode == 2 and "missing.jsonl: No such file" in out.stderr


def test_an_eval_only_log_says_it_was_evaluated(sweep, tmp_path):
    """An --eval-only run's log (its summary row alone) ended "evaluated (--eval-only)",
    not "finished" as if it had trained (first-use walk, session 35)."""
    log = tmp_path / "eval.jsonl"
    log.write_text(json.dumps({"final": True, "val_loss": 4.5, "steps": 6, "eval_only": True,
                               "schedule_steps": None}) + "\n")
    out = _run(log, sweep["fast"], "--json")
    ended = {r["run"]: r["ended"] for r in map(json.loads, out.stdout.splitlines())}
    assert ended == {"eval": "evaluated (--eval-only)", "fast": "finished"}, out.stderr
