"""tests/gpu_acceptance.sh and tests/gpu_speed.sh without a GPU: their verdicts
(tests/scripts/acceptance.py) on made-up outputs, gpu_speed.sh in its CPU dry mode, and (slow)
gpu_acceptance.sh in its CPU dry mode, DEVICE=cpu DRY=1, where every check must pass:
python -m pytest -m slow tests/test_gpu_acceptance.py
"""
import glob
import json
import os
import subprocess
import sys

import pytest

from mpirun import ROOT

SCRIPT = os.path.join(ROOT, "tests", "scripts", "acceptance.py")


def _verdict(tmp_path, kind, name, rc, log_text, *extra):
    log = tmp_path / f"{name}.log"
    log.write_text(log_text)
    out = subprocess.run([sys.executable, SCRIPT, kind, name, str(rc), "1.5", str(log),
                          *map(str, extra)], capture_output=True, text=True,
                          check=True, timeout=60)
    row = json.loads(out.stdout)
    assert row["check"] == name and row["rc"] == rc and row["seconds"] == 1.5
    return row


def _log_json(path, losses, val):
    rows = [{"step": i, "loss": x} for i, x in enumerate(losses)] + [
        {"final": True, "val_loss": val}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pytest_verdict_reads_the_summary_line(tmp_path):
    row = _verdict(tmp_path, "pytest", "s", 1, "x\n== 2 failed, 5 passed, 1 skipped in 3s ==\n",
                   "need-tests")
    assert not row["ok"] and (row["failed"], row["passed"], row["skipped"]) == (2, 5, 1)
    assert _verdict(tmp_path, "pytest", "s", 0, "7 passed in 1s", "need-tests")["ok"]
    all_skipped = "40 skipped, 381 deselected in 2s"
    assert not _verdict(tmp_path, "pytest", "s", 0, all_skipped, "need-tests")["ok"]
    assert _verdict(tmp_path, "pytest", "s", 0, all_skipped, "allow-empty")["ok"]


def test_curve_verdict_wants_finite_and_decreasing(tmp_path):
    good = _log_json(tmp_path / "g.jsonl", [5, 4.8, 4.6, 4.1, 3.9, 3.7], 3.8)
    assert _verdict(tmp_path, "curve", "c", 0, "", good)["ok"]
    nan = _log_json(tmp_path / "n.jsonl", [5, 4.8, float("nan"), 4.1, 3.9, 3.7], 3.8)
    assert not _verdict(tmp_path, "curve", "c", 0, "", nan)["ok"]
    flat = _log_json(tmp_path / "f.jsonl", [5, 5, 5, 5, 5, 5], 5)
    assert not _verdict(tmp_path, "curve", "c", 0, "", flat)["ok"]
    assert not _verdict(tmp_path, "curve", "c", 124, "", good)["ok"]        # timed out
    assert not _verdict(tmp_path, "curve", "c", 0, "", tmp_path / "missing.jsonl")["ok"]


def test_val_verdict_is_relative_to_the_cpu(tmp_path):
    cpu = _log_json(tmp_path / "cpu.jsonl", [5, 4], 3.00)
    near = _log_json(tmp_path / "near.jsonl", [5, 4], 3.05)
    far = _log_json(tmp_path / "far.jsonl", [5, 4], 3.10)
    row = _verdict(tmp_path, "val", "v", 0, "", near, cpu, 0.02)
    assert row["ok"] and abs(row["rel_diff"] - 0.05 / 3) < 1e-12
    assert not _verdict(tmp_path, "val", "v", 0, "", far, cpu, 0.02)["ok"]


def test_json_verdict_takes_the_last_json_line(tmp_path):
    text = 'noise\n{"ok": false}\n{"ok": true, "max_param_diff": 1e-13}\n'
    row = _verdict(tmp_path, "json", "j", 0, text)
    assert row["ok"] and row["max_param_diff"] == 1e-13
    assert not _verdict(tmp_path, "json", "j", 1, text)["ok"]


def test_bench_verdict_wants_a_positive_rate_and_a_finite_loss(tmp_path):
    ok = '{"tokens_per_s": 1000, "ms_per_step": 16.4, "loss": 10.9}\n'
    assert _verdict(tmp_path, "bench", "b", 0, "warming up\n" + ok)["ok"]
    assert _verdict(tmp_path, "bench", "b", 0, '{"tokens_per_s": 900}\n')["ok"]  # peer: no loss
    nan = '{"tokens_per_s": 1000, "loss": NaN}\n'
    assert not _verdict(tmp_path, "bench", "b", 0, nan)["ok"]
    assert not _verdict(tmp_path, "bench", "b", 1, ok)["ok"]
    assert not _verdict(tmp_path, "bench", "b", 0, "Traceback ...\n")["ok"]


def _speed(tmp_path, rows):
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, SCRIPT, "speed", str(results)], capture_output=True,
                         text=True, timeout=60)
    return out.returncode, json.loads(out.stdout)


def test_speed_table_divides_by_the_peer_and_checks_the_targets(tmp_path):
    peer = {"check": "torch_eager_bf16", "ok": True, "tokens_per_s": 200000.0}
    fast = {"check": "bf16_new", "ok": True, "tokens_per_s": 250000, "kernels_per_step": 1400}
    busy = {"check": "bf16", "ok": True, "tokens_per_s": 100000, "kernels_per_step": 9000}
    rc, out = _speed(tmp_path, [fast, busy, peer])
    assert rc == 0 and out["ok"] and out["peer"] == "torch_eager_bf16"
    assert out["runs"]["bf16_new"]["vs_torch_eager_bf16"] == 1.25
    assert out["runs"]["bf16_new"]["meets_targets"] is True
    assert out["runs"]["bf16"]["vs_torch_eager_bf16"] == 0.5
    assert out["runs"]["bf16"]["meets_targets"] is False
    crashed = {"check": "fp32", "ok": False, "rc": 1}
    rc, out = _speed(tmp_path, [crashed, busy])                  # no peer, one crash
    assert rc == 1 and out["failed"] == ["fp32"] and out["peer"] is None
    assert out["runs"]["bf16"]["vs_torch_eager_bf16"] is None


def test_speed_checks_that_the_graph_run_trains_as_the_eager_one(tmp_path):
    eager = {"check": "bf16_new", "ok": True, "tokens_per_s": 9e4, "loss": 7.25}
    same = {"check": "bf16_new_graph", "ok": True, "tokens_per_s": 1e5, "loss": 7.25}
    rc, out = _speed(tmp_path, [eager, same])
    graph = out["graphs"]["bf16_new_graph"]
    assert rc == 0 and graph["ok"] and graph["rel_diff"] == 0
    assert out["graphs"]["bf16_new_drop_graph"] is None
    rc, out = _speed(tmp_path, [eager, dict(same, loss=7.5)])       # a wrong capture
    assert rc == 1 and not out["graphs"]["bf16_new_graph"]["ok"]
    assert out["failed"] == ["bf16_new_graph (its loss or dropout step is not bf16_new's)"]
    rc, out = _speed(tmp_path, [eager])                              # no graph run (CPU)
    assert rc == 0 and out["graphs"]["bf16_new_graph"] is None


def test_speed_checks_that_the_dropout_graph_draws_the_eager_steps(tmp_path):
    """bf16_new_drop_graph against bf16_new_drop: the loss, and the step the masks were last
    drawn for (a counter a replay failed to advance would leave it behind)."""
    eager = {"check": "bf16_new_drop", "ok": True, "tokens_per_s": 9e4, "loss": 7.25,
             "dropout_step": 15}
    same = dict(eager, check="bf16_new_drop_graph")
    rc, out = _speed(tmp_path, [eager, same])
    assert rc == 0 and out["graphs"]["bf16_new_drop_graph"]["ok"]
    rc, out = _speed(tmp_path, [eager, dict(same, dropout_step=5)])
    assert rc == 1 and out["failed"] == [
        "bf16_new_drop_graph (its loss or dropout step is not bf16_new_drop's)"]


def _speed_script(tmp_path, **env):
    env = dict(os.environ, DEVICE="cpu", DRY="1", LOGS=str(tmp_path), MINIDIST_THREADS="1",
               TORCH_REF=str(tmp_path / "no_peer.py"), **env)
    out = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu_speed.sh")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    return out.returncode, [json.loads(ln) for ln in out.stdout.splitlines()
                            if ln.startswith("{")]


def test_speed_script_dry_run_on_the_cpu(tmp_path):
    """DEVICE=cpu DRY=1 bash tests/gpu_speed.sh: the seven minidist runs, then the table."""
    rc, rows = _speed_script(tmp_path)
    names = ["fp32", "tf32", "bf16", "bf16_new", "bf16_new_tiled", "bf16_new_g32",
             "bf16_new_drop"]
    assert rc == 0 and [r["check"] for r in rows] == names + ["speed"]
    assert all(r["ok"] and r["loss"] > 0 and r["device"] == "cpu" for r in rows[:-1])
    assert rows[-1]["ok"] and sorted(rows[-1]["runs"]) == sorted(names)


def test_speed_script_keeps_inside_its_budget(tmp_path):
    """BUDGET: a run that would start with less than 15 s left is recorded as skipped."""
    rc, rows = _speed_script(tmp_path, BUDGET="0")
    assert rc == 1 and all(r.get("skipped") == "BUDGET spent" for r in rows[:-1])
    assert rows[-1]["check"] == "speed" and not rows[-1]["ok"]
    assert rows[-1]["failed"] == [] and len(rows[-1]["skipped"]) == 7


SESSION_ORDER = ["gpu_suite", "gpu_vs_cpu_float64", "gpu_vs_cpu_float32",      # kernels
                 "bf16", "bf16_new",                                            # speed
                 "mpi4_ddp", "mpi4_zero_3", "mpi4_tp_2_amp", "mpi4_dp_2_pp_2",  # ranks
                 "mpi4_cp_2_new", "mpi4_cp_2_ulysses", "mpi4_zero_3_shard_2",
                 "fp32", "tf32", "bf16_new_tiled", "bf16_new_g32", "bf16_new_drop",  # speed2
                 "train_cpu", "train_device", "train_val_within_2pct",          # training
                 "racecheck", "suite_on_device"]                                # races, suite


def _session_script(tmp_path, **env):
    env = dict(os.environ, DEVICE="cpu", DRY="1", LOGS=str(tmp_path), MINIDIST_THREADS="1",
               TORCH_REF=str(tmp_path / "no_peer.py"), SUITE="tests/test_bfloat16.py",
               **env)
    out = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu_session.sh")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    return out.returncode, [json.loads(ln) for ln in out.stdout.splitlines()
                            if ln.startswith("{")]


@pytest.mark.parametrize("script", ["gpu_acceptance.sh", "gpu_speed.sh"])
def test_a_check_named_in_only_that_the_script_lacks_fails(tmp_path, script):
    """ONLY="no_such_check": nothing ran and the summary said ok, exit 0 (a misspelt check
    name passed). Now it is a failed row of its own and the script exits 1."""
    env = dict(os.environ, DEVICE="cpu", DRY="1", LOGS=str(tmp_path), ONLY="no_such_check",
               TORCH_REF=str(tmp_path / "no_peer.py"))
    out = subprocess.run(["bash", os.path.join(ROOT, "tests", script)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows[0] == {"check": "no_such_check", "verdict": rows[0]["verdict"], "ok": False,
                       "error": f"no check no_such_check in {script}"}
    assert not rows[-1]["ok"] and out.returncode == 1, out.stdout


def test_session_script_runs_the_telling_checks_first_and_records_the_rest(tmp_path):
    """tests/gpu_session.sh with no budget: both scripts' checks, each once, in the session's
    order (the CPU has no peer and no graph runs), all recorded as skipped, then one speed
    table over both speed parts and one summary over every part; exit 1."""
    rc, rows = _session_script(tmp_path, BUDGET="0")
    assert [r["check"] for r in rows] == SESSION_ORDER + ["speed", "summary"]
    assert all(r["skipped"] == "BUDGET spent" for r in rows[:-2])
    speed, summary = rows[-2:]
    assert sorted(speed["runs"]) == sorted(["bf16", "bf16_new", "fp32", "tf32",
                                            "bf16_new_tiled", "bf16_new_g32", "bf16_new_drop"])
    assert summary["skipped"] == SESSION_ORDER and summary["failed"] == [] and rc == 1
    saved = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(ln)["check"] for ln in saved] == ["speed", "summary"]


@pytest.mark.slow
@pytest.mark.mpi
def test_session_dry_run_on_the_cpu_passes_every_check(tmp_path):
    """DEVICE=cpu DRY=1 SUITE=tests/test_bfloat16.py bash tests/gpu_session.sh"""
    rc, rows = _session_script(tmp_path, BUDGET="850")
    assert [r["check"] for r in rows] == SESSION_ORDER + ["speed", "summary"]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert rc == 0


@pytest.mark.slow
@pytest.mark.mpi
def test_dry_run_on_the_cpu_passes_every_check(tmp_path):
    """DEVICE=cpu DRY=1 SUITE=tests/test_bfloat16.py bash tests/gpu_acceptance.sh"""
    env = dict(os.environ, DEVICE="cpu", DRY="1", SUITE="tests/test_bfloat16.py",
               LOGS=str(tmp_path), LIMIT="300", MINIDIST_THREADS="1")
    out = subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu_acceptance.sh")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    names = [r["check"] for r in rows]
    assert names == ["gpu_suite", "suite_on_device", "racecheck", "gpu_vs_cpu_float64",
                     "gpu_vs_cpu_float32",
                     "train_cpu", "train_device", "train_val_within_2pct", "mpi4_ddp",
                     "mpi4_zero_3", "mpi4_tp_2_amp", "mpi4_dp_2_pp_2", "mpi4_cp_2_new",
                     "mpi4_cp_2_ulysses", "mpi4_zero_3_shard_2", "summary"], out.stderr
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert out.returncode == 0
    assert (tmp_path / "results.jsonl").read_text().count("\n") == len(rows)


def _common(tmp_path, body, path=None, **env):
    """bash: tests/scripts/gpu_common.sh sourced, then `body`; (rc, stdout, stderr)."""
    env = dict(os.environ, **{"LOGS": str(tmp_path / "logs"), "LIMIT": "60", **env})
    if path is not None:
        env["PATH"] = path
    out = subprocess.run(["bash", "-c", ". tests/scripts/gpu_common.sh\n" + body], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout, out.stderr


def test_a_pytest_cut_by_its_limit_still_names_its_failures(tmp_path):
    """Review 40: `timeout`'s SIGTERM killed pytest before its summary, and a cut check's log
    held progress dots only. `run` interrupts with SIGINT: the log names the failure and
    counts what passed, and the verdict is a failed check with those counts.

        LOGS=/tmp/l LIMIT=6 bash -c '. tests/scripts/gpu_common.sh; run cut pytest \\
            allow-empty -- python -m pytest -q -rfE TESTS'   (a failing, a passing and a
        sleeping test)"""
    (tmp_path / "test_cut.py").write_text(
        "import time\n\n\ndef test_a():\n    assert 1 == 2\n\n\n"
        "def test_b():\n    pass\n\n\ndef test_c():\n    time.sleep(120)\n")
    rc, out, _ = _common(tmp_path, f'run cut pytest allow-empty -- "$PY" -m pytest -q -rfE '
                         f'--tb=short -p no:cacheprovider {tmp_path / "test_cut.py"}',
                         LIMIT="8")
    row = json.loads(out.splitlines()[-1])
    assert row["check"] == "cut" and not row["ok"], row
    assert (row["failed"], row["passed"]) == (1, 1), row
    log = (tmp_path / "logs" / "cut.log").read_text()
    assert "FAILED" in log and "test_a" in log and "KeyboardInterrupt" in log, log


def test_no_mpi_and_no_wheels_is_one_failed_setup_row_before_any_check(tmp_path):
    """`import mpi4py` succeeds without an MPI library, so a machine with neither an MPI nor
    .whl/'s wheels ran every check into the same import error. gpu_common now asks for
    mpi4py.MPI and mpiexec and stops at once with one row saying what to carry."""
    bin_dir = tmp_path / "bin"                      # a python3 without mpi4py, no mpiexec
    bin_dir.mkdir()
    system = "/usr/bin/python3"
    if not os.path.exists(system) or subprocess.run(
            [system, "-c", "import mpi4py"], capture_output=True, timeout=60).returncode == 0:
        pytest.skip("needs a python3 without mpi4py at /usr/bin/python3")
    if glob.glob(os.path.join(ROOT, ".whl", "*.whl")):
        pytest.skip("this checkout has .whl/'s wheels (a GPU session's): gpu_common uses them")
    os.symlink(system, bin_dir / "python3")
    rc, out, _ = _common(tmp_path, 'echo "a check ran"', path=f"{bin_dir}:/bin")
    assert rc == 1 and "a check ran" not in out, out
    row = json.loads(out.splitlines()[-1])
    assert row["check"] == "setup" and not row["ok"]
    assert row["error"].startswith("no MPI: python3 cannot load mpi4py.MPI and .whl/ holds "
                                   "no mpi4py and mpich wheels"), row
