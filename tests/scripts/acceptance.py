"""The verdicts of tests/gpu_acceptance.sh: each call reads one check's output and prints one
JSON line {"check", "ok", "rc", "seconds", "log", ...details}; the exit status is 0 either
way (the script goes on to the next check; `summary` exits 1 if any check failed).

    acceptance.py pytest NAME RC SECONDS LOG EMPTY    pytest's summary counts; EMPTY is
                                                      allow-empty (all skipped is ok: the
                                                      gpu tests on a CPU) or need-tests
    acceptance.py curve NAME RC SECONDS LOG LOGJSON   --log-json rows: finite, decreasing
    acceptance.py val NAME RC SECONDS LOG DEV CPU TOL final val_loss within TOL of the CPU's
    acceptance.py json NAME RC SECONDS LOG            the last JSON line the command printed
    acceptance.py bench NAME RC SECONDS LOG           a step benchmark's JSON line (bench_step.py
                                                      or the PyTorch peer): ran, loss finite
    acceptance.py summary RESULTS...                  one line: how many checks passed
    acceptance.py speed RESULTS...                    tests/gpu_speed.sh's table: each run's
                                                      tokens/s over the peer's (PEER_RUN)
(several RESULTS files: tests/gpu_session.sh's parts, read as one; the bench rows alone make
the speed table, the summary and speed rows of a part are left out of both)

Tested on the CPU by tests/test_gpu_acceptance.py.
"""
import json
import math
import re
import sys


def pytest_counts(text):
    """{"passed": n, "failed": n, ...} from pytest's last summary line ("3 failed, 5 passed,
    2 skipped in 4.1s"); {} when there is none."""
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    if not lines:
        return {}
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|"
                                             r"deselected|xfailed|xpassed)", lines[-1])}


def read_log_json(path):
    """(step rows, the final row or None) of a train_gpt.py --log-json file."""
    try:
        rows = [json.loads(line) for line in open(path) if line.strip()]
    except (OSError, ValueError):
        return [], None
    final = [r for r in rows if r.get("final")]
    return [r for r in rows if "loss" in r and not r.get("final")], final[-1] if final else None


def curve(path):
    """Finite and decreasing: every loss finite, the mean of the last 3 below the first 3's."""
    rows, final = read_log_json(path)
    losses = [r["loss"] for r in rows]
    out = {"steps": len(losses), "first": losses[:3], "last": losses[-3:],
           "val_loss": final.get("val_loss") if final else None}
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    out["ok"] = (finite and len(losses) >= 4
                 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3)
    return out


def val(dev_path, cpu_path, tol):
    """The device's final val_loss within `tol` (relative) of the CPU's."""
    dev, cpu = read_log_json(dev_path)[1] or {}, read_log_json(cpu_path)[1] or {}
    a, b = dev.get("val_loss"), cpu.get("val_loss")
    ok = a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
    ratio = a / b - 1 if ok else None
    return {"val_loss": a, "cpu_val_loss": b, "rel_diff": ratio, "tol": tol,
            "ok": bool(ok and abs(ratio) <= tol)}


def last_json(text):
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return {}


PEER_RUN = "torch_eager_bf16"          # issue 21's yardstick: PyTorch eager, bf16 autocast
TARGET_RATIO, TARGET_KERNELS = 1.0, 1500


def bench(text):
    """A step benchmark's last JSON line; ok when it has a positive tokens/s and, if it says
    its loss, a finite one (the first GPU run's fp32 step was fast and NaN)."""
    out = last_json(text)
    loss, tps = out.get("loss"), out.get("tokens_per_s")
    out["ok"] = (isinstance(tps, (int, float)) and tps > 0
                 and (loss is None or math.isfinite(loss)))
    return out


def speed(rows):
    """The speed table: per benchmark run its tokens/s, ms/step, kernels/step, host reads per
    step (bench_step's; 0 expected for bf16_new: the --amp verdict on the device), MFU and
    tokens/s over PEER_RUN's (None without the peer); ok when every run gave a verdict of ok."""
    runs = [r for r in rows if r.get("check") not in ("summary", "speed")]
    peer = next((r.get("tokens_per_s") for r in runs if r["check"] == PEER_RUN and r["ok"]),
                None)
    table = {}
    for r in runs:
        tps = r.get("tokens_per_s") if r["ok"] else None
        ratio = round(tps / peer, 3) if tps and peer else None
        kernels = r.get("kernels_per_step")
        table[r["check"]] = {
            "tokens_per_s": tps, "ms_per_step": r.get("ms_per_step"), "mfu": r.get("mfu"),
            "kernels_per_step": kernels, "host_reads_per_step": r.get("host_reads_per_step"),
            "vs_" + PEER_RUN: ratio,
            "meets_targets": (None if ratio is None or kernels is None else
                              ratio >= TARGET_RATIO and kernels <= TARGET_KERNELS)}
    failed = [r["check"] for r in runs if not r["ok"] and not r.get("skipped")]
    skipped = [r["check"] for r in runs if r.get("skipped")]
    graphs = {run: graph_check(runs, run, eager) for run, eager in GRAPH_PAIRS}
    failed += [f"{run} (its loss or dropout step is not {eager}'s)" for run, eager in GRAPH_PAIRS
               if graphs[run] is not None and not graphs[run]["ok"]]
    return {"check": "speed", "ok": bool(runs) and not failed and not skipped,
            "failed": failed, "skipped": skipped, "peer": PEER_RUN if peer else None,
            "runs": table, "graphs": graphs}


# (captured run, its eager twin): tests/gpu_speed.sh's CUDA graph runs, without and with
# dropout (the masks' step on the device: each replay must draw its own step's masks)
GRAPH_PAIRS = (("bf16_new_graph", "bf16_new"), ("bf16_new_drop_graph", "bf16_new_drop"))
GRAPH_TOL = 1e-3


def graph_check(runs, graph_run, eager_run):
    """A replayed CUDA graph must train as the eager steps do: graph_run's loss after the
    same steps as its eager twin's, to GRAPH_TOL (both deterministic: equal bits expected,
    unless cuBLAS picks other algorithms under capture), and with dropout the same step
    drawn last ("dropout_step", read back from the device). None when either did not run
    ok."""
    by = {r["check"]: r for r in runs if r["ok"]}
    if graph_run not in by or eager_run not in by:
        return None
    a, b = by[graph_run].get("loss"), by[eager_run].get("loss")
    if a is None or b is None:
        return None
    diff = abs(a / b - 1)
    steps = by[graph_run].get("dropout_step"), by[eager_run].get("dropout_step")
    return {"loss": a, "eager_loss": b, "rel_diff": diff, "tol": GRAPH_TOL,
            "dropout_steps": steps, "ok": diff <= GRAPH_TOL and steps[0] == steps[1]}


def results(paths):
    """The check rows of RESULTS files, in order; their own summary and speed rows left out."""
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    return [r for r in rows if r.get("check") not in ("summary", "speed")]


def main(argv):
    kind = argv[0]
    if kind == "speed":
        out = speed([r for r in results(argv[1:]) if r.get("verdict", "bench") == "bench"])
        print(json.dumps(out))
        return 0 if out["ok"] else 1
    if kind == "summary":
        rows = results(argv[1:])
        bad = [r["check"] for r in rows if not r.get("ok") and not r.get("skipped")]
        skipped = [r["check"] for r in rows if r.get("skipped")]
        print(json.dumps({"check": "summary", "ok": not bad and not skipped,
                          "passed": len(rows) - len(bad) - len(skipped), "failed": bad,
                          "skipped": skipped}))
        return 1 if bad or skipped else 0
    name, rc, seconds, log = argv[1], int(argv[2]), float(argv[3]), argv[4]
    try:
        text = open(log, errors="replace").read()
    except OSError:
        text = ""
    if kind == "pytest":
        out = pytest_counts(text)
        empty_ok = argv[5] == "allow-empty" and rc in (0, 5)      # 5: no tests selected
        out["ok"] = (rc == 0 and out.get("passed", 0) > 0) or empty_ok
    elif kind == "curve":
        out = curve(argv[5])
        out["ok"] = out["ok"] and rc == 0
    elif kind == "val":
        out = val(argv[5], argv[6], float(argv[7]))
        out["ok"] = out["ok"] and rc == 0
    elif kind == "json":
        out = last_json(text)
        out["ok"] = bool(out.get("ok")) and rc == 0
    elif kind == "bench":
        out = bench(text)
        out["ok"] = out["ok"] and rc == 0
    else:
        raise SystemExit(f"acceptance.py: unknown kind {kind!r} (pytest, curve, val, json, "
                         "bench, summary, speed)")
    out.pop("check", None)
    row = {"check": name, "verdict": kind, "ok": out.pop("ok"), "rc": rc,
           "seconds": round(seconds, 1),
           "log": log, **out}
    if rc in (124, 137):
        row["timed_out"] = True
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
