"""The verdicts of tests/gpu_acceptance.sh: each call reads one check's output and prints one
JSON line {"check", "ok", "rc", "seconds", "log", ...details}; the exit status is 0 either
way (the script goes on to the next check; `summary` exits 1 if any check failed).

    acceptance.py pytest NAME RC SECONDS LOG EMPTY    pytest's summary counts; EMPTY is
                                                      allow-empty (all skipped is ok: the
                                                      gpu tests on a CPU) or need-tests
    acceptance.py curve NAME RC SECONDS LOG LOGJSON   --log-json rows: finite, decreasing
    acceptance.py val NAME RC SECONDS LOG DEV CPU TOL final val_loss within TOL of the CPU's
    acceptance.py json NAME RC SECONDS LOG            the last JSON line the command printed
    acceptance.py summary RESULTS                     one line: how many checks passed

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


def main(argv):
    kind = argv[0]
    if kind == "summary":
        rows = [json.loads(line) for line in open(argv[1]) if line.strip()]
        bad = [r["check"] for r in rows if not r.get("ok")]
        print(json.dumps({"check": "summary", "ok": not bad, "passed": len(rows) - len(bad),
                          "failed": bad}))
        return 1 if bad else 0
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
    else:
        raise SystemExit(f"acceptance.py: unknown kind {kind!r} (pytest, curve, val, json, "
                         "summary)")
    out.pop("check", None)
    row = {"check": name, "ok": out.pop("ok"), "rc": rc, "seconds": round(seconds, 1),
           "log": log, **out}
    if rc in (124, 137):
        row["timed_out"] = True
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
